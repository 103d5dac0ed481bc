// get_dispatch_layout on GPUs: the routing counts of this rank's tokens, on XLA's stream, no communication; and the
// expert layout's pair rows from token rows (ExpandPairsArgs).
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

}  // namespace

void expand_pairs(const ExpandPairsArgs& a, cudaStream_t stream) {
  if (a.num_slots == 0 || a.row_bytes == 0) return;
  constexpr int kThreads = 256, kMaxBlocks = 4096;
  const int64_t blocks = std::min<int64_t>((a.num_slots * kWarp + kThreads - 1) / kThreads, kMaxBlocks);
  expand_pairs_kernel<<<int(blocks), kThreads, 0, stream>>>(a);
  check(cudaGetLastError(), "expand_pairs kernel");
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
