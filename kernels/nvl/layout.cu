// get_dispatch_layout on GPUs: the routing counts of this rank's tokens, on XLA's stream, no communication; and the
// expert layout's pair rows from token rows (ExpandPairsArgs) and back (SumPairsArgs).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "api.hpp"
#include "device_common.cuh"

namespace uccl_ep::nvl {
namespace {

// A thread per token. A slot outside [-1, E) is skipped and reported (the first one wins), as dispatch does.
__global__ void layout_kernel(const int32_t* __restrict__ topk_idx, int num_tokens, int topk, int num_experts,
                              int num_ranks, int32_t* per_rank, int32_t* per_expert, bool* in_rank, DeviceErrors* err,
                              int rank) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= num_tokens) return;
  const int experts_per_rank = num_experts / num_ranks;
  const int32_t* idx = topk_idx + int64_t(t) * topk;
  for (int k = 0; k < topk; ++k) {
    const int32_t e = idx[k];
    if (e < 0 || e >= num_experts) {
      if (e != -1) report(err, kBadExpertIndex, rank, t, k, e);
      continue;
    }
    atomicAdd(per_expert + e, 1);
    const int r = e / experts_per_rank;
    bool first = true;  // the token counts once per rank however many of its slots go there
    for (int j = 0; j < k && first; ++j)
      first = !(idx[j] >= 0 && idx[j] < num_experts && idx[j] / experts_per_rank == r);
    if (first) {
      in_rank[int64_t(t) * num_ranks + r] = true;
      atomicAdd(per_rank + r, 1);
    }
  }
}

// A warp per pair slot, grid-stride: the slots outside the groups cost a 4-byte read each without zero_padding.
__global__ void expand_pairs_kernel(ExpandPairsArgs a) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarp;
  for (int64_t s = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; s < a.num_slots; s += warps) {
    const int32_t r = a.pair_row[s];
    char* out = static_cast<char*>(a.pairs) + s * a.row_bytes;
    if (r >= 0 && r < a.num_rows)
      warp_copy(out, static_cast<const char*>(a.rows) + r * a.row_bytes, a.row_bytes, lane);
    else if (a.zero_padding)
      warp_zero(out, a.row_bytes, lane);
  }
}

// A warp per row, grid-stride. Every lane runs the same trips (the slots go round by shuffles, 32 read at once), and
// a lane's kUnroll vectors of the row are loaded from a slot before any is added. kVector: 16-byte vectors of In
// (both row widths multiples of 16 bytes), else an element a lane.
template <typename In, typename Out, bool kVector>
__global__ void sum_pairs_kernel(SumPairsArgs a) {
  constexpr int kN = kVector ? Vec<In>::kN : 1;  // elements a lane takes at once
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarp;
  const int64_t units = a.hidden / kN;
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; r < a.num_rows; r += warps) {
    const int32_t* of = a.pair_of + r * a.topk;
    Out* out = static_cast<Out*>(a.rows) + r * a.hidden;
    for (int64_t u0 = lane; u0 - lane < units; u0 += kUnroll * kWarp) {
      float acc[kUnroll][kN] = {};
      for (int k0 = 0; k0 < a.topk; k0 += kWarp) {
        const int32_t mine = k0 + lane < a.topk ? __ldg(of + k0 + lane) : -1;
        unsigned named = __ballot_sync(0xffffffffu, mine >= 0 && mine < a.num_slots);
        while (named) {
          const int64_t s = __shfl_sync(0xffffffffu, mine, __ffs(named) - 1);
          named &= named - 1;
          const In* row = static_cast<const In*>(a.pairs) + s * a.hidden;
          if constexpr (kVector) {
            int4 v[kUnroll];
#pragma unroll
            for (int i = 0; i < kUnroll; ++i)
              if (u0 + i * kWarp < units) v[i] = __ldg(reinterpret_cast<const int4*>(row) + u0 + i * kWarp);
#pragma unroll
            for (int i = 0; i < kUnroll; ++i)
              if (u0 + i * kWarp < units) Vec<In>::add(acc[i], v[i]);
          } else {
#pragma unroll
            for (int i = 0; i < kUnroll; ++i)
              if (u0 + i * kWarp < units) acc[i][0] += to_float(row[u0 + i * kWarp]);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        const int64_t u = u0 + i * kWarp;
        if (u >= units) continue;
        if constexpr (kVector && sizeof(In) == sizeof(Out)) {
          reinterpret_cast<int4*>(out)[u] = Vec<Out>::pack(acc[i]);
        } else {
#pragma unroll
          for (int j = 0; j < kN; ++j) out[u * kN + j] = from_float<Out>(acc[i][j]);
        }
      }
    }
  }
}

template <typename In, typename Out>
void launch_sum_pairs(const SumPairsArgs& a, cudaStream_t stream) {
  constexpr int kThreads = 256, kMaxBlocks = 4096;
  const int64_t blocks = std::min<int64_t>((a.num_rows * kWarp + kThreads - 1) / kThreads, kMaxBlocks);
  const bool vector = (a.hidden * int64_t(sizeof(In))) % 16 == 0 && (a.hidden * int64_t(sizeof(Out))) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(a.pairs) % 16 == 0 && reinterpret_cast<uintptr_t>(a.rows) % 16 == 0;
  if (vector)
    sum_pairs_kernel<In, Out, true><<<int(blocks), kThreads, 0, stream>>>(a);
  else
    sum_pairs_kernel<In, Out, false><<<int(blocks), kThreads, 0, stream>>>(a);
  check(cudaGetLastError(), "sum_pairs kernel");
}

}  // namespace

void expand_pairs(const ExpandPairsArgs& a, cudaStream_t stream) {
  if (a.num_slots == 0 || a.row_bytes == 0) return;
  constexpr int kThreads = 256, kMaxBlocks = 4096;
  const int64_t blocks = std::min<int64_t>((a.num_slots * kWarp + kThreads - 1) / kThreads, kMaxBlocks);
  expand_pairs_kernel<<<int(blocks), kThreads, 0, stream>>>(a);
  check(cudaGetLastError(), "expand_pairs kernel");
}

void sum_pairs(const SumPairsArgs& a, cudaStream_t stream) {
  if (a.num_rows == 0 || a.hidden == 0) return;
  const bool in_f32 = a.pairs_dtype == FloatType::kF32, out_f32 = a.rows_dtype == FloatType::kF32;
  if (in_f32 && out_f32)
    launch_sum_pairs<float, float>(a, stream);
  else if (in_f32)
    launch_sum_pairs<float, __nv_bfloat16>(a, stream);
  else if (out_f32)
    launch_sum_pairs<__nv_bfloat16, float>(a, stream);
  else
    launch_sum_pairs<__nv_bfloat16, __nv_bfloat16>(a, stream);
}

void get_dispatch_layout(const LayoutArgs& a, DeviceErrors* err, int rank, cudaStream_t stream) {
  check(cudaMemsetAsync(a.num_tokens_per_rank, 0, sizeof(int32_t) * a.num_ranks, stream), "cudaMemsetAsync");
  check(cudaMemsetAsync(a.num_tokens_per_expert, 0, sizeof(int32_t) * a.num_experts, stream), "cudaMemsetAsync");
  check(cudaMemsetAsync(a.is_token_in_rank, 0, size_t(a.num_tokens) * a.num_ranks, stream), "cudaMemsetAsync");
  if (a.num_tokens == 0) return;
  constexpr int kThreads = 256;
  layout_kernel<<<(a.num_tokens + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      a.topk_idx, a.num_tokens, a.topk, a.num_experts, a.num_ranks, a.num_tokens_per_rank, a.num_tokens_per_expert,
      a.is_token_in_rank, err, rank);
  check(cudaGetLastError(), "layout kernel");
}

}  // namespace uccl_ep::nvl
