// Normal mode's routing scan (which rows this rank receives, from which source and token, and where they go) and
// combine's positions of our tokens in the members' messages, with the ops' device scratch they fill. Both paths run
// them: the receive blocks of the one NVLink launch (normal_nvlink.cu) and the proxy path's scan kernels
// (normal_proxy.cu). Included by the .cu files of kernels/nvl only (everything is in an anonymous namespace).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "api.hpp"
#include "device_common.cuh"

namespace uccl_ep::nvl {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kMaxScanRun = 8;  // a fused launch's scan: the most tokens per thread of a unit

// Where each source's routing and rows live (group position s -> pointer valid on this GPU). Our own rows are
// the op's inputs (row = token); a member's are in its in-region (DispatchSendArgs::token_slots says where).
struct Sources {
  const int32_t* topk_idx[kMaxRanks];  // topk mode
  const bool* mask[kMaxRanks];         // mask mode: [T, R] of the source
  const char* x[kMaxRanks];
  const char* scales[kMaxRanks];
  const float* weights[kMaxRanks];
};

// Token (or row) range of chunk c out of `chunks` over n.
__host__ __device__ inline int chunk_begin(int n, int chunks, int c) { return int(int64_t(n) * c / chunks); }

// Exclusive scans of v[j], j < N (at most one per warp of the block), each over the block in thread order: v[j]
// becomes the sum over earlier threads and total[j] the block's. The N scans share the barriers.
template <int N>
__device__ __forceinline__ void block_exclusive_scans(int (&v)[N], int (&total)[N]) {
  __shared__ int warp_sums[N][kScanThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  int inclusive[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    inclusive[j] = v[j];
#pragma unroll
    for (int d = 1; d < kWarp; d <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, inclusive[j], d);
      if (lane >= d) inclusive[j] += up;
    }
    if (lane == kWarp - 1) warp_sums[j][warp] = inclusive[j];
  }
  block_sync();
  if (warp < N) {  // warp j scans the warps' sums of value j
    int w = lane < warps ? warp_sums[warp][lane] : 0;
#pragma unroll
    for (int d = 1; d < kWarp; d <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += up;
    }
    warp_sums[warp][lane] = w;  // inclusive over warps
  }
  block_sync();
#pragma unroll
  for (int j = 0; j < N; ++j) {
    total[j] = warp_sums[j][warps - 1];
    v[j] = (warp == 0 ? 0 : warp_sums[j][warp - 1]) + inclusive[j] - v[j];
  }
  block_sync();  // warp_sums is reused by the next call
}
// One value's exclusive scan over the block; returns the prefix and sets *total.
__device__ int block_exclusive_scan(int value, int* total) {
  int v[1] = {value}, sum[1];
  block_exclusive_scans(v, sum);
  *total = sum[0];
  return v[0];
}

// The routing scan: which rows this rank receives, from which (source, token), and where they go. Rows are
// ordered by source (group order), then token. Two passes over a grid of (token block, source) blocks:
// count each block's rows, then place them after the counts of every earlier block, so the scan spreads over
// the GPU instead of one block walking every source on the dispatch's critical path.
struct ScanArgs {
  Sources src;
  bool topk_mode;  // topk_idx per source, else the token-in-rank mask (cached dispatch)
  int num_tokens, topk, num_experts, num_ranks, self, rank, capacity;
  int2* row_map;                   // [capacity]: (source, token) of each output row
  int32_t* recv_counts;            // [R] rows from each source
  int32_t* recv_num_tokens;        // rows kept (<= capacity)
  int32_t* num_tokens_per_expert;  // topk mode: [local experts]
  const int32_t* expected_counts;  // cached mode: the handle's counts to check against, else null
  int32_t* block_counts;           // scratch [R, blocks]
  DeviceErrors* err;
  int32_t* row_before;  // scratch [R, T + 1]: output row of source s's first row from token >= t
  bool drop_overflow;   // Overflow::kDrop: rows past the capacity are dropped on purpose, not an error
  // Overflow::kError with a capacity some member could exceed: every member's rows are counted too (scratch
  // [R receivers, R sources * blocks]), so that every member reports any member's overflow, naming it (rank_of).
  int32_t* receiver_counts;
  int rank_of[kMaxRanks];
};

// The tokens of unit x of a source: thread i takes tokens first + i + j * blockDim.x, j < kRun, so that a warp's
// loads stay on consecutive tokens.
template <int kRun>
__device__ __forceinline__ int unit_token(int x, int j) {
  return (x * kRun + j) * int(blockDim.x) + int(threadIdx.x);
}

// f(j, e) for each expert index e of the thread's tokens j < kRun of unit x of source s (a token past the last: the
// last token's indices, for the caller to ignore), kSlots indices of every token loaded at once: the scan is a chain
// of trips to a memory that the copies keep busy, so the loads go out together.
template <int kRun, class F>
__device__ __forceinline__ void for_expert_indices(const ScanArgs& a, int x, int s, F f) {
  constexpr int kSlots = kRun < 8 ? 4 : 2;  // 16 loads in flight at most
  const int K = a.topk, last = a.num_tokens - 1;
  const int32_t* idx = a.src.topk_idx[s];
  for (int k0 = 0; k0 < K; k0 += kSlots) {
    int e[kRun][kSlots];
#pragma unroll
    for (int j = 0; j < kRun; ++j) {
      const int t = min(unit_token<kRun>(x, j), last);
#pragma unroll
      for (int q = 0; q < kSlots; ++q) e[j][q] = k0 + q < K ? idx[t * K + k0 + q] : -1;
    }
#pragma unroll
    for (int j = 0; j < kRun; ++j)
#pragma unroll
      for (int q = 0; q < kSlots; ++q)
        if (k0 + q < K) f(j, e[j][q]);
  }
}

// Expert e's index among our local experts [first, first + local_experts), or -1 for another GPU's expert.
__device__ __forceinline__ int local_index(int e, int first, int local_experts) {
  return e >= first && e < first + local_experts ? e - first : -1;
}

// Bit j: the thread's token j of unit x of source s comes to us (a row of ours). The loads of all kRun tokens go out
// together.
template <int kRun>
__device__ __forceinline__ unsigned unit_takes(const ScanArgs& a, int x, int s) {
  const int T = a.num_tokens;
  unsigned takes = 0;
  if (!a.topk_mode) {
#pragma unroll
    for (int j = 0; j < kRun; ++j) {
      const int t = unit_token<kRun>(x, j);
      if (t < T && a.src.mask[s][t * a.num_ranks + a.self]) takes |= 1u << j;
    }
    return takes;
  }
  const int local_experts = a.num_experts / a.num_ranks, first = a.self * local_experts;
  for_expert_indices<kRun>(a, x, s, [&](int j, int e) {
    if (local_index(e, first, local_experts) >= 0) takes |= 1u << j;
  });
#pragma unroll
  for (int j = 0; j < kRun; ++j)
    if (unit_token<kRun>(x, j) >= T) takes &= ~(1u << j);
  return takes;
}

// Bit d of members[j]: the thread's token j of unit x of source s goes to member d (topk mode).
template <int kRun>
__device__ __forceinline__ void unit_members(const ScanArgs& a, int x, int s, unsigned (&members)[kRun]) {
  const int local_experts = a.num_experts / a.num_ranks;
#pragma unroll
  for (int j = 0; j < kRun; ++j) members[j] = 0;
  for_expert_indices<kRun>(a, x, s, [&](int j, int e) {
    if (e >= 0 && e < a.num_experts) members[j] |= 1u << (e / local_experts);
  });
#pragma unroll
  for (int j = 0; j < kRun; ++j)
    if (unit_token<kRun>(x, j) >= a.num_tokens) members[j] = 0;
}

// Pass 1: unit x of source s (its blockDim.x * kRun tokens; `units` per source) counts its rows, and with
// receiver_counts every member's. Unit (0, 0) zeroes the per-expert counts, which the receive side adds to. Returns
// the thread's unit_takes, which pass 2 takes again.
template <int kRun>
__device__ unsigned count_unit(const ScanArgs& a, int x, int s, int units) {
  unsigned takes = 0;
  if (!a.receiver_counts) {
    takes = unit_takes<kRun>(a, x, s);
    int rows;
    block_exclusive_scan(__popc(takes), &rows);  // the block's rows (no reduction barrier: sync.cuh)
    if (threadIdx.x == 0) a.block_counts[s * units + x] = rows;
  } else {
    unsigned members[kRun];
    unit_members<kRun>(a, x, s, members);
    int n[kMaxRanks], total[kMaxRanks];  // member d's rows
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      n[d] = 0;
#pragma unroll
      for (int j = 0; j < kRun; ++j) n[d] += members[j] >> d & 1;
    }
#pragma unroll
    for (int j = 0; j < kRun; ++j) takes |= (members[j] >> a.self & 1) << j;
    block_exclusive_scans(n, total);
    if (threadIdx.x == 0) {
#pragma unroll
      for (int d = 0; d < kMaxRanks; ++d) {
        if (d == a.self) a.block_counts[s * units + x] = total[d];
        if (d < a.num_ranks) a.receiver_counts[(d * a.num_ranks + s) * units + x] = total[d];
      }
    }
  }
  const int local_experts = a.topk_mode ? a.num_experts / a.num_ranks : 0;
  if (x == 0 && s == 0)
    for (int e = threadIdx.x; e < local_experts; e += blockDim.x) a.num_tokens_per_expert[e] = 0;
  return takes;
}

// Once every unit of source s is counted (thread 0): its rows (checked against the handle's in cached mode); for
// s = 0, once every unit is, the rows kept and the capacity's check.
__device__ void source_totals(const ScanArgs& a, int s, int units) {
  int from_source = 0;
  for (int b = 0; b < units; ++b) from_source += a.block_counts[s * units + b];
  a.recv_counts[s] = from_source;
  if (a.expected_counts && a.expected_counts[s] != from_source)
    report(a.err, kRowsDifferFromHandle, a.rank, s, from_source, a.expected_counts[s]);
  if (s != 0) return;
  int total = 0;
  for (int i = 0; i < a.num_ranks * units; ++i) total += a.block_counts[i];
  if (a.receiver_counts) {
    for (int d = 0; d < a.num_ranks; ++d) {
      int to_d = 0;
      for (int i = 0; i < a.num_ranks * units; ++i) to_d += a.receiver_counts[d * a.num_ranks * units + i];
      if (to_d > a.capacity) {
        report(a.err, kOverCapacity, a.rank_of[d], to_d, a.capacity, 0);
        break;
      }
    }
  } else if (total > a.capacity && !a.drop_overflow) {
    report(a.err, kOverCapacity, a.rank, total, a.capacity, 0);
  }
  *a.recv_num_tokens = min(total, a.capacity);
}

// Pass 2: each unit places its rows (`takes`: the thread's unit_takes) after those of every earlier unit, which
// must be counted. With `totals`, where every unit is counted, unit (0, s) also writes source s's totals.
template <int kRun>
__device__ void place_unit(const ScanArgs& a, int x, int s, int units, unsigned takes, bool totals = true) {
  const int T = a.num_tokens;
  int earlier = 0;
  for (int i = threadIdx.x; i < s * units + x; i += blockDim.x) earlier += a.block_counts[i];
  int base;
  block_exclusive_scan(earlier, &base);
  int o[kRun], rows[kRun];
#pragma unroll
  for (int j = 0; j < kRun; ++j) o[j] = takes >> j & 1;
  block_exclusive_scans(o, rows);
  int32_t* before = a.row_before + int64_t(s) * (T + 1);
#pragma unroll
  for (int j = 0; j < kRun; ++j) {
    const int t = unit_token<kRun>(x, j), row = base + o[j];
    const bool take = takes >> j & 1;
    base += rows[j];
    if (t >= T) continue;
    before[t] = row;
    if (t == T - 1) before[T] = row + take;
    if (take && row < a.capacity) a.row_map[row] = make_int2(s, t);
  }
  if (totals && threadIdx.x == 0 && x == 0) source_totals(a, s, units);
}

// Scan units per source, of `tokens_per_unit` tokens each (the standalone scan's blocks take kScanThreads, a fused
// launch's receive blocks kTransferThreads times its tokens per thread).
inline int scan_units(int num_tokens, int tokens_per_unit) {
  return std::max(1, (num_tokens + tokens_per_unit - 1) / tokens_per_unit);
}

// The ops' device scratch: excl [T + 1, R] (rows' positions in messages) | row_map [capacity] | counts [kMaxRanks] and
// rows kept (cached dispatch, which checks them against the handle's) | block_counts [R, units] | receiver_counts
// [R, R, units] | row_before [R, T + 1].
struct Scratch {
  int32_t* excl;
  int2* row_map;
  int32_t* counts;
  int32_t* num_rows;
  int32_t* block_counts;
  int32_t* row_before;       // [R, T + 1] (the routing scan's)
  int32_t* receiver_counts;  // [R, R, units] (the routing scan's, for a capacity some member could exceed)
};
struct ScratchOffsets {
  size_t map, counts, blocks, receivers, before, total;
};
inline ScratchOffsets scratch_offsets(int capacity, int num_tokens) {
  const size_t units = size_t(scan_units(num_tokens, kTransferThreads));  // the most either scan uses
  ScratchOffsets o;
  o.map = align16(size_t(num_tokens + 1) * kMaxRanks * 4);
  o.counts = o.map + size_t(capacity) * sizeof(int2);
  o.blocks = o.counts + 256;
  o.receivers = o.blocks + align16(size_t(kMaxRanks) * units * 4);
  o.before = o.receivers + align16(size_t(kMaxRanks) * kMaxRanks * units * 4);
  o.total = o.before + size_t(kMaxRanks) * (num_tokens + 1) * 4;
  return o;
}
inline size_t scratch_bytes(int capacity, int num_tokens) { return scratch_offsets(capacity, num_tokens).total; }
inline Scratch scratch_at(void* scratch, int capacity, int num_tokens) {
  const ScratchOffsets o = scratch_offsets(capacity, num_tokens);
  char* base = static_cast<char*>(scratch);
  int32_t* counts = reinterpret_cast<int32_t*>(base + o.counts);
  return {reinterpret_cast<int32_t*>(base),
          reinterpret_cast<int2*>(base + o.map),
          counts,
          counts + kMaxRanks,
          reinterpret_cast<int32_t*>(base + o.blocks),
          reinterpret_cast<int32_t*>(base + o.before),
          reinterpret_cast<int32_t*>(base + o.receivers)};
}

// Combine's view of this rank's tokens: excl[t * R + d] = how many tokens before t went to d in the dispatch, for t
// in [0, T] (row T: the totals), from the handle's token-in-rank mask. Token t's copy from d comes back as row
// excl[t, d] of d's message (d received our rows in token order, and sends them back packed in that order). Members
// are independent, so block `first` takes members first, first + step, ... (a block each where the launch has as
// many). Each: a block scan over runs of tokens per thread.
__device__ void block_positions(const bool* mask, int num_tokens, int num_ranks, int first, int step, int32_t* excl) {
  const int per_thread = (num_tokens + blockDim.x - 1) / blockDim.x;
  const int t0 = min(num_tokens, int(threadIdx.x) * per_thread), t1 = min(num_tokens, t0 + per_thread);
  for (int d = first; d < num_ranks; d += step) {
    int mine = 0;
    for (int t = t0; t < t1; ++t) mine += mask[t * num_ranks + d];
    int total;
    int p = block_exclusive_scan(mine, &total);
    for (int t = t0; t < t1; ++t) {
      excl[t * num_ranks + d] = p;
      p += mask[t * num_ranks + d];
    }
    if (threadIdx.x == 0) excl[num_tokens * num_ranks + d] = total;
  }
}

}  // namespace
}  // namespace uccl_ep::nvl
