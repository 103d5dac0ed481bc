// Measures the GPU -> proxy command path without a transport: one warp per ring pushes numbered no-op commands
// (ring_producer.cuh), one host thread per ring pops them as a proxy thread would and checks that each arrives
// once, in order. A second kernel plays ping-pong with one host thread (push one command, wait until the host has
// seen it) for the round-trip latency. A third bounds the one-way latency, push to proxy, on the host's clock alone
// (the GPU's and the host's clocks are not one clock): see one_way_kernel.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../../proxy/ring.hpp"
#include "api.hpp"
#include "device_common.cuh"
#include "ring_producer.cuh"
#include "testing.hpp"

namespace uccl_ep::nvl {
namespace {

__global__ void push_kernel(const DeviceRing* rings, uint64_t commands_per_ring, uint64_t timeout_ns, int* failed) {
  const DeviceRing ring = rings[blockIdx.x];
  const int lane = threadIdx.x % 32;
  uint64_t head = 0, tail_seen = 0;
  const uint64_t deadline = global_ns() + timeout_ns;
  for (uint64_t i = 0; i < commands_per_ring; i += 32) {
    const int count = int(min(uint64_t(32), commands_per_ring - i));
    Command cmd{};
    cmd.op = Op::kNop;
    cmd.peer = blockIdx.x;
    cmd.local_offset = i + uint64_t(lane);  // the sequence number the consumer checks
    if (!warp_push(ring, cmd, count, head, tail_seen, deadline)) {
      if (lane == 0) atomicExch(failed, 1);
      return;
    }
  }
}

// One command at a time; the host writes how many it has seen into `seen` (mapped memory).
__global__ void ping_kernel(DeviceRing ring, uint64_t rounds, const uint64_t* seen, uint64_t* round_trip_ns,
                            uint64_t timeout_ns, int* failed) {
  const int lane = threadIdx.x % 32;
  uint64_t head = 0, tail_seen = 0;
  const uint64_t deadline = global_ns() + timeout_ns;
  for (uint64_t r = 0; r < rounds; ++r) {
    const uint64_t start = global_ns();
    Command cmd{};
    cmd.op = Op::kNop;
    cmd.local_offset = r;
    if (!warp_push(ring, cmd, 1, head, tail_seen, deadline)) {
      if (lane == 0) atomicExch(failed, 1);
      return;
    }
    int late = 0;
    if (lane == 0) {
      while (load_acquire_sys(seen) < r + 1)
        if (global_ns() > deadline) {
          atomicExch(failed, 1);
          late = 1;
          break;
        }
      round_trip_ns[r] = global_ns() - start;
    }
    if (__shfl_sync(0xffffffffu, late, 0)) return;
  }
}

// One-way latency without a shared clock. A host thread keeps writing its clock (steady_clock ns) into `host_clock`
// (mapped memory); each round, lane 0 reads it, which gives the host's time at the moment the read reached host
// memory, and the warp at once pushes one command that carries that time. The proxy thread's clock when it pops
// the command, minus the carried time, is the push-to-proxy latency plus the read's way back to the GPU (and the
// clock word's staleness): an upper bound. Less a whole read round trip (`read_ns`, timed here on the GPU over
// 256 dependent reads) it is a lower bound. read_ns[1]: the mean time the warp spent in warp_push. The warp
// waits for the proxy's `seen` before the next round, so every command finds an idle ring and an idle proxy.
__global__ void one_way_kernel(DeviceRing ring, uint64_t rounds, const uint64_t* host_clock, const uint64_t* seen,
                               uint64_t* read_ns, uint64_t timeout_ns, int* failed) {
  const int lane = threadIdx.x % 32;
  uint64_t head = 0, tail_seen = 0;
  const uint64_t deadline = global_ns() + timeout_ns;
  if (lane == 0) {
    constexpr int kReads = 256;
    const uint64_t* p = host_clock;
    const uint64_t start = global_ns();
    // Each read's address depends on the one before (the clock never reads all ones), so none overlap.
    for (int i = 0; i < kReads; ++i) p = host_clock + (load_acquire_sys(p) == ~0ull);
    read_ns[0] = (global_ns() - start) / kReads + (p != host_clock);
  }
  __syncwarp();
  uint64_t push_ns = 0;  // the warp's time in warp_push, summed (the timer's ticks are coarse, the sum is not)
  for (uint64_t r = 0; r < rounds; ++r) {
    uint64_t stamp = 0;
    if (lane == 0) stamp = load_acquire_sys(host_clock);
    Command cmd{};
    cmd.op = Op::kNop;
    cmd.local_offset = r;
    cmd.remote_offset = __shfl_sync(0xffffffffu, stamp, 0);
    const uint64_t before = global_ns();
    if (!warp_push(ring, cmd, 1, head, tail_seen, deadline)) {
      if (lane == 0) atomicExch(failed, 1);
      return;
    }
    push_ns += global_ns() - before;
    int late = 0;
    if (lane == 0)
      while (load_acquire_sys(seen) < r + 1)
        if (global_ns() > deadline) {
          atomicExch(failed, 1);
          late = 1;
          break;
        }
    if (__shfl_sync(0xffffffffu, late, 0)) return;
  }
  if (lane == 0) read_ns[1] = push_ns / max(rounds, uint64_t(1));
}

uint64_t host_ns() {
  return uint64_t(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

double percentile(std::vector<uint64_t>& v, int pct) {
  std::sort(v.begin(), v.end());
  return double(v[std::min(v.size() - 1, v.size() * size_t(pct) / 100)]);
}

struct Pinned {  // one mapped host allocation, freed on scope exit
  void* p = nullptr;
  explicit Pinned(size_t bytes) {
    check(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
    std::memset(p, 0, bytes);
  }
  ~Pinned() { cudaFreeHost(p); }
};

__device__ __forceinline__ uint32_t payload_word(uint32_t rank, uint64_t i) {
  return rank * 0x9E3779B1u ^ (uint32_t(i) * 2654435761u + 12345u);
}

// One warp: see proxy_put in api.hpp. out: mismatched words, then push / quiet / arrival ns, then the status.
__global__ void proxy_put_kernel(ProxyPutArgs a, DeviceRing ring, uint32_t peer_rank, uint64_t timeout_ns,
                                 uint64_t* out) {
  const int lane = threadIdx.x % 32;
  const uint64_t start = global_ns(), deadline = start + timeout_ns;
  uint32_t* words = reinterpret_cast<uint32_t*>(a.payload);
  for (uint64_t i = lane; i < a.bytes / 4; i += 32) words[i] = payload_word(a.rank, i);
  __syncwarp();
  __threadfence_system();  // the payload lands before the commands that send it (a push orders nothing before it)
  uint64_t head = 0, tail_seen = 0;
  ring_position(ring, head, tail_seen);  // after the host's pushes so far
  // Command c of the stream: write c % (writes + 1) of its message, or the message's fence.
  const uint64_t per_message = uint64_t(a.writes) + 1, commands = per_message * a.messages;
  int status = 0;
  for (uint64_t c0 = 0; c0 < commands && status == 0; c0 += 32) {
    const uint64_t piece = (c0 + lane) % per_message;
    Command cmd = a.fence;
    if (piece < a.writes) {
      cmd = a.write;
      cmd.local_offset += piece * a.write.length;
      cmd.remote_offset += piece * a.write.length;
    }
    if (!warp_push(ring, cmd, int(min(uint64_t(32), commands - c0)), head, tail_seen, deadline)) status = 1;
  }
  const uint64_t pushed = global_ns();
  if (lane == 0 && status == 0 && !wait_count(a.retired, head, deadline)) status = 2;  // the device quiet
  status = __shfl_sync(0xffffffffu, status, 0);
  const uint64_t quiet = global_ns();
  if (lane == 0 && status == 0 && !wait_count(a.released, a.released_target + a.messages - 1, deadline)) status = 3;
  status = __shfl_sync(0xffffffffu, status, 0);
  const uint64_t arrived = global_ns();
  uint64_t bad = 0;
  const volatile uint32_t* in = reinterpret_cast<const volatile uint32_t*>(a.arrived);
  for (uint64_t i = lane; status == 0 && i < a.bytes / 4; i += 32) bad += in[i] != payload_word(peer_rank, i);
  for (int d = 16; d > 0; d /= 2) bad += __shfl_xor_sync(0xffffffffu, bad, d);
  if (lane == 0) {
    out[0] = bad;
    out[1] = pushed - start;
    out[2] = quiet - start;
    out[3] = arrived - start;
    out[4] = uint64_t(status);
  }
}

struct OneWay {
  double upper_median_ns, upper_p99_ns, read_ns, push_ns;
};

// `rounds` rounds of one_way_kernel on the current device, with a clock thread and a proxy thread.
OneWay one_way(uint32_t ring_capacity, uint64_t rounds, uint64_t timeout) {
  CommandRing ring(ring_capacity);
  Pinned clock_word(256), seen(sizeof(uint64_t)), out(2 * sizeof(uint64_t)), failed(sizeof(int));
  std::atomic<bool> done{false};
  std::vector<uint64_t> upper(rounds, 0);
  const uint64_t epoch = host_ns() - 1;  // stamps count from here: small, never 0, within a ring's 48 offset bits
  std::thread clock([&] {
    auto* word = reinterpret_cast<std::atomic<uint64_t>*>(clock_word.p);
    while (!done.load(std::memory_order_relaxed)) word->store(host_ns() - epoch, std::memory_order_release);
  });
  std::thread proxy([&] {
    Command cmd;
    uint64_t n = 0;
    while (n < rounds && !done.load(std::memory_order_relaxed)) {
      if (!ring.try_pop(&cmd)) continue;
      const uint64_t now = host_ns();
      if (cmd.local_offset == n && cmd.remote_offset != 0) upper[n] = now - epoch - cmd.remote_offset;
      reinterpret_cast<std::atomic<uint64_t>*>(seen.p)->store(++n, std::memory_order_release);
    }
  });
  while (*static_cast<volatile uint64_t*>(clock_word.p) == 0) std::this_thread::yield();  // the clock runs
  one_way_kernel<<<1, 32>>>(device_ring(ring), rounds, device_view(static_cast<uint64_t*>(clock_word.p)),
                            device_view(static_cast<uint64_t*>(seen.p)), device_view(static_cast<uint64_t*>(out.p)),
                            timeout, static_cast<int*>(device_view(failed.p)));
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  done.store(true);
  clock.join();
  proxy.join();
  check(e, "one_way_kernel");
  if (*static_cast<volatile int*>(failed.p)) throw std::runtime_error("ring_bench: the one-way rounds timed out");
  if (std::count(upper.begin(), upper.end(), uint64_t(0)) != 0)
    throw std::runtime_error("ring_bench: a one-way command arrived out of order or without its clock stamp");
  const volatile uint64_t* o = static_cast<const volatile uint64_t*>(out.p);
  return OneWay{percentile(upper, 50), percentile(upper, 99), double(o[0]), double(o[1])};
}
}  // namespace

ProxyPutResult proxy_put(int cuda_device, const ProxyPutArgs& args, uint32_t peer_rank) {
  if (args.writes == 0 || args.messages == 0 || args.bytes % (4 * uint64_t(args.writes)) != 0)
    throw std::invalid_argument("proxy_put: bytes must be a multiple of 4 * writes, messages and writes at least 1");
  check(cudaSetDevice(cuda_device), "cudaSetDevice");
  ProxyPutArgs a = args;
  a.payload = device_view(args.payload);
  a.arrived = device_view(args.arrived);
  a.retired = device_view(args.retired);
  a.released = device_view(args.released);
  const DeviceRing ring{device_view(args.ring_slots), device_view(args.ring_head), device_view(args.ring_tail),
                        args.ring_capacity - 1, ring_shift(args.ring_capacity)};
  Pinned out(5 * sizeof(uint64_t));
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  proxy_put_kernel<<<1, 32, 0, stream>>>(a, ring, peer_rank, timeout_ns(), device_view(static_cast<uint64_t*>(out.p)));
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  check(e, "proxy_put_kernel");
  const volatile uint64_t* o = static_cast<const volatile uint64_t*>(out.p);
  return ProxyPutResult{o[0], o[1] * 1e-3, o[2] * 1e-3, o[3] * 1e-3, int(o[4])};
}

RingBenchResult ring_bench(int cuda_device, int num_rings, uint64_t commands_per_ring, uint32_t ring_capacity,
                           uint64_t ping_rounds) {
  if (num_rings < 1 || num_rings > 1024) throw std::invalid_argument("ring_bench: 1 to 1024 rings");
  if (!install_pinned_host_allocator()) throw std::runtime_error("ring_bench: no GPU");
  check(cudaSetDevice(cuda_device), "cudaSetDevice");
  const uint64_t timeout = timeout_ns();
  RingBenchResult result{};

  // Throughput: every ring's warp pushes at once; one host thread drains each ring.
  std::vector<std::unique_ptr<CommandRing>> rings;
  std::vector<DeviceRing> views;
  for (int i = 0; i < num_rings; ++i) {
    rings.push_back(std::make_unique<CommandRing>(ring_capacity));
    views.push_back(device_ring(*rings.back()));
  }
  DeviceRing* views_device = nullptr;
  check(cudaMalloc(&views_device, sizeof(DeviceRing) * views.size()), "cudaMalloc");
  Pinned failed(sizeof(int));
  check(cudaMemcpy(views_device, views.data(), sizeof(DeviceRing) * views.size(), cudaMemcpyHostToDevice),
        "cudaMemcpy");
  std::atomic<uint64_t> out_of_order{0}, received{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> consumers;
  for (int i = 0; i < num_rings; ++i)
    consumers.emplace_back([&, i] {
      CommandRing& ring = *rings[i];
      uint64_t expected = 0;
      Command cmd;
      while (expected < commands_per_ring && !stop.load(std::memory_order_relaxed)) {
        if (!ring.try_pop(&cmd)) continue;
        if (cmd.local_offset != expected || cmd.peer != uint32_t(i)) out_of_order.fetch_add(1);
        ++expected;
      }
      received.fetch_add(expected);
    });
  const auto start = std::chrono::steady_clock::now();
  push_kernel<<<num_rings, 32>>>(views_device, commands_per_ring, timeout, static_cast<int*>(device_view(failed.p)));
  cudaError_t launched = cudaGetLastError();
  if (launched == cudaSuccess) launched = cudaDeviceSynchronize();
  const auto pushed = std::chrono::steady_clock::now();
  if (launched != cudaSuccess || *static_cast<volatile int*>(failed.p)) stop.store(true);
  for (auto& t : consumers) t.join();
  const auto drained = std::chrono::steady_clock::now();
  cudaFree(views_device);
  check(launched, "push_kernel");
  if (*static_cast<volatile int*>(failed.p))
    throw std::runtime_error("ring_bench: a ring stayed full past UCCL_EP_TIMEOUT_S (consumer stuck?)");
  result.seconds = std::chrono::duration<double>(drained - start).count();
  result.push_seconds = std::chrono::duration<double>(pushed - start).count();
  result.commands = received.load();
  result.out_of_order = out_of_order.load();

  // Latency: ping-pong through one ring.
  if (ping_rounds > 0) {
    CommandRing ring(ring_capacity);
    Pinned seen(sizeof(uint64_t));
    *static_cast<int*>(failed.p) = 0;
    uint64_t* round_trips = nullptr;
    check(cudaMalloc(&round_trips, sizeof(uint64_t) * ping_rounds), "cudaMalloc");
    std::thread echo([&] {
      Command cmd;
      uint64_t n = 0;
      while (n < ping_rounds && !stop.load(std::memory_order_relaxed)) {
        if (!ring.try_pop(&cmd)) continue;
        reinterpret_cast<std::atomic<uint64_t>*>(seen.p)->store(++n, std::memory_order_release);
      }
    });
    stop.store(false);
    ping_kernel<<<1, 32>>>(device_ring(ring), ping_rounds, device_view(static_cast<uint64_t*>(seen.p)), round_trips,
                           timeout, static_cast<int*>(device_view(failed.p)));
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess || *static_cast<volatile int*>(failed.p)) stop.store(true);
    echo.join();
    std::vector<uint64_t> ns(ping_rounds);
    if (e == cudaSuccess)
      e = cudaMemcpy(ns.data(), round_trips, sizeof(uint64_t) * ping_rounds, cudaMemcpyDeviceToHost);
    cudaFree(round_trips);
    check(e, "ping_kernel");
    if (*static_cast<volatile int*>(failed.p)) throw std::runtime_error("ring_bench: the ping-pong timed out");
    result.round_trip_median_ns = percentile(ns, 50);
    result.round_trip_p99_ns = percentile(ns, 99);

    const OneWay w = one_way(ring_capacity, ping_rounds, timeout);
    result.one_way_upper_median_ns = w.upper_median_ns;
    result.one_way_upper_p99_ns = w.upper_p99_ns;
    result.host_read_round_trip_ns = w.read_ns;
    result.push_ns = w.push_ns;
  }
  return result;
}

}  // namespace uccl_ep::nvl
