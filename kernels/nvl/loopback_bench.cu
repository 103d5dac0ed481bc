// Normal mode's NVLink kernels pointed at this GPU's own memory: two ranks on one GPU (two NvlDevices), each
// sending its rows into the other's buffer as if it were a peer. What the kernels move here bounds what they can
// move over NVLink. With the ranks spread over several GPUs of this process, the same kernels and spans over the
// link. Times dispatch and combine with CUDA events over the current settings (SM budget, bulk copies or SM
// stores) and checks the last call's rows against the inputs.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "api.hpp"
#include "bulk.cuh"
#include "device_common.cuh"
#include "testing.hpp"

namespace uccl_ep::nvl {
namespace {

template <class T>
T* device_alloc(size_t count) {
  void* p = nullptr;
  check(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)), "cudaMalloc");
  return static_cast<T*>(p);
}

// (start, length) in us of each kind from the earliest start of any, or (0, -1) where no kernel of the kind ran.
void spans_from(const std::vector<uint64_t>& words, double (*out)[2]) {
  constexpr int kKinds = int(KernelKind::kCount);
  uint64_t first = UINT64_MAX;
  for (int k = 0; k < kKinds; ++k) first = std::min(first, words[2 * k]);
  for (int k = 0; k < kKinds; ++k) {
    const bool ran = words[2 * k] != UINT64_MAX;
    out[k][0] = ran ? double(words[2 * k] - first) / 1e3 : 0.0;
    out[k][1] = ran ? (double(words[2 * k + 1]) - double(words[2 * k])) / 1e3 : -1.0;
  }
}

// Start words at UINT64_MAX, end words at 0: what the kernels' atomicMin / atomicMax stamps start from.
std::vector<uint64_t> unstamped() {
  std::vector<uint64_t> words(2 * int(KernelKind::kCount), 0);
  for (size_t k = 0; k < words.size(); k += 2) words[k] = UINT64_MAX;
  return words;
}

// Throws unless GPUs first to first + count - 1 are present; `who` names the bench.
void require_gpus(const char* who, int first, int count) {
  int present = 0;
  check(cudaGetDeviceCount(&present), "cudaGetDeviceCount");
  if (count < 1 || first + count > present)
    throw std::invalid_argument(std::string(who) + ": GPUs " + std::to_string(first) + " to " +
                                std::to_string(first + count - 1) + " asked for, " + std::to_string(present) +
                                " present");
}

// Waits until GPUs first to first + count - 1 are idle.
void synchronize_gpus(int first, int count) {
  for (int g = first; g < first + count; ++g) {
    check(cudaSetDevice(g), "cudaSetDevice");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
}

// Holds its stream for about `ns` nanoseconds (the spans' gate).
__global__ void sleep_kernel(uint64_t ns) {
  const uint64_t start = global_ns();
  while (global_ns() - start < ns) __nanosleep(1000);
}

// One rank's inputs and outputs.
struct Rank {
  std::vector<uint8_t> x_host;     // [T, x_row_bytes]
  std::vector<float> scales_host;  // [T, hidden / 128] (FP8)
  std::vector<int32_t> topk_host;  // [T, K]
  void *x = nullptr, *scales = nullptr, *recv_x = nullptr, *recv_scales = nullptr, *out = nullptr;
  int32_t *topk = nullptr, *recv_topk = nullptr, *recv_num = nullptr, *per_expert = nullptr, *counts = nullptr;
  float *weights = nullptr, *recv_weights = nullptr;
  bool* in_rank = nullptr;
  cudaStream_t stream = nullptr;
  ~Rank() {
    for (void* p : {x, scales, recv_x, recv_scales, out, static_cast<void*>(topk), static_cast<void*>(recv_topk),
                    static_cast<void*>(recv_num), static_cast<void*>(per_expert), static_cast<void*>(counts),
                    static_cast<void*>(weights), static_cast<void*>(recv_weights), static_cast<void*>(in_rank)})
      if (p) cudaFree(p);
    if (stream) cudaStreamDestroy(stream);
  }
};

}  // namespace

LoopbackResult loopback_bench(const LoopbackArgs& a) {
  const int R = a.num_ranks;
  const int T = a.num_tokens, H = a.hidden, K = a.topk, E = a.num_experts, cap = R * T;
  if (R < 1 || R > kMaxRanks || T < 1 || H < 128 || H % 128 || K < 1 || K > (a.one_way ? E / R : E) || E % R ||
      a.iters < 1 || a.num_gpus < 1 || a.num_gpus > R)
    throw std::invalid_argument(
        "loopback_bench: 1 to 8 ranks, tokens >= 1, hidden a multiple of 128, 1 <= topk <= experts (one way: the "
        "experts of a rank), experts divisible by the ranks, iters >= 1, 1 to num_ranks GPUs");
  require_gpus("loopback_bench", a.cuda_device, a.num_gpus);
  const auto gpu_of = [&](int r) { return a.cuda_device + r % a.num_gpus; };
  const auto synchronize_all = [&] { synchronize_gpus(a.cuda_device, a.num_gpus); };
  const int64_t x_row = a.fp8 ? H : int64_t(H) * 2, scale_row = a.fp8 ? int64_t(H / 128) * 4 : 0;
  const size_t message =
      std::max(dispatch_message_bytes(T, x_row, scale_row, K, true), combine_message_bytes(T, H, FloatType::kBF16));
  const size_t buffer = nvl_buffer_bytes_for(R, message);
  std::vector<std::unique_ptr<NvlDevice>> devs;
  for (int r = 0; r < R; ++r) devs.push_back(std::make_unique<NvlDevice>(gpu_of(r), r, R, buffer, 0));
  std::vector<NvlDevice*> same;
  for (auto& d : devs) same.push_back(d.get());
  for (auto& d : devs) d->connect(std::vector<std::vector<uint8_t>>(R), same);

  std::mt19937_64 rng(a.seed);
  std::vector<Rank> ranks(R);
  for (int r = 0; r < R; ++r) {
    Rank& k = ranks[r];
    check(cudaSetDevice(gpu_of(r)), "cudaSetDevice");  // the rank's memory and stream on its GPU
    check(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking), "cudaStreamCreate");
    // Random rows (BF16 from normal values, or random FP8 bytes), K distinct random experts per token.
    k.x_host.resize(size_t(T) * x_row);
    if (a.fp8) {
      for (auto& b : k.x_host) b = uint8_t(rng() % 0x7e);  // finite e4m3 values
    } else {
      std::normal_distribution<float> normal;
      auto* h = reinterpret_cast<__nv_bfloat16*>(k.x_host.data());
      for (size_t i = 0; i < size_t(T) * H; ++i) h[i] = __float2bfloat16(normal(rng));
    }
    k.topk_host.resize(size_t(T) * K);
    // One way: ranks past 0 pick among their own experts only.
    const int first = a.one_way && r > 0 ? r * (E / R) : 0, choices = a.one_way && r > 0 ? E / R : E;
    std::vector<int> experts(choices);
    for (int t = 0; t < T; ++t) {
      for (int e = 0; e < choices; ++e) experts[e] = first + e;
      for (int j = 0; j < K; ++j) {
        std::swap(experts[j], experts[j + rng() % (choices - j)]);
        k.topk_host[size_t(t) * K + j] = experts[j];
      }
    }
    std::vector<float> w(size_t(T) * K);
    std::vector<float>& s = k.scales_host;
    s.resize(size_t(T) * (H / 128));
    for (auto& v : w) v = float(rng() % 1000) / 1000.f;
    for (auto& v : s) v = 1.f + float(rng() % 1000) / 1000.f;
    k.x = device_alloc<uint8_t>(k.x_host.size());
    check(cudaMemcpy(k.x, k.x_host.data(), k.x_host.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
    k.topk = device_alloc<int32_t>(k.topk_host.size());
    check(cudaMemcpy(k.topk, k.topk_host.data(), k.topk_host.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
    k.weights = device_alloc<float>(w.size());
    check(cudaMemcpy(k.weights, w.data(), w.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
    if (a.fp8) {
      k.scales = device_alloc<float>(s.size());
      check(cudaMemcpy(k.scales, s.data(), s.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
      k.recv_scales = device_alloc<uint8_t>(size_t(cap) * scale_row);
    }
    k.recv_x = device_alloc<uint8_t>(size_t(cap) * std::max<int64_t>(x_row, int64_t(H) * 2));
    k.out = device_alloc<__nv_bfloat16>(size_t(T) * H);
    k.recv_topk = device_alloc<int32_t>(size_t(cap) * K);
    k.recv_weights = device_alloc<float>(size_t(cap) * K);
    k.recv_num = device_alloc<int32_t>(1);
    k.per_expert = device_alloc<int32_t>(E / R);
    k.counts = device_alloc<int32_t>(R);
    k.in_rank = device_alloc<bool>(size_t(T) * R);
  }
  std::vector<int32_t> members(R);
  for (int r = 0; r < R; ++r) members[r] = r;
  const auto dispatch_args = [&](Rank& k) {
    DispatchArgs a{};
    a.x = k.x;
    a.x_row_bytes = x_row;
    a.scales = k.scales;
    a.scale_row_bytes = scale_row;
    a.topk_idx = k.topk;
    a.topk_weights = k.weights;
    a.num_tokens = T;
    a.topk = K;
    a.num_experts = E;
    a.capacity = cap;
    a.recv_x = k.recv_x;
    a.recv_scales = k.recv_scales;
    a.recv_topk_idx = k.recv_topk;
    a.recv_topk_weights = k.recv_weights;
    a.recv_num_tokens = k.recv_num;
    a.num_tokens_per_expert = k.per_expert;
    a.is_token_in_rank = k.in_rank;
    a.recv_counts = k.counts;
    return a;
  };
  const auto combine_args = [&](Rank& k) {
    CombineArgs a{};
    a.y = k.recv_x;
    a.dtype = FloatType::kBF16;
    a.hidden = H;
    a.capacity = cap;
    a.num_tokens = T;
    a.is_token_in_rank = k.in_rank;
    a.recv_counts = k.counts;
    a.out = k.out;
    return a;
  };
  // Both ranks' ops are queued before either is awaited: each waits for the other on the GPU.
  const auto run = [&](bool combine, int iters) {
    for (int i = 0; i < iters; ++i)
      for (int r = 0; r < R; ++r) {
        const Group g{members.data(), R, r};
        if (combine)
          nvl::combine(*devs[r], g, combine_args(ranks[r]), ranks[r].stream);
        else
          nvl::dispatch(*devs[r], g, dispatch_args(ranks[r]), ranks[r].stream);
      }
  };
  const auto timed_us = [&](bool combine) {
    run(combine, 2);  // warm-up
    synchronize_all();
    std::vector<cudaEvent_t> start(R), stop(R);
    for (int r = 0; r < R; ++r) {
      check(cudaSetDevice(gpu_of(r)), "cudaSetDevice");  // an event records on its own GPU's streams
      check(cudaEventCreate(&start[r]), "cudaEventCreate");
      check(cudaEventCreate(&stop[r]), "cudaEventCreate");
      check(cudaEventRecord(start[r], ranks[r].stream), "cudaEventRecord");
    }
    run(combine, a.iters);
    float most = 0;
    for (int r = 0; r < R; ++r) {
      check(cudaEventRecord(stop[r], ranks[r].stream), "cudaEventRecord");
      check(cudaEventSynchronize(stop[r]), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start[r], stop[r]), "cudaEventElapsedTime");
      most = std::max(most, ms);
      cudaEventDestroy(start[r]);
      cudaEventDestroy(stop[r]);
    }
    return double(most) * 1000.0 / a.iters;
  };

  LoopbackResult res{};
  res.dispatch_us = timed_us(false);
  for (auto& d : devs) d->check_errors("loopback dispatch");
  // The last dispatch's rows: receiver r holds, per source in order, the rows of the source's tokens with an
  // expert on r, in token order.
  for (int r = 0; r < R; ++r) {
    int32_t got_rows = 0;
    check(cudaMemcpy(&got_rows, ranks[r].recv_num, 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
    std::vector<uint8_t> got(size_t(got_rows) * x_row), got_scales(size_t(got_rows) * scale_row);
    check(cudaMemcpy(got.data(), ranks[r].recv_x, got.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
    if (a.fp8)
      check(cudaMemcpy(got_scales.data(), ranks[r].recv_scales, got_scales.size(), cudaMemcpyDeviceToHost),
            "cudaMemcpy");
    int64_t o = 0;
    for (int s = 0; s < R; ++s)
      for (int t = 0; t < T; ++t) {
        bool mine = false;
        for (int j = 0; j < K; ++j) mine |= ranks[s].topk_host[size_t(t) * K + j] / (E / R) == r;
        if (!mine) continue;
        if (s != r) ++res.remote_rows;
        ++res.received_rows;
        if (o >= got_rows ||
            std::memcmp(got.data() + o * x_row, ranks[s].x_host.data() + int64_t(t) * x_row, size_t(x_row)) != 0 ||
            (a.fp8 && std::memcmp(got_scales.data() + o * scale_row,
                                  ranks[s].scales_host.data() + int64_t(t) * (H / 128), size_t(scale_row)) != 0))
          ++res.mismatched_rows;
        ++o;
      }
    if (o != got_rows) res.mismatched_rows += uint64_t(std::abs(got_rows - o));
    // Rows per local expert: one for each of a received token's slots that names it.
    std::vector<int32_t> want(E / R, 0), got_experts(E / R);
    for (int s = 0; s < R; ++s)
      for (size_t i = 0; i < ranks[s].topk_host.size(); ++i)
        if (ranks[s].topk_host[i] / (E / R) == r) ++want[ranks[s].topk_host[i] - r * (E / R)];
    check(cudaMemcpy(got_experts.data(), ranks[r].per_expert, got_experts.size() * 4, cudaMemcpyDeviceToHost),
          "cudaMemcpy");
    for (int e = 0; e < E / R; ++e) res.mismatched_expert_counts += got_experts[e] != want[e];
  }
  res.x_row_bytes = uint64_t(x_row + scale_row);
  if (!a.fp8) {
    res.combine_us = timed_us(true);
    for (auto& d : devs) d->check_errors("loopback combine");
    // Each token comes back once from every rank that got it, unchanged: the sum is x times that count, summed in
    // float32 (exact for counts up to 8 of a BF16 value) and rounded once to BF16.
    for (int r = 0; r < R; ++r) {
      std::vector<__nv_bfloat16> out(size_t(T) * H);
      check(cudaMemcpy(out.data(), ranks[r].out, out.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
      const auto* x = reinterpret_cast<const __nv_bfloat16*>(ranks[r].x_host.data());
      for (int t = 0; t < T; ++t) {
        int copies = 0;
        for (int d = 0; d < R; ++d) {
          bool to_d = false;
          for (int j = 0; j < K; ++j) to_d |= ranks[r].topk_host[size_t(t) * K + j] / (E / R) == d;
          copies += to_d;
        }
        for (int h = 0; h < H; ++h)
          if (__bfloat162float(out[size_t(t) * H + h]) !=
              __bfloat162float(__float2bfloat16(copies * __bfloat162float(x[size_t(t) * H + h])))) {
            ++res.mismatched_combine_rows;
            break;
          }
      }
    }
  }
  // One more call of each op with the kernels' stamps on: where its time goes. Every rank's kernels are queued
  // behind one gate (a kernel that sleeps, then an event), so they start together as in the timed loop rather
  // than as one host thread launches them, and the stamped call follows kWarmCalls unstamped ones back to back, as
  // a call in the timed loop does: the first NVLink traffic after an idle gap is ~100 us slower (bench/RESULTS.md).
  // Each GPU's kernels stamp an array of its own, by its own %globaltimer: the spans over all ranks merge them
  // (mixing the clocks), gpu_spans keep each GPU's.
  check(cudaSetDevice(a.cuda_device), "cudaSetDevice");
  cudaEvent_t gate;
  check(cudaEventCreateWithFlags(&gate, cudaEventDisableTiming), "cudaEventCreate");
  constexpr int kKinds = int(KernelKind::kCount);
  std::vector<uint64_t*> stamps(a.num_gpus);
  for (int g = 0; g < a.num_gpus; ++g) {
    check(cudaSetDevice(a.cuda_device + g), "cudaSetDevice");
    stamps[g] = device_alloc<uint64_t>(2 * kKinds);
  }
  for (auto& op : res.spans)
    for (auto& span : op) span[1] = -1.0;  // not run (combine with fp8)
  for (auto& gpu : res.gpu_spans)
    for (auto& op : gpu)
      for (auto& span : op) span[1] = -1.0;
  constexpr int kWarmCalls = 3;
  std::vector<cudaEvent_t> queued(R);  // each rank's stream up to the stamps' switch
  for (int r = 0; r < R; ++r) {
    check(cudaSetDevice(gpu_of(r)), "cudaSetDevice");
    check(cudaEventCreateWithFlags(&queued[r], cudaEventDisableTiming), "cudaEventCreate");
  }
  for (int op = 0; op < (a.fp8 ? 1 : 2); ++op) {
    std::vector<uint64_t> merged = unstamped(), host(2 * kKinds);
    for (int g = 0; g < a.num_gpus; ++g) {
      check(cudaSetDevice(a.cuda_device + g), "cudaSetDevice");
      check(cudaMemcpy(stamps[g], merged.data(), merged.size() * 8, cudaMemcpyHostToDevice), "cudaMemcpy");
    }
    check(cudaSetDevice(a.cuda_device), "cudaSetDevice");
    sleep_kernel<<<1, 1, 0, ranks[0].stream>>>(200000);
    check(cudaEventRecord(gate, ranks[0].stream), "cudaEventRecord");
    for (int r = 1; r < R; ++r) check(cudaStreamWaitEvent(ranks[r].stream, gate), "cudaStreamWaitEvent");
    run(op == 1, kWarmCalls);
    // Stamps on in each GPU's stream order: rank g (the GPU's first) switches them once every rank on the GPU has
    // queued its warm calls, and those ranks' stamped calls wait for the switch.
    for (int r = 0; r < R; ++r) {
      check(cudaSetDevice(gpu_of(r)), "cudaSetDevice");
      check(cudaEventRecord(queued[r], ranks[r].stream), "cudaEventRecord");
    }
    for (int r = 0; r < R; ++r)
      if (r != gpu_of(r) - a.cuda_device) {
        check(cudaSetDevice(gpu_of(r)), "cudaSetDevice");
        check(cudaStreamWaitEvent(ranks[gpu_of(r) - a.cuda_device].stream, queued[r]), "cudaStreamWaitEvent");
      }
    for (int g = 0; g < a.num_gpus; ++g) {
      set_kernel_stamps(a.cuda_device + g, stamps[g], a.sides_apart, ranks[g].stream);
      check(cudaEventRecord(queued[g], ranks[g].stream), "cudaEventRecord");
    }
    for (int r = 0; r < R; ++r)
      if (r != gpu_of(r) - a.cuda_device) {
        check(cudaSetDevice(gpu_of(r)), "cudaSetDevice");
        check(cudaStreamWaitEvent(ranks[r].stream, queued[gpu_of(r) - a.cuda_device]), "cudaStreamWaitEvent");
      }
    run(op == 1, 1);
    synchronize_all();
    for (int g = 0; g < a.num_gpus; ++g) {
      set_kernel_stamps(a.cuda_device + g, nullptr);
      check(cudaMemcpy(host.data(), stamps[g], host.size() * 8, cudaMemcpyDeviceToHost), "cudaMemcpy");
      spans_from(host, res.gpu_spans[g][op]);
      for (int k = 0; k < kKinds; ++k) {
        merged[2 * k] = std::min(merged[2 * k], host[2 * k]);
        merged[2 * k + 1] = std::max(merged[2 * k + 1], host[2 * k + 1]);
      }
    }
    spans_from(merged, res.spans[op]);
  }
  for (int g = 0; g < a.num_gpus; ++g) {
    check(cudaSetDevice(a.cuda_device + g), "cudaSetDevice");
    check(cudaFree(stamps[g]), "cudaFree");
  }
  for (auto& e : queued) cudaEventDestroy(e);
  check(cudaSetDevice(a.cuda_device), "cudaSetDevice");
  cudaEventDestroy(gate);
  synchronize_all();
  return res;
}

}  // namespace uccl_ep::nvl

namespace uccl_ep::nvl {
namespace {

// Each block copies its span of `bytes_per_block` with `producers` threads (lane 0 of warps 0..), each running its
// own ring of `stages` stages over the pieces p, p + producers, ...; or, with warps, the block's warps copy with SM
// loads and stores.
__global__ void __launch_bounds__(kTransferThreads, 1)
    copy_bench_kernel(const char* src, char* dst, int64_t bytes_per_block, uint32_t stage_bytes, int stages,
                      int producers, bool warps) {
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t full[kMaxStages * 4];
  const int64_t base = int64_t(blockIdx.x) * bytes_per_block;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (warps) {
    const int64_t rows = bytes_per_block / stage_bytes;
    for (int64_t r = warp; r < rows; r += blockDim.x / kWarp)
      warp_copy(dst + base + r * stage_bytes, src + base + r * stage_bytes, stage_bytes, lane);
    return;
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages * producers; ++s) barrier_init(full + s, 1);
    fence_barrier_init();
  }
  block_sync();
  if (lane != 0 || warp >= producers) return;
  StageRing ring{smem + size_t(warp) * stages * stage_bytes, stage_bytes, stages, full + warp * stages, 1};
  const int64_t pieces = bytes_per_block / stage_bytes;
  run_bulk_jobs(
      ring,
      [&](int j, char* stage, uint64_t* bar) -> int64_t {
        const int64_t k = int64_t(j) * producers + warp;
        if (k >= pieces) return kNoMoreJobs;
        barrier_arrive_expect(bar, stage_bytes);
        bulk_load(stage, src + base + k * stage_bytes, stage_bytes, bar);
        return stage_bytes;
      },
      [&](int j, char* stage) {
        bulk_store(dst + base + (int64_t(j) * producers + warp) * stage_bytes, stage, stage_bytes);
      },
      [](int) {});
}

__host__ __device__ inline char copy_pattern(size_t i, int gpu) {
  return char((uint32_t(i) * 0x9E3779B1u) >> 24 ^ uint32_t(gpu * 37 + 11));
}

__global__ void fill_pattern_kernel(char* p, size_t bytes, int gpu) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < bytes; i += size_t(gridDim.x) * blockDim.x)
    p[i] = copy_pattern(i, gpu);
}

}  // namespace

double copy_bench(int cuda_device, int blocks, int64_t bytes_per_block, uint32_t stage_bytes, int stages, int producers,
                  bool warps, CopyDirection direction, int gpus) {
  if (stages * producers > kMaxStages * 4 || uint64_t(stages) * producers * stage_bytes > kBulkSharedBytes)
    throw std::invalid_argument("copy_bench: too many stages");
  if (!warps && stages < 2) throw std::invalid_argument("copy_bench: at least 2 stages (one refills behind the other)");
  if (bytes_per_block % 16 || stage_bytes % 16 || stage_bytes == 0)
    throw std::invalid_argument("copy_bench: bytes_per_block (" + std::to_string(bytes_per_block) +
                                ") and stage_bytes (" + std::to_string(stage_bytes) +
                                ") must be multiples of 16 bytes (bulk copies need it)");
  require_gpus("copy_bench", cuda_device, gpus);
  const size_t bytes = size_t(blocks) * bytes_per_block;
  std::vector<char*> mine(gpus), other(gpus);
  std::vector<cudaStream_t> streams(gpus);
  std::vector<cudaEvent_t> starts(gpus), stops(gpus);
  for (int g = 0; g < gpus; ++g) {
    check(cudaSetDevice(cuda_device + g), "cudaSetDevice");
    enable_peer_access(cuda_device + g, cuda_device + (g + 1) % gpus);
    mine[g] = device_alloc<char>(bytes);
    other[g] = device_alloc<char>(bytes);
    fill_pattern_kernel<<<1024, 256>>>(mine[g], bytes, g);
    check(cudaGetLastError(), "fill_pattern_kernel");
    check(cudaMemset(other[g], 0, bytes), "cudaMemset");
    check(cudaStreamCreateWithFlags(&streams[g], cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaEventCreate(&starts[g]), "cudaEventCreate");
    check(cudaEventCreate(&stops[g]), "cudaEventCreate");
    allow_shared_bytes(kBulkSharedBytes, copy_bench_kernel);
  }
  // GPU g's kernel reads GPU from(g)'s `mine` and writes GPU to(g)'s `other`.
  const auto from = [&](int g) { return direction == CopyDirection::kPull ? (g + 1) % gpus : g; };
  const auto to = [&](int g) { return direction == CopyDirection::kPush ? (g + 1) % gpus : g; };
  const uint32_t shared = warps ? 0 : uint32_t(stages) * producers * stage_bytes;
  const auto launch = [&](int g) {
    copy_bench_kernel<<<blocks, kTransferThreads, shared, streams[g]>>>(mine[from(g)], other[to(g)], bytes_per_block,
                                                                        stage_bytes, stages, producers, warps);
  };
  const auto synchronize_all = [&] { synchronize_gpus(cuda_device, gpus); };
  synchronize_all();  // the patterns are in before any stream copies them
  for (int i = 0; i < 2; ++i)
    for (int g = 0; g < gpus; ++g) {
      check(cudaSetDevice(cuda_device + g), "cudaSetDevice");
      launch(g);
    }
  synchronize_all();
  constexpr int kIters = 10;
  for (int g = 0; g < gpus; ++g) {  // every GPU copies at once, as both directions of an op do
    check(cudaSetDevice(cuda_device + g), "cudaSetDevice");
    check(cudaEventRecord(starts[g], streams[g]), "cudaEventRecord");
    for (int i = 0; i < kIters; ++i) launch(g);
    check(cudaEventRecord(stops[g], streams[g]), "cudaEventRecord");
  }
  synchronize_all();
  check(cudaGetLastError(), "copy_bench_kernel");
  // What arrived: the head and tail of every block's span in GPU g's destination hold the source GPU's pattern.
  double slowest_ms = 0;
  const size_t copied = bytes_per_block / stage_bytes * stage_bytes;  // of each block's span
  const size_t probe_bytes = std::min<size_t>(copied / 2, 64 << 10);
  std::vector<char> probe(probe_bytes);
  std::string mismatch;
  for (int g = 0; g < gpus; ++g) {
    check(cudaSetDevice(cuda_device + g), "cudaSetDevice");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, starts[g], stops[g]), "cudaEventElapsedTime");
    slowest_ms = std::max(slowest_ms, double(ms));
    for (int b = 0; b < blocks; ++b)
      for (size_t at : {size_t(b) * bytes_per_block, size_t(b) * bytes_per_block + copied - probe_bytes}) {
        check(cudaMemcpy(probe.data(), other[to(g)] + at, probe_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
        for (size_t i = 0; i < probe_bytes && mismatch.empty(); ++i)
          if (probe[i] != copy_pattern(at + i, from(g)))
            mismatch = "copy_bench: byte " + std::to_string(at + i) + " of GPU " + std::to_string(to(g)) +
                       "'s copy of GPU " + std::to_string(from(g)) + "'s bytes differs";
      }
  }
  for (int g = 0; g < gpus; ++g) {
    check(cudaSetDevice(cuda_device + g), "cudaSetDevice");
    cudaEventDestroy(starts[g]);
    cudaEventDestroy(stops[g]);
    cudaStreamDestroy(streams[g]);
    cudaFree(mine[g]);
    cudaFree(other[g]);
  }
  check(cudaSetDevice(cuda_device), "cudaSetDevice");
  if (!mismatch.empty()) throw std::runtime_error(mismatch);
  return double(bytes) * kIters / (slowest_ms * 1e-3) / 1e9;  // GB/s copied by each GPU
}

namespace {
std::vector<std::pair<int, uint64_t*>> g_stamp_arrays;  // the GPUs start_kernel_stamps pointed, and their arrays
}  // namespace

void start_kernel_stamps(int cuda_device) {
  stop_kernel_stamps(cuda_device);  // a session left open starts over
  check(cudaSetDevice(cuda_device), "cudaSetDevice");
  const std::vector<uint64_t> words = unstamped();
  uint64_t* stamps = device_alloc<uint64_t>(words.size());
  check(cudaMemcpy(stamps, words.data(), words.size() * 8, cudaMemcpyHostToDevice), "cudaMemcpy");
  g_stamp_arrays.emplace_back(cuda_device, stamps);
  set_kernel_stamps(cuda_device, stamps);
}

std::vector<std::array<double, 2>> stop_kernel_stamps(int cuda_device) {
  std::vector<std::array<double, 2>> spans;
  for (auto it = g_stamp_arrays.begin(); it != g_stamp_arrays.end(); ++it) {
    if (it->first != cuda_device) continue;
    set_kernel_stamps(cuda_device, nullptr);
    std::vector<uint64_t> words = unstamped();
    check(cudaMemcpy(words.data(), it->second, words.size() * 8, cudaMemcpyDeviceToHost), "cudaMemcpy");
    check(cudaFree(it->second), "cudaFree");
    g_stamp_arrays.erase(it);
    double out[int(KernelKind::kCount)][2];
    spans_from(words, out);
    for (const auto& span : out) spans.push_back({span[0], span[1]});
    break;
  }
  return spans;
}

}  // namespace uccl_ep::nvl
