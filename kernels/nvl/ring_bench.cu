// Measures the GPU -> proxy command path without a transport: one warp per ring pushes numbered no-op commands
// (ring_producer.cuh), one host thread per ring pops them as a proxy thread would and checks that each arrives
// once, in order. A second kernel plays ping-pong with one host thread (push one command, wait until the host has
// seen it) for the round-trip latency.
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
  __syncwarp();  // the payload, then the commands: warp_push's release store of the head covers the lanes' stores
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
                        args.ring_capacity - 1};
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
    std::sort(ns.begin(), ns.end());
    result.round_trip_median_ns = double(ns[ns.size() / 2]);
    result.round_trip_p99_ns = double(ns[std::min(ns.size() - 1, ns.size() * 99 / 100)]);
  }
  return result;
}

}  // namespace uccl_ep::nvl
