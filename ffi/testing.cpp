// `jax_uccl_ep._uccl_ep_testing`: hooks for tests and benchmarks, an extension of its own that the package never
// loads. The proxy transport driven directly (messages, quiets, the words proxies publish), ring and kernel
// microbenchmarks, kernel timings, and the test modes. It links the same core library as `_uccl_ep`, so it sees
// the runtimes that initialize() started.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <iterator>
#include <random>
#include <stdexcept>
#include <thread>

#include "../kernels/settings.hpp"
#include "../proxy/runtime.hpp"
#include "python_errors.hpp"
#ifdef UCCL_EP_WITH_CUDA
#include <cuda_runtime.h>

#include "../kernels/nvl/api.hpp"
#include "../kernels/nvl/testing.hpp"
#endif

namespace nb = nanobind;
using namespace uccl_ep;

namespace {

// Commands per second through one ring with one consumer thread: the ring alone, no transport. The consumer
// also checks that commands come out in the order they went in.
nb::dict ring_commands_per_second(uint32_t capacity, uint64_t count) {
  CommandRing ring(capacity);
  std::atomic<uint64_t> seen{0}, out_of_order{0};
  std::thread consumer([&] {
    Command c;
    uint64_t n = 0, bad = 0;
    while (n < count)
      if (ring.try_pop(&c)) bad += c.local_offset != n++;
    seen.store(n);
    out_of_order.store(bad);
  });
  auto t0 = std::chrono::steady_clock::now();
  Command cmd{Op::kWrite, 0, 0, 1, 0, 0, 64, 0};
  for (uint64_t i = 0; i < count; ++i) {
    cmd.local_offset = i;
    while (!ring.try_push(cmd)) {
    }
  }
  consumer.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  nb::gil_scoped_acquire gil;
  nb::dict d;
  d["commands_per_second"] = double(seen.load()) / s;
  d["received"] = seen.load();
  d["out_of_order"] = out_of_order.load();
  return d;
}

// A producer whose slot words land one at a time, in a random order, as a GPU's stores may cross PCIe: the
// consumer must take no slot before all four words landed, and then the exact command. `positions` pushes through
// a ring of `capacity` slots (positions / capacity laps: past 65535 the lap tags wrap).
nb::dict ring_slots_land_in_pieces(uint32_t capacity, uint64_t positions, uint32_t seed) {
  CommandRing ring(capacity);
  std::mt19937_64 rng(seed);
  uint64_t early = 0, wrong = 0;
  for (uint64_t p = 0; p < positions; ++p) {
    const Command cmd{Op(1 + rng() % 3),   uint8_t(rng()),  0, uint32_t(rng()), rng() & kOffsetMask,
                      rng() & kOffsetMask, uint32_t(rng()), 0};
    uint64_t words[4];
    encode_slot(cmd, lap_tag(p, ring.shift()), words);
    int order[4] = {0, 1, 2, 3};
    std::shuffle(order, order + 4, rng);
    Command out{};
    for (int i = 0; i < 4; ++i) {
      ring.slots()[p & (capacity - 1)].words[order[i]] = words[order[i]];
      if (i < 3) early += ring.try_pop(&out);
    }
    if (!ring.try_pop(&out) || out.op != cmd.op || out.reserved0 != cmd.reserved0 || out.peer != cmd.peer ||
        out.local_offset != cmd.local_offset || out.remote_offset != cmd.remote_offset || out.length != cmd.length)
      ++wrong;
  }
  nb::dict d;
  d["popped_early"] = early;
  d["wrong"] = wrong;
  return d;
}

}  // namespace

#ifdef UCCL_EP_WITH_CUDA
// nvl::KernelKind's names, in its order.
const char* const kKernelKinds[] = {
    "scan", "dispatch_send", "dispatch_receive", "combine_send",  "combine_receive", "routing",
    "acks", "routing_sent",  "scan_counted",     "scan_counting", "scan_placing"};
static_assert(std::size(kKernelKinds) == size_t(nvl::KernelKind::kCount), "a name per kernel kind");
#endif

NB_MODULE(_uccl_ep_testing, m) {
  register_error_translator();
  // Set before initialize() (a proxy device takes its modes when it is created); tests/spawn.py sets them from
  // the environment in every process it starts.
  m.def(
      "set_test_modes",
      [](bool reorder, bool poison, bool stuck_proxy) {
        proxy_test_modes() = ProxyTestModes{reorder, stuck_proxy};
        handler_test_modes() = HandlerTestModes{poison};
      },
      nb::arg("reorder") = false, nb::arg("poison") = false, nb::arg("stuck_proxy") = false);
  m.def("test_modes", [] {
    nb::dict d;
    d["reorder"] = proxy_test_modes().reorder;
    d["poison"] = handler_test_modes().poison;
    d["stuck_proxy"] = proxy_test_modes().stuck_proxy;
    return d;
  });
#ifdef UCCL_EP_WITH_CUDA
  m.def("nvl_num_sms", [] { return nvl::num_sms(); });
  m.def("nvl_send_blocks", [] { return nvl::normal_send_blocks(); });
  m.def("nvl_allow_budget_past_the_gpu", [](bool allow) { nvl::allow_budget_past_the_gpu(allow); }, nb::arg("allow"));
  m.def(
      "nvl_set_bulk_tuning",
      [](int lag, int stages_per_producer, int combine_stages, int send_producers, int send_rows,
         int announce_one_fence) {
        nvl::set_bulk_tuning({lag, stages_per_producer, combine_stages, send_producers, send_rows, announce_one_fence});
      },
      nb::arg("lag") = 0, nb::arg("stages_per_producer") = 0, nb::arg("combine_stages") = 0,
      nb::arg("send_producers") = 0, nb::arg("send_rows") = 0, nb::arg("announce_one_fence") = 0);
  m.def("nvl_kernel_times", [] {  // {local GPU index: [(op, microseconds)]} since the last call
    std::vector<std::vector<std::pair<std::string, float>>> out;
    for (auto* d : nvl::NvlRuntime::get().devices()) out.push_back(d->kernel_times());
    return out;
  });
  m.def("nvl_low_latency_blocks", [] { return nvl::low_latency_blocks(); });
  m.def("nvl_kernel_phases", [] {  // per local GPU: the low-latency kernels' phase stamps in microseconds
    std::vector<std::vector<double>> out;
    for (auto* d : nvl::NvlRuntime::get().devices()) {
      int khz = 0;
      cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, d->cuda_device());
      std::vector<double> us;
      for (uint64_t c : d->kernel_phases()) us.push_back(khz > 0 ? double(c) / khz * 1000.0 : 0.0);
      out.push_back(us);
    }
    return out;
  });
  m.def("nvl_bulk_copies", [] { return nvl::bulk_copies(); });
  m.def("nvl_start_kernel_stamps", &nvl::start_kernel_stamps, nb::arg("cuda_device"));
  m.def(
      "nvl_stop_kernel_stamps",
      [](int cuda_device) {  // {kind: (start, length) in us} of the kinds that ran since the start
        nb::dict out;
        const auto spans = nvl::stop_kernel_stamps(cuda_device);
        for (size_t k = 0; k < spans.size(); ++k)
          if (spans[k][1] >= 0) out[kKernelKinds[k]] = nb::make_tuple(spans[k][0], spans[k][1]);
        return out;
      },
      nb::arg("cuda_device"));
  m.def(
      "nvl_loopback_bench",
      [](int device, int tokens, int hidden, int topk, int experts, bool fp8, int iters, uint64_t seed, int ranks,
         bool one_way, bool sides_apart, int gpus) {
        nvl::LoopbackResult r;
        {
          nb::gil_scoped_release release;
          r = nvl::loopback_bench(nvl::LoopbackArgs{device, tokens, hidden, topk, experts, fp8, iters, seed, ranks,
                                                    one_way, sides_apart, gpus});
        }
        nb::dict d;
        d["dispatch_us"] = r.dispatch_us;
        d["combine_us"] = r.combine_us;
        d["remote_rows"] = r.remote_rows;
        d["received_rows"] = r.received_rows;
        d["x_row_bytes"] = r.x_row_bytes;
        d["mismatched_rows"] = r.mismatched_rows;
        d["mismatched_expert_counts"] = r.mismatched_expert_counts;
        d["mismatched_combine_rows"] = r.mismatched_combine_rows;
        d["num_sms"] = nvl::num_sms();
        d["bulk"] = nvl::bulk_copies();
        const auto spans_dict = [&](const double (*spans)[int(nvl::KernelKind::kCount)][2]) {
          nb::dict out;
          for (int op = 0; op < 2; ++op)
            for (int k = 0; k < int(nvl::KernelKind::kCount); ++k)
              if (spans[op][k][1] >= 0)
                out[(std::string(op ? "combine:" : "dispatch:") + kKernelKinds[k]).c_str()] =
                    nb::make_tuple(spans[op][k][0], spans[op][k][1]);
          return out;
        };
        d["spans_us"] = spans_dict(r.spans);  // one more call of each op: (start after the op's first kernel, length)
        nb::list gpu_spans;                   // the same per GPU, on its own clock
        for (int g = 0; g < gpus; ++g) gpu_spans.append(spans_dict(r.gpu_spans[g]));
        d["gpu_spans_us"] = gpu_spans;
        return d;
      },
      nb::arg("device"), nb::arg("tokens"), nb::arg("hidden"), nb::arg("topk"), nb::arg("experts"), nb::arg("fp8"),
      nb::arg("iters"), nb::arg("seed"), nb::arg("ranks") = 2, nb::arg("one_way") = false,
      nb::arg("sides_apart") = false, nb::arg("gpus") = 1);
  m.def(
      "nvl_copy_bench",
      [](int device, int blocks, int64_t bytes_per_block, uint32_t stage_bytes, int stages, int producers, bool warps,
         const std::string& direction, int gpus) {
        nvl::CopyDirection d = nvl::CopyDirection::kLocal;
        if (direction == "push")
          d = nvl::CopyDirection::kPush;
        else if (direction == "pull")
          d = nvl::CopyDirection::kPull;
        else if (direction != "local")
          throw std::invalid_argument("nvl_copy_bench: direction local, push or pull, not " + direction);
        nb::gil_scoped_release release;
        return nvl::copy_bench(device, blocks, bytes_per_block, stage_bytes, stages, producers, warps, d, gpus);
      },
      nb::arg("device"), nb::arg("blocks"), nb::arg("bytes_per_block"), nb::arg("stage_bytes"), nb::arg("stages"),
      nb::arg("producers"), nb::arg("warps"), nb::arg("direction") = "local", nb::arg("gpus") = 1);
  m.def("nvl_ring_bench",
        [](int device, int num_rings, uint64_t commands_per_ring, uint32_t capacity, uint64_t ping_rounds) {
          nvl::RingBenchResult r;
          {
            nb::gil_scoped_release release;
            r = nvl::ring_bench(device, num_rings, commands_per_ring, capacity, ping_rounds);
          }
          nb::dict d;
          d["seconds"] = r.seconds;
          d["push_seconds"] = r.push_seconds;
          d["commands"] = r.commands;
          d["out_of_order"] = r.out_of_order;
          d["round_trip_median_ns"] = r.round_trip_median_ns;
          d["round_trip_p99_ns"] = r.round_trip_p99_ns;
          d["one_way_upper_median_ns"] = r.one_way_upper_median_ns;
          d["one_way_upper_p99_ns"] = r.one_way_upper_p99_ns;
          d["host_read_round_trip_ns"] = r.host_read_round_trip_ns;
          d["push_ns"] = r.push_ns;
          return d;
        });
  // A GPU of the proxy runtime sends `peer` one message from a kernel and awaits peer's (nvl::proxy_put); both
  // ranks of a pair call it at once. Keeps the host's message count in step (wait_message after the kernel).
  m.def(
      "proxy_gpu_put",
      [](uint32_t rank, uint32_t peer, uint64_t bytes, int channel, uint32_t messages, uint32_t writes) {
        Device& d = Runtime::get().device_by_rank(rank);
        if (peer == rank || peer >= d.num_ranks() || channel < 0 || channel >= d.num_channels() || writes == 0 ||
            bytes % (4 * uint64_t(writes)) != 0 || bytes == 0 || bytes > d.region_bytes() || bytes > UINT32_MAX ||
            messages == 0 || messages > kEpochWindow / 2 || writes >= kMaxWritesPerMessage)
          throw std::invalid_argument("proxy_gpu_put: another rank, a channel of this device, 0 < bytes <= " +
                                      std::to_string(d.region_bytes()) + " (a multiple of 4 * writes), 1 to " +
                                      std::to_string(kEpochWindow / 2) + " messages of 1 to " +
                                      std::to_string(kMaxWritesPerMessage - 1) + " writes");
        nvl::ProxyPutResult r;
        {
          nb::gil_scoped_release release;
          std::lock_guard<std::mutex> lock(d.op_mutex());
          d.check_usable("proxy_gpu_put");
          CommandRing& ring = d.ring(channel);
          nvl::ProxyPutArgs a{};
          a.ring_slots = ring.slots();
          a.ring_head = ring.head_word();
          a.ring_tail = ring.tail_word();
          a.ring_capacity = ring.capacity();
          a.retired = d.retired_word(channel);
          a.released = d.released_word(peer, channel);
          a.released_target = d.consumed(peer, channel) + 1;
          a.payload = d.buffer() + d.send_offset(peer);
          a.arrived = d.buffer() + d.recv_offset(peer);
          a.bytes = bytes;
          a.messages = messages;
          a.writes = writes;
          a.write =
              Command{Op::kWrite, 0, 0, peer, d.send_offset(peer), d.recv_offset(rank), uint32_t(bytes / writes), 0};
          a.fence = message_fence(peer);
          a.rank = rank;
          r = nvl::proxy_put(d.ordinal(), a, peer);
          if (r.timed_out != 0) {  // the host's counts no longer match what the kernel did: out of step
            static const char* what[] = {"", "the ring stayed full", "its writes were not retired",
                                         "the peer's messages did not arrive"};
            const std::string message = "uccl_ep proxy_gpu_put: rank " + std::to_string(rank) + ": " +
                                        what[std::min(r.timed_out, 3)] + " within UCCL_EP_TIMEOUT_S (peer " +
                                        std::to_string(peer) + ")";
            d.abort({peer}, message);
            throw TimeoutError(message);
          }
          for (uint32_t i = 0; i < messages; ++i)
            d.wait_message(channel, peer, "proxy_gpu_put");  // consume them here too
        }
        nb::dict out;
        out["mismatched_words"] = r.mismatched_words;
        out["push_us"] = r.push_us;
        out["quiet_us"] = r.quiet_us;
        out["arrival_us"] = r.arrival_us;
        out["timed_out"] = r.timed_out;
        out["commands"] = uint64_t(messages) * (uint64_t(writes) + 1);
        return out;
      },
      nb::arg("rank"), nb::arg("peer"), nb::arg("bytes"), nb::arg("channel"), nb::arg("messages") = 1,
      nb::arg("writes") = 1);
#endif
  // Transport API on one local device, by global rank.
  m.def("provider", [](uint32_t rank) { return Runtime::get().device_by_rank(rank).provider(); });
  m.def("num_channels", [](uint32_t rank) { return Runtime::get().device_by_rank(rank).num_channels(); });
  m.def("region_bytes", [](uint32_t rank) { return Runtime::get().device_by_rank(rank).region_bytes(); });
  m.def("send_offset",
        [](uint32_t rank, uint32_t peer) { return Runtime::get().device_by_rank(rank).send_offset(peer); });
  m.def("recv_offset",
        [](uint32_t rank, uint32_t peer) { return Runtime::get().device_by_rank(rank).recv_offset(peer); });
  m.def(
      "buffer",
      [](uint32_t rank) {
        Device& d = Runtime::get().device_by_rank(rank);
        size_t shape[1] = {d.buffer_bytes()};
        return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(d.buffer(), 1, shape, nb::handle());
      },
      nb::rv_policy::reference);
  m.def("post_message",
        [](uint32_t rank, int channel, uint32_t peer, uint64_t local_offset, uint64_t remote_offset, uint64_t length) {
          Device& d = Runtime::get().device_by_rank(rank);
          nb::gil_scoped_release release;
          std::lock_guard<std::mutex> lock(d.op_mutex());
          d.post_message(channel, peer, local_offset, remote_offset, length, "post_message");
        });
  m.def("wait_message", [](uint32_t rank, int channel, uint32_t peer) {
    Device& d = Runtime::get().device_by_rank(rank);
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(d.op_mutex());
    d.wait_message(channel, peer, "wait_message");
  });
  m.def("quiet", [](uint32_t rank) {
    Device& d = Runtime::get().device_by_rank(rank);
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(d.op_mutex());
    d.quiet("quiet");
  });
  m.def("published_words", [](uint32_t rank) {  // what the proxies publish, read through the words' addresses
    Device& d = Runtime::get().device_by_rank(rank);
    nb::list retired, released, pushed;  // [channel], [channel][peer], [channel]
    for (int c = 0; c < d.num_channels(); ++c) {
      retired.append(__atomic_load_n(d.retired_word(c), __ATOMIC_ACQUIRE));
      pushed.append(d.ring(c).pushed());
      nb::list per_peer;
      for (uint32_t p = 0; p < d.num_ranks(); ++p)
        per_peer.append(__atomic_load_n(d.released_word(p, c), __ATOMIC_ACQUIRE));
      released.append(per_peer);
    }
    nb::dict out;
    out["retired"] = retired;
    out["released"] = released;
    out["pushed"] = pushed;
    return out;
  });
  m.def("stats", [](uint32_t rank) {
    DeviceStats s = Runtime::get().device_by_rank(rank).stats();
    nb::dict d;
    d["commands"] = s.commands;
    d["writes_posted"] = s.writes_posted;
    d["bytes_posted"] = s.bytes_posted;
    d["messages_received"] = s.messages_received;
    d["peak_inflight_bytes"] = s.peak_inflight_bytes;
    d["bytes_posted_to"] = s.bytes_posted_to;
    return d;
  });
  m.def("ring_slots_land_in_pieces", &ring_slots_land_in_pieces, nb::arg("capacity"), nb::arg("positions"),
        nb::arg("seed"));
  m.def("ring_commands_per_second", &ring_commands_per_second, nb::arg("capacity"), nb::arg("count"),
        nb::call_guard<nb::gil_scoped_release>());
}
