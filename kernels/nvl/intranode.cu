// Intranode normal mode: the send sides that push rows to the members that need them over NVLink, the routing scans
// and the receive sides (copy out, or reduce), run as one launch per op on XLA's stream over NVLink or as separate
// kernels on the proxy path, and the host code that launches them (see api.hpp for the scheme).
#include <algorithm>
#include <stdexcept>
#include <string>

#include <cuda_bf16.h>

#include "api.hpp"
#include "bulk.cuh"
#include "device_common.cuh"
#include "proxy_path.cuh"
#include "testing.hpp"

namespace uccl_ep::nvl {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kMaxScanRun = 8;    // a fused launch's scan: the most tokens per thread of a unit
constexpr int kPieceTokens = 16;  // receive work items: this many tokens of a send block's chunk

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
  __syncthreads();
  if (warp < N) {  // warp j scans the warps' sums of value j
    int w = lane < warps ? warp_sums[warp][lane] : 0;
#pragma unroll
    for (int d = 1; d < kWarp; d <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += up;
    }
    warp_sums[warp][lane] = w;  // inclusive over warps
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N; ++j) {
    total[j] = warp_sums[j][warps - 1];
    v[j] = (warp == 0 ? 0 : warp_sums[j][warp - 1]) + inclusive[j] - v[j];
  }
  __syncthreads();  // warp_sums is reused by the next call
}
// One value's exclusive scan over the block; returns the prefix and sets *total.
__device__ int block_exclusive_scan(int value, int* total) {
  int v[1] = {value}, sum[1];
  block_exclusive_scans(v, sum);
  *total = sum[0];
  return v[0];
}

// Kernel spans for the loopback bench (set_kernel_stamps, testing.hpp): per KernelKind the earliest start and the
// latest end of any block of any rank, in ns of %globaltimer, while the bench points this at a device array; null
// otherwise (one load and branch per block).
__device__ uint64_t* g_kernel_stamps = nullptr;
struct KernelStamp {
  int kind;
  __device__ explicit KernelStamp(KernelKind k) : kind(int(k)) {
    uint64_t* stamps = g_kernel_stamps;
    if (stamps && threadIdx.x == 0) atomicMin(reinterpret_cast<unsigned long long*>(stamps + 2 * kind), global_ns());
  }
  __device__ ~KernelStamp() {
    uint64_t* stamps = g_kernel_stamps;
    if (stamps && threadIdx.x == 0)
      atomicMax(reinterpret_cast<unsigned long long*>(stamps + 2 * kind + 1), global_ns());
  }
};
// With the stamps, dispatch's receive side may also be held back until every member's rows have landed (the sides
// apart): each side's span is then what it moves with the GPU's memory to itself, where in the loopback both sides
// of every rank otherwise share it.
__device__ bool g_sides_apart = false;

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
    if (e >= first && e < first + local_experts) takes |= 1u << j;
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
// receiver_counts every member's. Unit (0, 0) zeroes the per-expert counts, which the receive side adds to.
template <int kRun>
__device__ void count_unit(const ScanArgs& a, int x, int s, int units) {
  if (!a.receiver_counts) {
    const unsigned takes = unit_takes<kRun>(a, x, s);
    int rows = 0;
#pragma unroll
    for (int j = 0; j < kRun; ++j) rows += __syncthreads_count(takes >> j & 1);
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
}
__global__ void __launch_bounds__(kScanThreads) dispatch_count_kernel(ScanArgs a) {
  const KernelStamp stamp(KernelKind::kScan);
  count_unit<1>(a, blockIdx.x, blockIdx.y, gridDim.x);
}

// Pass 2: each unit places its rows after those of every earlier unit.
template <int kRun>
__device__ void place_unit(const ScanArgs& a, int x, int s, int units) {
  const int blocks = units, T = a.num_tokens;
  const unsigned takes = unit_takes<kRun>(a, x, s);
  int earlier = 0;
  for (int i = threadIdx.x; i < s * blocks + x; i += blockDim.x) earlier += a.block_counts[i];
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
  if (threadIdx.x != 0 || x != 0) return;
  int from_source = 0;
  for (int b = 0; b < blocks; ++b) from_source += a.block_counts[s * blocks + b];
  a.recv_counts[s] = from_source;
  if (a.expected_counts && a.expected_counts[s] != from_source)
    report(a.err, kRowsDifferFromHandle, a.rank, s, from_source, a.expected_counts[s]);
  if (s != 0) return;
  int total = 0;
  for (int i = 0; i < a.num_ranks * blocks; ++i) total += a.block_counts[i];
  if (a.receiver_counts) {
    for (int d = 0; d < a.num_ranks; ++d) {
      int to_d = 0;
      for (int i = 0; i < a.num_ranks * blocks; ++i) to_d += a.receiver_counts[d * a.num_ranks * blocks + i];
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

__global__ void __launch_bounds__(kScanThreads) dispatch_place_kernel(ScanArgs a) {
  const KernelStamp stamp(KernelKind::kScan);
  place_unit<1>(a, blockIdx.x, blockIdx.y, gridDim.x);
}

// Scan units per source, of `tokens_per_unit` tokens each (the standalone scan's blocks take kScanThreads, a fused
// launch's receive blocks kTransferThreads times its tokens per thread).
int scan_units(int num_tokens, int tokens_per_unit) {
  return std::max(1, (num_tokens + tokens_per_unit - 1) / tokens_per_unit);
}

// The ops' device scratch: excl [T + 1, R] (rows' positions in messages) | row_map [capacity] | counts [kMaxRanks] and
// rows kept (cached dispatch, which checks them against the handle's) | block_counts [R, units] | receiver_counts
// [R, R, units] | row_before [R, T + 1]. Grows the device's scratch to fit.
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
ScratchOffsets scratch_offsets(int capacity, int num_tokens) {
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
size_t scratch_bytes(int capacity, int num_tokens) { return scratch_offsets(capacity, num_tokens).total; }
Scratch scratch_at(void* scratch, int capacity, int num_tokens) {
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
Scratch op_scratch(NvlDevice& dev, int capacity, int num_tokens) {
  dev.ensure_scratch(scratch_bytes(capacity, num_tokens));
  return scratch_at(dev.scratch(), capacity, num_tokens);
}

void run_scan(ScanArgs a, cudaStream_t stream) {
  const dim3 grid(scan_units(a.num_tokens, kScanThreads), a.num_ranks);
  dispatch_count_kernel<<<grid, kScanThreads, 0, stream>>>(a);
  check(cudaGetLastError(), "dispatch_count_kernel");
  dispatch_place_kernel<<<grid, kScanThreads, 0, stream>>>(a);
  check(cudaGetLastError(), "dispatch_place_kernel");
}

// Combine's view of this rank's tokens: excl[t * R + d] = how many tokens before t went to d in the dispatch, for t
// in [0, T] (row T: the totals), from the handle's token-in-rank mask. Token t's copy from d comes back as row
// excl[t, d] of d's message (d received our rows in token order, and sends them back packed in that order). One
// block: a block scan per member over runs of tokens per thread.
__device__ void block_positions(const bool* mask, int num_tokens, int num_ranks, int32_t* excl) {
  const int per_thread = (num_tokens + blockDim.x - 1) / blockDim.x;
  const int t0 = min(num_tokens, int(threadIdx.x) * per_thread), t1 = min(num_tokens, t0 + per_thread);
  for (int d = 0; d < num_ranks; ++d) {
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
__global__ void __launch_bounds__(kScanThreads)
    positions_kernel(const bool* mask, int num_tokens, int num_ranks, int32_t* excl) {
  block_positions(mask, num_tokens, num_ranks, excl);
}

// The group as a kernel sees it, and how long it waits for a member.
struct Members {
  int rank_of[kMaxRanks];  // global rank of each group position
  int num_ranks, self, rank;
  uint64_t timeout_ns;
  DeviceErrors* err;
};
// What a send kernel needs of each group member (entries of this rank unused).
struct SendTo : Members {
  char* region[kMaxRanks];         // the member's in-region for us
  uint64_t* meta[kMaxRanks];       // its count of our chunks whose routing landed
  uint64_t* chunks[kMaxRanks];     // its progress words for our chunks: [kChunks]
  const uint64_t* ack[kMaxRanks];  // ours: the last of our messages the member finished reading
  uint64_t message[kMaxRanks];     // this message's number to the member (1, 2, ...)
};
// And a receive side, of each member's message to us.
struct ReceiveFrom : Members {
  const char* region[kMaxRanks];  // our in-region written by the member
  const uint64_t* chunks[kMaxRanks];
  uint64_t message[kMaxRanks];
};

// Blocks of one launch hand work to each other through words of NvlDevice::handoff_words: a unit's word gets the
// launch's number (`epoch`, from 1 up) once its writes are in, so the words need no reset and one left by an
// earlier launch never passes. A block that waits for another needs every block of the launch resident at once
// (check_budget_fits).
struct Handoff {
  uint64_t* words;  // in NvlDevice::handoff_words
  uint64_t epoch;
};

// After the block's units u = first, first + step, ... < count of a pass: their words, once every thread's writes
// are in (the barrier, then a fence cumulative over them).
__device__ void hand_over(const Handoff& h, uint64_t* words, int first, int step, int count) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  for (int u = first; u < count; u += step) store_release_sys(words + u, h.epoch);
}
// Thread i runs wait(u) for u = i, i + blockDim.x, ... < count while no wait of the block has failed; returns (to the
// whole block) whether every one succeeded. The fence and barrier pass what the awaited words published on to every
// thread of the block.
template <class Wait>
__device__ bool block_waits(int count, const Wait& wait) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  for (int u = threadIdx.x; u < count && !failed; u += blockDim.x)
    if (!wait(u)) failed = 1;
  __threadfence();
  __syncthreads();
  const bool ok = !failed;
  __syncthreads();  // `failed` is reused
  return ok;
}
// Waits until every unit of a pass has been handed over; false (to the whole block) once a peer was reported late
// (the op is given up) or after the deadline, when a block of the launch never ran beside the others (reported).
__device__ bool wait_handed_over(const Handoff& h, const uint64_t* words, int count, const Members& m) {
  return block_waits(count, [&](int u) {
    const Polled p = poll_flag(words + u, h.epoch, m.timeout_ns, m.err, Sleep::kFlat);
    if (p == Polled::kTimedOut)
      report(m.err, kBlocksNotResident, m.rank, gridDim.x, 0, int64_t(m.timeout_ns / 1000000000ull));
    return p == Polled::kReached;
  });
}

// Waits (thread 0) until every member has finished reading our previous message: its region for us is free.
__device__ bool wait_acks(const SendTo& to) {
  __shared__ bool ok;
  if (threadIdx.x == 0) {
    ok = true;
    for (int s = 0; s < to.num_ranks && ok; ++s)
      if (s != to.self)
        ok = wait_flag(to.ack[s], to.message[s] - 1, -int64_t(to.message[s] - 1), to.timeout_ns, to.err, to.rank,
                       to.rank_of[s]);  // negative: an acknowledgement of ours, not a message of theirs
  }
  __syncthreads();
  return ok;
}

// A chunk's progress word: the message's number in the high half, how much of the chunk (tokens, or rows back in
// combine) has landed in the low half, so it only grows from message to message.
__device__ __forceinline__ uint64_t progress(uint64_t message, int done) { return message << 32 | uint32_t(done); }

// A barrier among the block's threads [first, first + threads) (whole warps): named barrier 1, or 0 for the whole
// block.
__device__ __forceinline__ void group_barrier(int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(threads == int(blockDim.x) ? 0 : 1), "r"(threads) : "memory");
}

// After the writes of `threads` threads of the block (this one is `thread`): a system fence by the first of them
// (cumulative over their writes, which the barrier orders before it), then the words that announce them: `chunks`
// more chunks' routing (meta), or chunk c's progress done_for(s).
__device__ void announce_meta(const SendTo& to, int chunks = 1, int thread = threadIdx.x, int threads = blockDim.x) {
  group_barrier(threads);
  if (thread != 0) return;
  __threadfence_system();
  for (int s = 0; s < to.num_ranks; ++s)
    if (s != to.self) add_release_sys(to.meta[s], chunks);
}
template <class DoneFor>
__device__ void announce_progress(const SendTo& to, int c, const DoneFor& done_for) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence_system();
  for (int s = 0; s < to.num_ranks; ++s)
    if (s != to.self) store_release_sys(to.chunks[s] + c, progress(to.message[s], done_for(s)));
}

// Waits (one thread) until chunk c of member s's message has `done` landed; returns how much has, or -1 (timeout).
__device__ int wait_progress(const ReceiveFrom& from, int s, int c, int done) {
  const uint64_t* word = from.chunks[s] + c;
  if (!wait_flag(word, progress(from.message[s], done), int64_t(from.message[s]), from.timeout_ns, from.err, from.rank,
                 from.rank_of[s], Sleep::kBackoff))
    return -1;
  return int(uint32_t(load_acquire_sys(word)));
}

// Copies `bytes` with `threads` threads of the block (this one is `thread`): the routing pieces of a chunk,
// contiguous and small.
__device__ void group_copy(char* dst, const char* src, int64_t bytes, int thread, int threads) {
  if (bytes % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    for (int64_t i = thread; i < bytes / 16; i += threads)
      reinterpret_cast<int4*>(dst)[i] = __ldg(reinterpret_cast<const int4*>(src) + i);
    return;
  }
  // Rows of topk int32s (an odd topk at an odd token offset) stay 4-byte aligned; the token mask need not.
  if (bytes % 4 == 0 && reinterpret_cast<uintptr_t>(dst) % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 4 == 0) {
    for (int64_t i = thread; i < bytes / 4; i += threads)
      reinterpret_cast<int32_t*>(dst)[i] = __ldg(reinterpret_cast<const int32_t*>(src) + i);
    return;
  }
  for (int64_t i = thread; i < bytes; i += threads) dst[i] = src[i];
}

// A contiguous per-token array of the routing (topk_idx, weights, the token-in-rank mask) and where it lands.
struct RoutingPiece {
  const char* src;  // null: none
  size_t offset;    // in the member's region
  int64_t bytes_per_token;
};

struct DispatchSendArgs {
  SendTo to;
  int chunks, num_tokens;
  const int32_t* topk_idx;  // [T, K] topk mode: the layout comes from it (mask_out), else from mask_in
  int topk, num_experts;
  const bool* mask_in;  // [T, R]
  bool* mask_out;       // [T, R] topk mode: this rank's layout (the handle's is_token_in_rank)
  int32_t* excl;        // [T, R] scratch: token t's row in its message to d
  RoutingPiece routing[2];
  const char* x;
  int64_t x_row_bytes;
  size_t x_offset;
  const char* scales;  // or null
  int64_t scale_row_bytes;
  size_t scales_offset;
  // The one launch (NVLink): token t's row in a member's message is row t (the message has a slot per token), so a
  // send block lays nothing out and needs no count. Else (the proxy path, which pushes each message as one packed
  // prefix) rows go packed in token order: a block scans its chunk and counts the tokens before it (excl).
  bool token_slots;
};

// Bit d: token t goes to member d. Topk mode: from its experts; with `own`, also written to mask_out and its expert
// indices checked (each token is its chunk's block's own).
__device__ unsigned token_members(const DispatchSendArgs& a, int t, bool own) {
  const int R = a.to.num_ranks;
  unsigned bits = 0;
  if (!a.topk_idx) {
    for (int d = 0; d < R; ++d) bits |= unsigned(a.mask_in[t * R + d]) << d;
    return bits;
  }
  const int local_experts = a.num_experts / R;
  for (int k = 0; k < a.topk; ++k) {
    const int e = a.topk_idx[t * a.topk + k];
    if (e >= 0 && e < a.num_experts)
      bits |= 1u << (e / local_experts);
    else if (own && e != -1)
      report(a.to.err, kBadExpertIndex, a.to.rank, t, k, e);
  }
  if (own)
    for (int d = 0; d < R; ++d) a.mask_out[t * R + d] = bits >> d & 1;
  return bits;
}

// Packed rows: rows in each member's message before the chunk starting at token t0, for every thread of the block:
// the tokens before t0 that go to d (the order in which d's scan places them), counted by the block.
__device__ void rows_before(const DispatchSendArgs& a, int t0, int* base) {
  const int R = a.to.num_ranks;
  __shared__ int counted[kMaxRanks];
  if (threadIdx.x < kMaxRanks) counted[threadIdx.x] = 0;
  __syncthreads();
  int mine[kMaxRanks] = {};
  int t = threadIdx.x;
  for (; t + 3 * int(blockDim.x) < t0; t += 4 * blockDim.x) {  // four tokens' loads in flight
    unsigned bits[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) bits[u] = token_members(a, t + u * blockDim.x, false);
#pragma unroll
    for (int u = 0; u < 4; ++u)
      for (int d = 0; d < R; ++d) mine[d] += bits[u] >> d & 1;
  }
  for (; t < t0; t += blockDim.x) {
    const unsigned bits = token_members(a, t, false);
    for (int d = 0; d < R; ++d) mine[d] += bits >> d & 1;
  }
  for (int d = 0; d < R; ++d)
    if (mine[d]) atomicAdd(&counted[d], mine[d]);
  __syncthreads();
  for (int d = 0; d < R; ++d) base[d] = counted[d];
  __syncthreads();  // `counted` is reused by the next chunk's call
}

// One pass of blockDim.x tokens from p0 (< t1): mask_out for them, and for packed rows their rows in excl, from
// base[], which advances.
__device__ void layout_pass(const DispatchSendArgs& a, int p0, int t1, int* base) {
  const int R = a.to.num_ranks, t = p0 + threadIdx.x;
  const unsigned bits = t < t1 ? token_members(a, t, true) : 0;
  if (a.token_slots) return;
  for (int d = 0; d < R; ++d) {
    int total;
    const int row = base[d] + block_exclusive_scan(bits >> d & 1, &total);
    if (t < t1) a.excl[t * R + d] = row;
    base[d] += total;
  }
}

// The chunk's layout: mask_out for its tokens [t0, t1), and excl for packed rows.
__device__ void chunk_layout(const DispatchSendArgs& a, int t0, int t1) {
  int base[kMaxRanks];
  if (!a.token_slots) rows_before(a, t0, base);
  for (int p0 = t0; p0 < t1; p0 += blockDim.x) layout_pass(a, p0, t1, base);
  __syncthreads();  // excl and mask_out are read by other warps of the block
}

// The routing of every chunk of send block `block` to every member, by `threads` threads of the block (this one is
// `thread`), then announced, so the members start their scans while rows move.
__device__ void send_routing(const DispatchSendArgs& a, int block, int blocks, int thread = threadIdx.x,
                             int threads = blockDim.x) {
  const SendTo& to = a.to;
  int chunks = 0;
  for (int c = block; c < a.chunks; c += blocks, ++chunks) {
    const int t0 = chunk_begin(a.num_tokens, a.chunks, c), t1 = chunk_begin(a.num_tokens, a.chunks, c + 1);
    for (const RoutingPiece& p : a.routing)
      for (int s = 0; p.src && s < to.num_ranks; ++s)
        if (s != to.self)
          group_copy(to.region[s] + p.offset + t0 * p.bytes_per_token, p.src + t0 * p.bytes_per_token,
                     (t1 - t0) * p.bytes_per_token, thread, threads);
  }
  announce_meta(to, chunks, thread, threads);
}

// Send side of (cached) dispatch: every chunk's routing first, so the members start their scans while rows
// move; then the chunk's layout; then each token's row (and scales) to every member that needs it, at its row
// there (token_slots: row t; else excl). A block per chunk of tokens; its progress in tokens.
__device__ void dispatch_send(const DispatchSendArgs& a, int block, int blocks) {
  const SendTo& to = a.to;
  if (!wait_acks(to)) return;
  send_routing(a, block, blocks);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const int R = to.num_ranks;
  const bool* mask = a.topk_idx ? a.mask_out : a.mask_in;
  for (int c = block; c < a.chunks; c += blocks) {
    const int t0 = chunk_begin(a.num_tokens, a.chunks, c), t1 = chunk_begin(a.num_tokens, a.chunks, c + 1);
    chunk_layout(a, t0, t1);
    // Rounds of a token per warp, announced as they land, so receivers copy behind us. The round's (token,
    // member) rows are dealt out over the warps: a token goes to 1 to R - 1 members.
    for (int r0 = t0; r0 < t1; r0 += warps) {
      const int r1 = min(t1, r0 + warps);
      int pair = 0;
      for (int t = r0; t < r1; ++t)
        for (int s = 0; s < R; ++s) {
          if (s == to.self || !mask[t * R + s] || pair++ % warps != warp) continue;
          const int64_t row = a.token_slots ? t : a.excl[t * R + s];
          char* x_dst = to.region[s] + a.x_offset + row * a.x_row_bytes;
          warp_copy(x_dst, a.x + int64_t(t) * a.x_row_bytes, a.x_row_bytes, lane);
          if (a.scales) {
            char* scale_dst = to.region[s] + a.scales_offset + row * a.scale_row_bytes;
            warp_copy(scale_dst, a.scales + int64_t(t) * a.scale_row_bytes, a.scale_row_bytes, lane);
          }
        }
      announce_progress(to, c, [&](int) { return r1 - t0; });
    }
  }
}
__global__ void __launch_bounds__(kTransferThreads, 1) dispatch_send_kernel(DispatchSendArgs a) {
  dispatch_send(a, blockIdx.x, gridDim.x);
}

// The bulk-copy kernels' shared memory (dynamic): their tables, then `stages` stages of `stage_bytes`.
struct BulkShape {
  uint32_t segment_bytes;  // most of a row one job moves (dispatch send: rows are cut into segments)
  uint32_t stage_bytes;
  uint32_t tables_bytes;
  int stages;
  int lag;               // StageRing::lag of each producer's ring
  int producers;         // issuing threads (the dispatch sender's; the other kernels have kProducers)
  int rows_per_job = 1;  // the dispatch sender's: consecutive tokens' whole rows a job moves
  __host__ __device__ uint32_t shared_bytes() const { return tables_bytes + uint32_t(stages) * stage_bytes; }
};

// The bulk dispatch sender's shared table, per pass of kTransferThreads tokens: each token's members.
constexpr uint32_t kSendTablesBytes = kTransferThreads * 4;

__device__ void init_stage_barriers(uint64_t* full, int stages) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) barrier_init(full + s, 1);
    fence_barrier_init();
  }
  __syncthreads();
}

// Threads of a bulk-copy block that issue copies (lane 0 of the first warps), each through its own stages: one
// thread spends ~0.36 us per copy, so one alone bounds a block well below what its SM can move. The dispatch sender
// takes up to kMaxProducers where rows are small enough (row_stages).
constexpr int kProducers = 4;
constexpr int kMaxProducers = 8;
constexpr int kMaxRowsPerJob = 4;  // a dispatch send job's consecutive tokens (rows of at most a quarter stage)

// The bulk senders' announcement of chunk c's progress: the word only grows (red.max), and a release is enough.
__device__ __forceinline__ void max_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// A bulk sender's producer `producer` publishes its frontier (its first job or token not yet landed; every one of
// its own before it has) in the block's `frontier` [producers]. The fence orders its landed copies before the word,
// for the announcer.
__device__ __forceinline__ void publish_frontier(int* frontier, int producer, int mine) {
  __threadfence_block();
  reinterpret_cast<volatile int*>(frontier)[producer] = mine;
}

// A bulk sender's announcer, one thread past the producers: until every producer's frontier reaches `end`, each time
// the least of them passes `announced` it announces it (announce(least): everything before it has landed; the fence
// puts the release after the producers' copies). The producers only publish, so none of them stalls on a
// system-scope release while its loaded stages wait.
template <class Announce>
__device__ void announce_frontiers(const int* frontier, int producers, int end, int announced, Announce&& announce) {
  while (announced < end) {
    int least = end;
    for (int q = 0; q < producers; ++q) least = min(least, reinterpret_cast<const volatile int*>(frontier)[q]);
    if (least <= announced) {
      __nanosleep(100);
      continue;
    }
    __threadfence_block();
    announce(least);
    announced = least;
  }
}

// The pass's scale rows (tokens p0 + i, i < tokens; 16-byte multiples) to their members, by `threads` threads (this
// is thread `thread`): the rows are contiguous in `scales`, so thread k takes 16-byte pieces k, k + threads, ... of
// them and a warp's loads and stores stay on consecutive bytes (with a row per thread, each access of a warp would
// touch 32 rows). A round's loads all go out before its stores. Reads the layout's members table.
__device__ void store_scale_rows(const DispatchSendArgs& a, int p0, int tokens, const unsigned* bits, unsigned others,
                                 int thread, int threads) {
  constexpr int kBatch = 10;  // pieces per thread a round: 342 rows of 224 bytes (56 scales) in two with 256 threads
  const int per_row = int(a.scale_row_bytes / 16), n = tokens * per_row;
  const int4* src = reinterpret_cast<const int4*>(a.scales + int64_t(p0) * a.scale_row_bytes);
  for (int i0 = 0; i0 < n; i0 += kBatch * threads) {
    int4 v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = i0 + k * threads + thread;
      if (i < n) v[k] = __ldg(src + i);
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = i0 + k * threads + thread;
      if (i >= n) break;
      const int token = i / per_row, piece = i - token * per_row;
      for (unsigned m = bits[token] & others; m; m &= m - 1) {
        const int d = __ffs(m) - 1;
        reinterpret_cast<int4*>(a.to.region[d] + a.scales_offset + int64_t(p0 + token) * a.scale_row_bytes)[piece] =
            v[k];
      }
    }
  }
}

// Send side of (cached) dispatch with bulk copies, in the one launch only (token slots: token t's row is row t of
// every message). Per pass of kTransferThreads tokens the block finds each token's members (a shared table; the first
// pass before it waits for the members' acknowledgements), and b.producers threads move the rows in groups of
// b.rows_per_job consecutive tokens, group q of the pass by producer q % b.producers: the group's rows (one row in
// segments of at most segment_bytes, or several whole rows) from x through a stage to every member that needs any of
// them. Meanwhile the warps past the producers send the routing (in the first pass) and store the FP8 scale rows (a
// scale row is too small to be worth a producer's bulk copy), so the copies wait for neither. A producer publishes how
// far its tokens have landed (`frontier`: every token before it that is its own has), and the first thread past the
// producers, once the pass's scale rows are in, announces the least frontier as the chunk's progress.
__device__ void dispatch_send_bulk(const DispatchSendArgs& a, const BulkShape& b, int block, int blocks) {
  const KernelStamp stamp(KernelKind::kDispatchSend);
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ int frontier[kMaxProducers];
  unsigned* bits = reinterpret_cast<unsigned*>(smem);
  init_stage_barriers(full, b.stages);
  const SendTo& to = a.to;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int P = b.producers;
  const bool producer = lane == 0 && warp < P;
  const int first_helper = P * kWarp;  // the warps past the producers
  const int per = b.stages / P;
  StageRing ring{smem + b.tables_bytes + size_t(warp * per) * b.stage_bytes, b.stage_bytes, per, full + warp * per,
                 b.lag};
  const int64_t xrb = a.x_row_bytes, srb = a.scales ? a.scale_row_bytes : 0;
  const int segs = int((xrb + b.segment_bytes - 1) / b.segment_bytes);
  const int g = segs == 1 ? b.rows_per_job : 1;  // tokens a job's group holds
  const unsigned others = ~(1u << to.self);
  bool first_pass = true;
  for (int c = block; c < a.chunks; c += blocks) {
    const int t0 = chunk_begin(a.num_tokens, a.chunks, c), t1 = chunk_begin(a.num_tokens, a.chunks, c + 1);
    for (int p0 = t0; p0 < t1; p0 += blockDim.x) {
      const int tokens = min(t1, p0 + int(blockDim.x)) - p0;
      if (int(threadIdx.x) < tokens) bits[threadIdx.x] = token_members(a, p0 + threadIdx.x, true);
      if (int(threadIdx.x) < P) frontier[threadIdx.x] = min(int(threadIdx.x) * g, tokens);
      // The table is in before the producers copy and the warps past them send; nothing lands in a member's
      // region before it has acknowledged our last message.
      if (first_pass) {
        if (!wait_acks(to)) return;
      } else {
        __syncthreads();
      }
      if (warp >= P) {
        const int threads = int(blockDim.x) - first_helper, thread = int(threadIdx.x) - first_helper;
        if (first_pass) send_routing(a, block, blocks, thread, threads);
        if (srb) {
          // The scale rows while the producers copy; a system fence (cumulative over the warps' stores, which the
          // named barrier orders before it) by the announcer before its first announcement.
          store_scale_rows(a, p0, tokens, bits, others, thread, threads);
          group_barrier(threads);
          if (thread == 0) __threadfence_system();
        }
        if (thread == 0)
          announce_frontiers(frontier, P, tokens, 0, [&](int least) {
            for (int d = 0; d < to.num_ranks; ++d)
              if (d != to.self) max_release_sys(to.chunks[d] + c, progress(to.message[d], p0 - t0 + least));
          });
      }
      first_pass = false;
      if (producer) {
        // The pass's tokens in groups of g (group q: tokens q * g, ...); this producer's are groups warp, warp + P, ...
        const int mine = ((tokens + g - 1) / g - warp + P - 1) / P;
        const int n = max(0, mine) * segs;
        // Job j: segment j % segs of the producer's group j / segs (its `rows` tokens from p0 + i; a segment of a
        // row, or g whole rows), to the same rows of each member's message.
        const auto part = [&](int j, int& i, int& rows, int64_t& offset, uint32_t& x_bytes) {
          const int seg = segs == 1 ? 0 : j % segs;
          i = (warp + (segs == 1 ? j : j / segs) * P) * g;
          rows = min(g, tokens - i);
          offset = int64_t(seg) * b.segment_bytes;
          x_bytes = uint32_t(min(int64_t(b.segment_bytes), xrb - offset));
        };
        // The members any of the group's tokens go to. One token a job is the common case, and an issuing thread's
        // own work per job bounds small rows: it takes no loop.
        const auto group_members = [&](int i, int rows) {
          unsigned m = bits[i];
          for (int r = 1; r < rows; ++r) m |= bits[i + r];
          return m & others;
        };
        run_bulk_jobs(
            ring,
            [&](int j, char* stage, uint64_t* bar) -> int64_t {
              if (j >= n) return kNoMoreJobs;
              int i, rows;
              int64_t offset;
              uint32_t x_bytes;
              part(j, i, rows, offset, x_bytes);
              if (!group_members(i, rows)) return 0;
              const uint32_t bytes = x_bytes * uint32_t(rows);  // rows > 1: whole rows
              barrier_arrive_expect(bar, bytes);
              bulk_load(stage, a.x + int64_t(p0 + i) * xrb + offset, bytes, bar);
              return bytes;
            },
            [&](int j, char* stage) {
              int i, rows;
              int64_t offset;
              uint32_t x_bytes;
              part(j, i, rows, offset, x_bytes);
              // To each member, a store per run of the group's consecutive tokens that go to it.
              for (unsigned m = group_members(i, rows); m; m &= m - 1) {
                const int d = __ffs(m) - 1;
                if (rows == 1) {
                  bulk_store(to.region[d] + a.x_offset + int64_t(p0 + i) * xrb + offset, stage, x_bytes);
                  continue;
                }
                for (int r = 0, run = 0; r < rows; r += run) {
                  if (!(bits[i + r] >> d & 1)) {
                    run = 1;
                    continue;
                  }
                  for (run = 1; r + run < rows && bits[i + r + run] >> d & 1;) ++run;
                  bulk_store(to.region[d] + a.x_offset + int64_t(p0 + i + r) * xrb + offset, stage + size_t(r) * xrb,
                             x_bytes * uint32_t(run));
                }
              }
            },
            [&](int k) {
              // This producer's first k / segs groups have landed: its frontier is its next group's first token (or
              // the pass's end).
              publish_frontier(frontier, warp, min(tokens, (warp + k / segs * P) * g));
            });
      }
      __syncthreads();  // the table is the next pass's
    }
  }
  // A block whose chunk has no tokens still announces its routing (empty), which every member's scan waits for.
  if (first_pass && wait_acks(to)) send_routing(a, block, blocks);
}

// Work items per chunk of a receive side: the most tokens a chunk has, in pieces of piece_tokens.
__device__ __forceinline__ int pieces(int num_tokens, int chunks, int piece_tokens = kPieceTokens) {
  return ((num_tokens + chunks - 1) / chunks + piece_tokens - 1) / piece_tokens;
}

// First row in [lo, hi) of row_map (sorted by token within a source) whose token is >= t.
__device__ int first_row_from(const int2* row_map, int lo, int hi, int t) {
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (row_map[mid].y < t)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// Hands out one launch's work items 0, 1, ... to whichever thread asks next, in any block of the launch (word 0 of
// the device's handoff_words). The block that hands its tables over first resets it before it does, and every
// block takes items only after that handover, so a count an earlier launch left (or broke off) never leaks in.
struct ItemCounter {
  uint64_t* word;
  __device__ void reset() const { *reinterpret_cast<volatile unsigned*>(word) = 0; }
  __device__ int take() const { return int(atomicAdd(reinterpret_cast<unsigned*>(word), 1u)); }
};

struct DispatchReceiveArgs {
  ReceiveFrom from;
  Sources src;
  bool topk_mode;
  int chunks, topk, num_experts, num_tokens, capacity;
  const int2* row_map;
  const int32_t* counts;    // [R] rows from each source (before the capacity cut)
  const int32_t* num_kept;  // rows kept (<= capacity)
  int64_t x_row_bytes, scale_row_bytes;
  char* recv_x;
  char* recv_scales;  // or null
  int32_t* recv_topk_idx;
  float* recv_topk_weights;
  const int32_t* row_before;       // [R, T + 1] from the scan
  int32_t* num_tokens_per_expert;  // topk mode: [local experts], zeroed by the scan, counted as slots are localized
  bool token_slots;                // the members' messages as DispatchSendArgs::token_slots says
};

// Where source s's rows are in its message: ours (the op's inputs) and, with token slots, a member's at their
// token's row; else a member's packed in token order.
__device__ __forceinline__ bool rows_at_tokens(const DispatchReceiveArgs& a, int s) {
  return s == a.from.self || a.token_slots;
}

// Output row o's expert slot k (from source s's token t): the index among our local experts with its weight, or -1
// and 0 for another GPU's expert; a local expert's row is counted (each kept row's slots are localized once).
__device__ __forceinline__ void localize_slot(const DispatchReceiveArgs& a, int o, int s, int t, int k, int first,
                                              int local_experts) {
  const int e = a.src.topk_idx[s][t * a.topk + k];
  const bool mine = e >= first && e < first + local_experts;
  if (mine) atomicAdd(a.num_tokens_per_expert + e - first, 1);
  a.recv_topk_idx[o * a.topk + k] = mine ? e - first : -1;
  if (a.recv_topk_weights) a.recv_topk_weights[o * a.topk + k] = mine ? a.src.weights[s][t * a.topk + k] : 0.f;
}

// Output row o past the kept rows, by one warp: zeros, expert indices -1.
__device__ void pad_row(const DispatchReceiveArgs& a, int o, int lane) {
  warp_zero(a.recv_x + int64_t(o) * a.x_row_bytes, a.x_row_bytes, lane);
  if (a.recv_scales) warp_zero(a.recv_scales + int64_t(o) * a.scale_row_bytes, a.scale_row_bytes, lane);
  if (a.topk_mode)
    for (int k = lane; k < a.topk; k += kWarp) {
      a.recv_topk_idx[o * a.topk + k] = -1;
      if (a.recv_topk_weights) a.recv_topk_weights[o * a.topk + k] = 0.f;
    }
}

// Rows [o0, o1) of source s (packed rows: output row o is row o - offset of its message) into the output, a row per
// warp, with their expert indices localized.
__device__ void copy_rows(const DispatchReceiveArgs& a, int s, int o0, int o1, int offset, int warp, int warps,
                          int lane, int first, int local_experts) {
  const bool own = s == a.from.self, at_tokens = rows_at_tokens(a, s);
  for (int o = o0 + warp; o < o1; o += warps) {
    const int t = a.row_map[o].y;
    const int64_t row = at_tokens ? t : o - offset;
    char* out_x = a.recv_x + int64_t(o) * a.x_row_bytes;
    const char* in_x = a.src.x[s] + row * a.x_row_bytes;
    if (own)
      warp_copy(out_x, in_x, a.x_row_bytes, lane);
    else
      warp_copy<Load::kCoherent>(out_x, in_x, a.x_row_bytes, lane);  // landed while we ran
    if (a.recv_scales) {
      char* out_s = a.recv_scales + int64_t(o) * a.scale_row_bytes;
      const char* in_s = a.src.scales[s] + row * a.scale_row_bytes;
      if (own)
        warp_copy(out_s, in_s, a.scale_row_bytes, lane);
      else
        warp_copy<Load::kCoherent>(out_s, in_s, a.scale_row_bytes, lane);
    }
    if (a.topk_mode)
      for (int k = lane; k < a.topk; k += kWarp) localize_slot(a, o, s, t, k, first, local_experts);
  }
}

// Receive side of (cached) dispatch: work items of kPieceTokens tokens of a chunk and a source, in the order the
// send blocks make progress (every chunk's first piece, then every second piece, ...); a block copies an item's
// rows once the chunk's progress covers them (our own rows at once). Rows past the kept count are padding: zeros,
// index -1.
__device__ void dispatch_receive(const DispatchReceiveArgs& a, int block, int blocks) {
  const ReceiveFrom& from = a.from;
  const int R = from.num_ranks;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const int kept = *a.num_kept;
  const int local_experts = a.topk_mode ? a.num_experts / R : 0;
  const int first = from.self * local_experts;
  __shared__ bool ok;
  for (int item = block; item < pieces(a.num_tokens, a.chunks) * a.chunks * R; item += blocks) {
    const int s = item % R, c = item / R % a.chunks;
    const int c0 = chunk_begin(a.num_tokens, a.chunks, c), c1 = chunk_begin(a.num_tokens, a.chunks, c + 1);
    const int t0 = c0 + item / (R * a.chunks) * kPieceTokens, t1 = min(c1, t0 + kPieceTokens);
    if (t0 >= t1) continue;
    int offset = 0;
    for (int q = 0; q < s; ++q) offset += a.counts[q];
    const int lo = min(offset, kept), hi = min(offset + a.counts[s], kept);
    const int o0 = first_row_from(a.row_map, lo, hi, t0);
    const int o1 = first_row_from(a.row_map, o0, hi, t1);
    if (o0 == o1) continue;
    if (s != from.self) {  // a member's rows once its chunk's progress covers them
      if (threadIdx.x == 0) ok = wait_progress(from, s, c, a.row_map[o1 - 1].y - c0 + 1) >= 0;
      __syncthreads();
      const bool arrived = ok;
      __syncthreads();  // ok is reused
      if (!arrived) continue;
    }
    copy_rows(a, s, o0, o1, offset, warp, warps, lane, first, local_experts);
  }
  const int all_warps = blocks * warps;
  for (int o = kept + block * warps + warp; o < a.capacity; o += all_warps) pad_row(a, o, lane);
}
__global__ void __launch_bounds__(kTransferThreads, 1) dispatch_receive_kernel(DispatchReceiveArgs a) {
  dispatch_receive(a, blockIdx.x, gridDim.x);
}

// Waits until every chunk of every member's message to us has landed whole (the sides apart, g_sides_apart); false
// (to the whole block) once a member is late (reported).
__device__ bool wait_every_chunk(const DispatchReceiveArgs& a) {
  const ReceiveFrom& from = a.from;
  return block_waits(from.num_ranks * a.chunks, [&](int u) {
    const int s = u % from.num_ranks, c = u / from.num_ranks;
    return s == from.self ||
           wait_progress(from, s, c,
                         chunk_begin(a.num_tokens, a.chunks, c + 1) - chunk_begin(a.num_tokens, a.chunks, c)) >= 0;
  });
}

// Receive side of (cached) dispatch with bulk copies: the work items of dispatch_receive_kernel, taken in order from
// the launch's counter by kProducers threads (lane 0 of the first warps), each with its own stages, so one's wait for a
// member or for the next item's bounds leaves the others' copies in flight (and a producer whose items were our own
// rows, there at once, goes on to members' rows instead of idling). A member's rows move once the chunk's progress
// covers the item. An item's rows land on consecutive output rows; where they are contiguous in the source too (every
// token of the item comes to us: the messages have token slots) they move (x, then scales) in stage-sized pieces, else
// as many whole rows a job as a stage holds, a load per run of consecutive tokens (a segment a job of larger rows). The
// other warps of receive block `block` (of `blocks`) localize the expert indices of its share of the kept rows and
// write its share of the padding past the kept count; a send block that `joined` once its sends were done only copies.
__device__ void dispatch_receive_bulk(const DispatchReceiveArgs& a, const BulkShape& b, const ItemCounter& items,
                                      int block, int blocks, bool joined) {
  if (g_sides_apart && !wait_every_chunk(a)) return;
  const KernelStamp stamp(KernelKind::kDispatchReceive);
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ char* part_dst[kMaxStages][2];
  __shared__ uint32_t part_bytes[kMaxStages][2];
  __shared__ int producer_tokens[kProducers][kPieceTokens];
  init_stage_barriers(full, b.stages);
  const ReceiveFrom& from = a.from;
  const int R = from.num_ranks, T = a.num_tokens;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const int kept = *a.num_kept;
  const int64_t xrb = a.x_row_bytes, srb = a.recv_scales ? a.scale_row_bytes : 0;
  if (warp < kProducers && lane == 0) {
    const int per = b.stages / kProducers, first_stage = warp * per;
    StageRing ring{smem + b.tables_bytes + size_t(first_stage) * b.stage_bytes, b.stage_bytes, per, full + first_stage,
                   b.lag};
    int* item_tokens = producer_tokens[warp];
    const int all_items = pieces(T, a.chunks) * a.chunks * R;
    const int segs = int((xrb + b.segment_bytes - 1) / b.segment_bytes);
    const int rows_per_job = segs == 1 ? int(b.stage_bytes / (xrb + srb)) : 1;  // of an item's rows a row at a time
    // The stream's position: item, its source s and rows [o0, o1); then, where they are contiguous in the source's
    // message (from token t0's row on), a byte position in its x rows (phase 1) and scale rows (2), else a row and
    // segment of the item (3); 0: the next item.
    int item = 0, s = 0, o0 = 0, o1 = 0, t0 = 0, phase = 0, row = 0;
    int seg = 0;
    int64_t at = 0;
    run_bulk_jobs(
        ring,
        [&](int j, char* stage, uint64_t* bar) -> int64_t {
          const int st = first_stage + j % ring.stages;
          for (;;) {
            if (phase == 0) {  // the launch's next item that no producer has taken
              item = items.take();
              if (item >= all_items) return kNoMoreJobs;
              s = item % R;
              const int c = item / R % a.chunks;
              const int c0 = chunk_begin(T, a.chunks, c), c1 = chunk_begin(T, a.chunks, c + 1);
              t0 = c0 + item / (R * a.chunks) * kPieceTokens;
              const int t1 = min(c1, t0 + kPieceTokens);
              if (t0 >= t1) continue;
              const int32_t* before = a.row_before + int64_t(s) * (T + 1);
              o0 = min(before[t0], kept);
              o1 = min(before[t1], kept);
              if (o0 >= o1) continue;
              if (s != from.self && wait_progress(from, s, c, t1 - c0) < 0) continue;
              // Rows at their tokens' rows (token slots) are contiguous where every token of the item comes to us
              // (and is kept).
              if (o1 - o0 == t1 - t0) {
                phase = 1;
                at = 0;
              } else {
                for (int i = 0; i < o1 - o0; ++i) item_tokens[i] = a.row_map[o0 + i].y;
                phase = 3;
                row = seg = 0;
              }
            }
            if (phase == 1 || phase == 2) {
              const int64_t rb = phase == 1 ? xrb : srb, total = int64_t(o1 - o0) * rb;
              if (at >= total) {
                phase = phase == 1 && srb ? 2 : 0;
                at = 0;
                continue;
              }
              const uint32_t bytes = uint32_t(min(int64_t(b.stage_bytes), total - at));
              const int64_t from_row = int64_t(t0) * rb, to_row = int64_t(o0) * rb;
              const char* src = (phase == 1 ? a.src.x[s] : a.src.scales[s]) + from_row + at;
              part_dst[st][0] = (phase == 1 ? a.recv_x : a.recv_scales) + to_row + at;
              part_bytes[st][0] = bytes;
              part_bytes[st][1] = 0;
              barrier_arrive_expect(bar, bytes);
              bulk_load(stage, src, bytes, bar);
              at += bytes;
              return bytes;
            }
            // Rows at their tokens' rows, with gaps, which land on consecutive output rows: rows that fit a stage
            // whole go as many a job as the stage holds (a load per run of consecutive tokens into [x rows][scale
            // rows], one store of each part); a larger row goes by segments, `seg` of row o0 + row, the scales with
            // the last segment.
            if (row >= o1 - o0) {
              phase = 0;
              continue;
            }
            if (rows_per_job > 1) {
              const int n = min(rows_per_job, o1 - o0 - row), o = o0 + row;
              part_dst[st][0] = a.recv_x + int64_t(o) * xrb;
              part_bytes[st][0] = uint32_t(n * xrb);
              part_dst[st][1] = srb ? a.recv_scales + int64_t(o) * srb : nullptr;
              part_bytes[st][1] = uint32_t(n * srb);
              const uint32_t bytes = uint32_t(n * (xrb + srb));
              barrier_arrive_expect(bar, bytes);
              for (int r = 0, run = 1; r < n; r += run) {
                const int t = item_tokens[row + r];
                for (run = 1; r + run < n && item_tokens[row + r + run] == t + run;) ++run;
                bulk_load(stage + r * xrb, a.src.x[s] + int64_t(t) * xrb, uint32_t(run * xrb), bar);
                if (srb)
                  bulk_load(stage + n * xrb + r * srb, a.src.scales[s] + int64_t(t) * srb, uint32_t(run * srb), bar);
              }
              row += n;
              return bytes;
            }
            const int t = item_tokens[row], o = o0 + row;
            const int64_t offset_in_row = int64_t(seg) * b.segment_bytes;
            const uint32_t x_bytes = uint32_t(min(int64_t(b.segment_bytes), xrb - offset_in_row));
            const bool with_scales = srb && seg == segs - 1;
            part_dst[st][0] = a.recv_x + int64_t(o) * xrb + offset_in_row;
            part_bytes[st][0] = x_bytes;
            part_dst[st][1] = with_scales ? a.recv_scales + int64_t(o) * srb : nullptr;
            part_bytes[st][1] = with_scales ? uint32_t(srb) : 0;
            const uint32_t bytes = x_bytes + part_bytes[st][1];
            barrier_arrive_expect(bar, bytes);
            bulk_load(stage, a.src.x[s] + int64_t(t) * xrb + offset_in_row, x_bytes, bar);
            if (with_scales) bulk_load(stage + x_bytes, a.src.scales[s] + int64_t(t) * srb, uint32_t(srb), bar);
            if (++seg == segs) {
              seg = 0;
              ++row;
            }
            return bytes;
          }
        },
        [&](int j, char* stage) {
          const int st = first_stage + j % ring.stages;
          bulk_store(part_dst[st][0], stage, part_bytes[st][0]);
          if (part_bytes[st][1]) bulk_store(part_dst[st][1], stage + part_bytes[st][0], part_bytes[st][1]);
        },
        [](int) {});
    return;
  }
  if (warp < kProducers || joined) return;
  // The other warps: the kept rows' expert indices (and weights), localized, a row per thread; then the padding.
  const int helper_warps = warps - kProducers;
  const int helpers = helper_warps * kWarp, helper = (warp - kProducers) * kWarp + lane;
  const int local_experts = a.topk_mode ? a.num_experts / R : 0, first = from.self * local_experts;
  for (int o = block * helpers + helper; a.topk_mode && o < kept; o += blocks * helpers) {
    const int2 st = a.row_map[o];
    for (int k = 0; k < a.topk; ++k) localize_slot(a, o, st.x, st.y, k, first, local_experts);
  }
  for (int o = kept + block * helper_warps + warp - kProducers; o < a.capacity; o += blocks * helper_warps)
    pad_row(a, o, lane);
}

struct CombineSendArgs {
  SendTo to;
  int chunks;
  const char* y;  // [capacity, row_bytes]: rows of each source, in source order
  int64_t row_bytes;
  int capacity;
  const int32_t* recv_counts;  // [R] from the dispatch (before its capacity cut)
  bool drop_overflow;          // the dispatch dropped rows past y's end on purpose (Overflow::kDrop)
};

// The dispatch's rows must fit y unless it dropped rows on purpose: reported once, by block 0.
__device__ void check_combine_capacity(const CombineSendArgs& a, int block) {
  if (block != 0 || threadIdx.x != 0 || a.drop_overflow) return;
  int total = 0;
  for (int s = 0; s < a.to.num_ranks; ++s) total += a.recv_counts[s];
  if (total > a.capacity) report(a.to.err, kHandleDisagreesWithY, a.to.rank, total, a.capacity, 0);
}

// Send side of combine: the rows of each member go back to it, packed as they came (row j of its block of y is
// row j of its message). Rows the dispatch dropped past y's capacity go back as zeros, and y is never read past its
// end. Chunk c of the rows to member s: chunk_begin(recv_counts[s], chunks, c);
// its progress in rows.
__device__ void combine_send(const CombineSendArgs& a, int block, int blocks) {
  const SendTo& to = a.to;
  const int R = to.num_ranks;
  check_combine_capacity(a, block);
  if (!wait_acks(to)) return;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  int offsets[kMaxRanks];
  for (int s = 0, o = 0; s < R; o += a.recv_counts[s], ++s) offsets[s] = o;
  for (int c = block; c < a.chunks; c += blocks) {
    // Rounds of a row per warp and member (dealt out over the warps), announced as they land.
    int most = 0;
    for (int s = 0; s < R; ++s)
      if (s != to.self)
        most = max(most, chunk_begin(a.recv_counts[s], a.chunks, c + 1) - chunk_begin(a.recv_counts[s], a.chunks, c));
    for (int k0 = 0; k0 < most; k0 += warps) {
      int pair = 0;
      for (int s = 0; s < R; ++s) {
        if (s == to.self) continue;
        const int j0 = chunk_begin(a.recv_counts[s], a.chunks, c),
                  n = chunk_begin(a.recv_counts[s], a.chunks, c + 1) - j0;
        for (int k = k0; k < min(n, k0 + warps); ++k) {
          if (pair++ % warps != warp) continue;
          const int j = j0 + k;
          char* dst = to.region[s] + int64_t(j) * a.row_bytes;
          if (offsets[s] + j < a.capacity)
            warp_copy(dst, a.y + int64_t(offsets[s] + j) * a.row_bytes, a.row_bytes, lane);
          else
            warp_zero(dst, a.row_bytes, lane);
        }
      }
      announce_progress(to, c, [&](int s) {
        const int n = chunk_begin(a.recv_counts[s], a.chunks, c + 1) - chunk_begin(a.recv_counts[s], a.chunks, c);
        return min(n, k0 + warps);
      });
    }
    announce_meta(to);  // keeps the meta count at `chunks` a message (combine has no routing to send)
  }
}
__global__ void __launch_bounds__(kTransferThreads, 1) combine_send_kernel(CombineSendArgs a) {
  combine_send(a, blockIdx.x, gridDim.x);
}

// Send side of combine with bulk copies: the rows of chunk c to each member are contiguous in y and in its region, so
// they move in stage-sized pieces, members taken in turn (job j: piece j / M of member j % M), dealt out over
// kProducers threads (job j to producer j % kProducers), each with its own stages. Each publishes its frontier (the
// next job of its own it has not completed), and the first thread past them announces to each member what the least
// frontier covers. Rows past y's capacity (dropped by the dispatch) go back as zeros, written by the block before the
// pieces move.
__device__ void combine_send_bulk(const CombineSendArgs& a, const BulkShape& b, int block, int blocks) {
  const KernelStamp stamp(KernelKind::kCombineSend);
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ int frontier[kProducers];
  const SendTo& to = a.to;
  const int R = to.num_ranks;
  check_combine_capacity(a, block);
  init_stage_barriers(full, b.stages);
  if (!wait_acks(to)) return;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const bool producer = lane == 0 && warp < kProducers;
  const int per = b.stages / kProducers;
  StageRing ring{smem + b.tables_bytes + size_t(warp * per) * b.stage_bytes, b.stage_bytes, per, full + warp * per,
                 b.lag};
  int offsets[kMaxRanks];
  for (int s = 0, o = 0; s < R; o += a.recv_counts[s], ++s) offsets[s] = o;
  const int64_t rb = a.row_bytes;
  for (int c = block; c < a.chunks; c += blocks) {
    // Member s's rows [j0, j1) of this chunk; those at or past y's capacity from `kept` on.
    int j0[kMaxRanks], j1[kMaxRanks], kept[kMaxRanks], pieces[kMaxRanks], members[kMaxRanks];
    int M = 0, most = 0;
    for (int s = 0; s < R; ++s) {
      if (s == to.self) continue;
      j0[M] = chunk_begin(a.recv_counts[s], a.chunks, c);
      j1[M] = chunk_begin(a.recv_counts[s], a.chunks, c + 1);
      kept[M] = max(j0[M], min(j1[M], a.capacity - offsets[s]));
      for (int j = kept[M] + warp; j < j1[M]; j += warps) warp_zero(to.region[s] + int64_t(j) * rb, rb, lane);
      pieces[M] = int((int64_t(kept[M] - j0[M]) * rb + b.stage_bytes - 1) / b.stage_bytes);
      most = max(most, pieces[M]);
      members[M++] = s;
    }
    const int jobs = most * M;
    if (threadIdx.x < kProducers) frontier[threadIdx.x] = min(int(threadIdx.x), jobs);
    __syncthreads();  // the zeros are written before the producers' announcements (the barrier, then releases)
    if (producer && M > 0) {
      // The producer's job i is job warp + i * kProducers.
      const auto piece = [&](int j, int m, int64_t& at, uint32_t& bytes) {
        const int64_t begin = int64_t(j0[m]) * rb, end = int64_t(kept[m]) * rb;
        at = begin + int64_t(j / M) * b.stage_bytes;
        bytes = uint32_t(min(int64_t(b.stage_bytes), end - at));
      };
      run_bulk_jobs(
          ring,
          [&](int i, char* stage, uint64_t* bar) -> int64_t {
            const int j = warp + i * kProducers;
            if (j >= jobs) return kNoMoreJobs;
            const int m = j % M;
            if (j / M >= pieces[m]) return 0;
            int64_t at;
            uint32_t bytes;
            piece(j, m, at, bytes);
            barrier_arrive_expect(bar, bytes);
            bulk_load(stage, a.y + int64_t(offsets[members[m]]) * rb + at, bytes, bar);
            return bytes;
          },
          [&](int i, char* stage) {
            const int j = warp + i * kProducers;
            const int m = j % M;
            int64_t at;
            uint32_t bytes;
            piece(j, m, at, bytes);
            bulk_store(to.region[members[m]] + at, stage, bytes);
          },
          [&](int k) {
            // This producer's first k jobs have landed: its frontier is its next job (or the chunk's end).
            publish_frontier(frontier, warp, min(jobs, warp + k * kProducers));
          });
    } else if (threadIdx.x == kProducers * kWarp && M > 0) {
      // From -1: a chunk whose rows were all dropped (no jobs) is still announced, as zeros.
      announce_frontiers(frontier, kProducers, jobs, -1, [&](int least) {
        for (int m = 0; m < M; ++m) {
          const int done_pieces = least > m ? (least - m + M - 1) / M : 0;
          const int rows_done =
              done_pieces >= pieces[m] ? j1[m] - j0[m] : int(int64_t(done_pieces) * b.stage_bytes / rb);
          max_release_sys(to.chunks[members[m]] + c, progress(to.message[members[m]], rows_done));
        }
      });
    }
    announce_meta(to);  // keeps the meta count at `chunks` a message (combine has no routing to send)
  }
}

struct CombineReceiveArgs {
  ReceiveFrom from;
  int chunks;
  const char* y;
  int64_t row_bytes;
  int capacity, num_tokens;
  const int32_t* recv_counts;
  const bool* mask;  // [T, R] this rank's
  int32_t* excl;     // [T + 1, R] from positions_kernel, or in one launch its first receive block
  char* out;         // [T, row_bytes]
};

// The lane's kUnroll vectors from i (i, i + kWarp, ...; those before `end`) of the float32 sum of `n` rows, written to
// dst as T; each row's loads issued together. `load(j, index)` reads one 16-byte vector of row j.
template <typename T, class Load>
__device__ __forceinline__ void sum_vectors(int4* dst, int n, int64_t i, int64_t end, const Load& load) {
  float acc[kUnroll][Vec<T>::kN] = {};
  for (int j = 0; j < n; ++j) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * kWarp < end) v[u] = load(j, i + u * kWarp);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * kWarp < end) Vec<T>::add(acc[u], v[u]);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (i + u * kWarp < end) dst[i + u * kWarp] = Vec<T>::pack(acc[u]);
}

// Receive side of combine: work items of kPieceTokens tokens, in the order the members' send blocks make progress
// (roughly: a member's rows for our token chunk c sit in its chunk c when routing is even). A block waits until the
// chunks of each member that hold those tokens' rows have them (a thread per (member, chunk)), then sums every token's
// copies in float32 with (token, 2 KiB segment) work per warp; each lane sums up to four 16-byte vectors with their
// loads issued together.
constexpr int64_t kSegmentBytes = 2048;
template <typename T>
__device__ void combine_receive(const CombineReceiveArgs& a, int block, int blocks) {
  const ReceiveFrom& from = a.from;
  const int R = from.num_ranks, T_ = a.num_tokens;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  int own_offset = 0;
  for (int q = 0; q < from.self; ++q) own_offset += a.recv_counts[q];
  const bool vector = a.row_bytes % 16 == 0;
  const int64_t segments = max(int64_t(1), (a.row_bytes + kSegmentBytes - 1) / kSegmentBytes);
  __shared__ int failed;
  for (int item = block; item < pieces(T_, a.chunks) * a.chunks; item += blocks) {
    const int c = item % a.chunks;
    const int t0 = chunk_begin(T_, a.chunks, c) + item / a.chunks * kPieceTokens;
    const int t1 = min(chunk_begin(T_, a.chunks, c + 1), t0 + kPieceTokens);
    if (t0 >= t1) continue;
    __syncthreads();  // the previous item's readers of `failed` are done
    if (threadIdx.x == 0) failed = 0;
    __syncthreads();
    if (threadIdx.x < R * a.chunks) {
      const int d = threadIdx.x / a.chunks, c = threadIdx.x % a.chunks;
      const int lo = a.excl[t0 * R + d], hi = a.excl[t1 * R + d], n = a.excl[T_ * R + d];
      const int c0 = chunk_begin(n, a.chunks, c), c1 = chunk_begin(n, a.chunks, c + 1);
      if (d != from.self && lo < hi && c0 < c1 && c0 < hi && c1 > lo && wait_progress(from, d, c, min(hi, c1) - c0) < 0)
        failed = 1;
    }
    __syncthreads();
    if (failed) continue;
    for (int64_t w = warp; w < int64_t(t1 - t0) * segments; w += warps) {
      const int t = t0 + int(w / segments);
      const int64_t b0 = (w % segments) * kSegmentBytes, b1 = min(a.row_bytes, b0 + kSegmentBytes);
      const char* rows[kMaxRanks];
      int n = 0;
      for (int d = 0; d < R; ++d) {
        if (!a.mask[t * R + d]) continue;
        const int j = a.excl[t * R + d];
        if (d != from.self)
          rows[n++] = from.region[d] + int64_t(j) * a.row_bytes;
        else if (own_offset + j < a.capacity)
          rows[n++] = a.y + int64_t(own_offset + j) * a.row_bytes;
        // else: dropped by the dispatch
      }
      if (!vector) {  // rows of a few elements (a weight gradient, say): one element per lane
        T* dst = reinterpret_cast<T*>(a.out + int64_t(t) * a.row_bytes);
        for (int64_t i = b0 / int64_t(sizeof(T)) + lane; i < b1 / int64_t(sizeof(T)); i += kWarp) {
          float acc = 0.f;
          for (int j = 0; j < n; ++j) acc += to_float(__ldcg(reinterpret_cast<const T*>(rows[j]) + i));
          dst[i] = from_float<T>(acc);
        }
        continue;
      }
      int4* dst = reinterpret_cast<int4*>(a.out + int64_t(t) * a.row_bytes);
      const int64_t v0 = b0 / 16, v1 = b1 / 16;
      const int4* vector_rows[kMaxRanks];
      for (int j = 0; j < n; ++j) vector_rows[j] = reinterpret_cast<const int4*>(rows[j]);
      const auto coherent = [&](int j, int64_t k) { return __ldcg(vector_rows[j] + k); };  // landed while we ran
      for (int64_t i = v0 + lane; i < v1; i += kUnroll * kWarp) sum_vectors<T>(dst, n, i, v1, coherent);
    }
  }
}
template <typename T>
__global__ void __launch_bounds__(kTransferThreads, 1) combine_receive_kernel(CombineReceiveArgs a) {
  combine_receive<T>(a, blockIdx.x, gridDim.x);
}

// Receive side of combine with bulk copies: every warp of the block works alone through its own `per` stages. It takes
// the launch's work items (pieces of kCombinePieceTokens tokens of a chunk, in the order of combine_receive_kernel) one
// at a time from its counter, waits for the item's rows and lists where each token's copies are; then per
// (token, segment of at most segment_bytes) its lanes load every copy of the segment into a stage (a slot per copy).
// Once a stage's loads land the warp sums them in float32 from shared memory, writes the sum and refills the stage
// with its next job, so the loads of its other stages stay in flight while it adds.
constexpr int kCombinePieceTokens = 4;
struct CombineJob {
  int token, rows;
  uint32_t offset, bytes;
};
template <typename T>
__device__ void combine_receive_bulk(const CombineReceiveArgs& a, const BulkShape& b, const ItemCounter& items) {
  const KernelStamp stamp(KernelKind::kCombineReceive);
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ CombineJob job_of[kMaxStages];
  // Per warp, its item's copies: [token][member] the row in the member's message (ours: in y), or -1.
  __shared__ int listed[kTransferWarps][kCombinePieceTokens][kMaxRanks];
  const ReceiveFrom& from = a.from;
  const int R = from.num_ranks, T_ = a.num_tokens, per = b.stages / kTransferWarps;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (threadIdx.x == 0) {
    for (int s = 0; s < b.stages; ++s) barrier_init(full + s, 1);
    fence_barrier_init();
  }
  __syncthreads();
  int own_offset = 0;
  for (int q = 0; q < from.self; ++q) own_offset += a.recv_counts[q];
  const int64_t rb = a.row_bytes;
  const int segs = int((rb + b.segment_bytes - 1) / b.segment_bytes);
  const int all_items = pieces(T_, a.chunks, kCombinePieceTokens) * a.chunks;
  int (*table)[kMaxRanks] = listed[warp];
  const char* source = lane < R ? (lane == from.self ? a.y : from.region[lane]) : nullptr;  // lane d's member
  // The issuing side's place: tokens [t0, t1) of the current item, token t0 + i, segment g.
  int t0 = 0, t1 = 0, i = 0, g = 0;
  const auto next_job = [&](int st) -> bool {
    while (i >= t1 - t0) {  // the launch's next item that no warp has taken
      int k = 0;
      if (lane == 0) k = items.take();
      const int item = __shfl_sync(0xffffffffu, k, 0);
      if (item >= all_items) return false;
      const int c = item % a.chunks;
      t0 = chunk_begin(T_, a.chunks, c) + item / a.chunks * kCombinePieceTokens;
      t1 = min(chunk_begin(T_, a.chunks, c + 1), t0 + kCombinePieceTokens);
      i = g = 0;
      if (t0 >= t1) continue;
      bool ok = true;
      for (int p = lane; p < R * a.chunks; p += kWarp) {
        const int d = p / a.chunks, cc = p % a.chunks;
        const int lo = a.excl[t0 * R + d], hi = a.excl[t1 * R + d], n = a.excl[T_ * R + d];
        const int c0 = chunk_begin(n, a.chunks, cc), c1 = chunk_begin(n, a.chunks, cc + 1);
        if (d != from.self && lo < hi && c0 < c1 && c0 < hi && c1 > lo &&
            wait_progress(from, d, cc, min(hi, c1) - c0) < 0)
          ok = false;
      }
      if (!__all_sync(0xffffffffu, ok)) {  // reported; the item's tokens stay unwritten
        t1 = t0;
        continue;
      }
      for (int p = lane; p < (t1 - t0) * R; p += kWarp) {
        const int q = p / R, d = p % R, t = t0 + q;
        int row = -1;
        if (a.mask[t * R + d]) {
          const int j = a.excl[t * R + d];
          if (d != from.self)
            row = j;
          else if (own_offset + j < a.capacity)
            row = own_offset + j;  // else: dropped by the dispatch
        }
        table[q][d] = row;
      }
      __syncwarp();
    }
    const int row = lane < R ? table[i][lane] : -1;
    const unsigned present = __ballot_sync(0xffffffffu, row >= 0);
    const uint32_t offset = uint32_t(g) * b.segment_bytes;
    const uint32_t bytes = uint32_t(min(int64_t(b.segment_bytes), rb - offset));
    if (lane == 0) {
      job_of[st] = CombineJob{t0 + i, __popc(present), offset, bytes};
      barrier_arrive_expect(full + st, uint32_t(__popc(present)) * bytes);
    }
    __syncwarp();
    if (row >= 0)
      bulk_load(smem + b.tables_bytes + size_t(st) * b.stage_bytes +
                    size_t(__popc(present & ((1u << lane) - 1))) * b.segment_bytes,
                source + int64_t(row) * rb + offset, bytes, full + st);
    if (++g == segs) {
      g = 0;
      ++i;
    }
    return true;
  };
  int issued = 0;
  while (issued < per && next_job(warp * per + issued)) ++issued;
  for (int k = 0; k < issued; ++k) {
    const int st = warp * per + k % per;
    barrier_wait(full + st, uint32_t(k / per) & 1u);
    const CombineJob job = job_of[st];
    int4* dst = reinterpret_cast<int4*>(a.out + int64_t(job.token) * rb + job.offset);
    const uint32_t slots = shared_address(smem + b.tables_bytes + size_t(st) * b.stage_bytes);
    const auto from_stage = [&](int j, int64_t v) {
      int4 x;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                   : "r"(slots + uint32_t(j) * b.segment_bytes + uint32_t(v) * 16u));
      return x;
    };
    const int64_t vectors = job.bytes / 16;
    for (int64_t v = lane; v < vectors; v += kUnroll * kWarp) sum_vectors<T>(dst, job.rows, v, vectors, from_stage);
    // Our reads of the stage come before the next bulk load into it (another proxy).
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (next_job(st)) ++issued;
  }
}

void check_fits(const NvlDevice& dev, size_t message, const char* op) {
  if (message > dev.region_bytes())
    throw std::invalid_argument(
        std::string("uccl_ep ") + op + ": a message of this shape needs " + std::to_string(message) +
        " bytes per peer but the NVLink buffer holds " + std::to_string(dev.region_bytes()) +
        "; initialize with buffer_bytes >= " + std::to_string(NvlDevice::buffer_bytes_for(dev.num_ranks(), message)) +
        " (jax_uccl_ep.nvl_buffer_bytes gives it for your shapes)");
}

// Flags to wait for on the GPU, each with the deadline: a thread polls each, so a dead peer is reported by
// check_errors() after UCCL_EP_TIMEOUT_S instead of holding the stream forever.
struct FlagWaits {
  const uint64_t* flag[kMaxRanks];
  uint64_t value[kMaxRanks];
  int peer[kMaxRanks];
  int n;
};
// Thread i waits for flag i; returns (to the whole block) whether every wait succeeded.
__device__ bool wait_all(const FlagWaits& w, uint64_t timeout_ns, DeviceErrors* err, int rank) {
  return block_waits(w.n, [&](int i) {
    return wait_flag(w.flag[i], w.value[i], int64_t(w.value[i]), timeout_ns, err, rank, w.peer[i]);
  });
}
__global__ void wait_flags_kernel(FlagWaits w, uint64_t timeout_ns, DeviceErrors* err, int rank) {
  wait_all(w, timeout_ns, err, rank);
}

// Our reads and writes of shared memory come before bulk loads into it (another proxy).
__device__ __forceinline__ void fence_shared_for_bulk() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// An op on the NVLink buffers runs as one launch on XLA's stream: blocks [0, chunks) send, the rest receive. So
// nothing hops between streams, and no launch waits for another's between the routing's arrival and the copies.
// The receive blocks first build the tables their copies read (dispatch: the routing scan over every member's
// routing; combine: our tokens' positions in the members' messages), in units they hand over to each other.
struct DispatchLaunch {
  DispatchSendArgs send;
  ScanArgs scan;
  DispatchReceiveArgs receive;
  BulkShape send_shape, receive_shape;  // with bulk copies
  FlagWaits routing;                    // every member's routing has landed
  Handoff handoff;                      // words: the copies' item counter, then [2 passes][units * R]
  int run;                              // the scan's tokens per thread: 1, 2, 4 or kMaxScanRun (scan_run)
  int units;                            // scan units per source, of kTransferThreads * run tokens
};

// The receive blocks' scan passes over the units u = block, block + blocks, ... of every source, with kRun tokens
// per thread.
template <int kRun>
__device__ void scan_pass_run(const DispatchLaunch& f, int block, int blocks, bool place) {
  for (int u = block; u < f.units * f.scan.num_ranks; u += blocks)
    if (place)
      place_unit<kRun>(f.scan, u % f.units, u / f.units, f.units);
    else
      count_unit<kRun>(f.scan, u % f.units, u / f.units, f.units);
}
__device__ void scan_pass(const DispatchLaunch& f, int block, int blocks, bool place) {
  switch (f.run) {
    case 1:
      return scan_pass_run<1>(f, block, blocks, place);
    case 2:
      return scan_pass_run<2>(f, block, blocks, place);
    case 4:
      return scan_pass_run<4>(f, block, blocks, place);
    default:
      return scan_pass_run<kMaxScanRun>(f, block, blocks, place);
  }
}

// (Cached) dispatch: the send blocks as dispatch_send(_bulk); each receive block waits for every member's routing,
// counts the rows of its scan units, places them once every unit is counted, and copies once every unit is placed. With
// bulk copies a send block whose sends are done joins the copies (the items come from one counter of the launch), so
// that neither side idles while the other still works.
template <bool kBulk>
__global__ void __launch_bounds__(kTransferThreads, 1) dispatch_kernel(DispatchLaunch f) {
  const int send_blocks = f.send.chunks;
  const Members& m = f.receive.from;
  const int units = f.units * f.scan.num_ranks;
  const ItemCounter items{f.handoff.words};
  uint64_t* counted = f.handoff.words + 1;
  uint64_t* placed = counted + units;
  if (int(blockIdx.x) < send_blocks) {
    if constexpr (kBulk) {
      dispatch_send_bulk(f.send, f.send_shape, blockIdx.x, send_blocks);
      __syncthreads();  // every stage has been read (the rings end with their stores complete)
      fence_shared_for_bulk();
      if (wait_handed_over(f.handoff, placed, units, m))
        dispatch_receive_bulk(f.receive, f.receive_shape, items, 0, 1, /*joined=*/true);
    } else {
      dispatch_send(f.send, blockIdx.x, send_blocks);
    }
    return;
  }
  const int block = int(blockIdx.x) - send_blocks, blocks = int(gridDim.x) - send_blocks;
  {
    const KernelStamp stamp(KernelKind::kScan);
    // A member whose routing never came is reported; the scan still runs (over what its region holds: every read
    // and write stays in bounds), so that every unit is handed over and no block waits for another in vain.
    wait_all(f.routing, m.timeout_ns, m.err, m.rank);
    scan_pass(f, block, blocks, /*place=*/false);
    if (block == 0 && threadIdx.x == 0) items.reset();  // before the copies' first take (they wait for `counted`)
    hand_over(f.handoff, counted, block, blocks, units);
    if (!wait_handed_over(f.handoff, counted, units, m)) return;
    scan_pass(f, block, blocks, /*place=*/true);
    hand_over(f.handoff, placed, block, blocks, units);
    if (!wait_handed_over(f.handoff, placed, units, m)) return;
    fence_shared_for_bulk();
  }
  if constexpr (kBulk)
    dispatch_receive_bulk(f.receive, f.receive_shape, items, block, blocks, /*joined=*/false);
  else
    dispatch_receive(f.receive, block, blocks);
}

struct CombineLaunch {
  CombineSendArgs send;
  CombineReceiveArgs receive;
  BulkShape send_shape, receive_shape;  // with bulk copies
  Handoff handoff;                      // words: the reductions' item counter, then the positions'
};

// Combine: the send blocks as combine_send(_bulk); the first receive block lays out our tokens' positions in the
// members' messages (block_positions) while the others wait for them, then every receive block reduces, and with
// bulk copies every send block too once its sends are done (the items come from one counter of the launch).
template <typename T, bool kBulk>
__global__ void __launch_bounds__(kTransferThreads, 1) combine_kernel(CombineLaunch f) {
  const int send_blocks = f.send.chunks;
  const CombineReceiveArgs& a = f.receive;
  const ItemCounter items{f.handoff.words};
  uint64_t* positioned = f.handoff.words + 1;
  if (int(blockIdx.x) < send_blocks) {
    if constexpr (kBulk) {
      combine_send_bulk(f.send, f.send_shape, blockIdx.x, send_blocks);
      __syncthreads();  // every stage has been read (the rings end with their stores complete)
      fence_shared_for_bulk();
      if (wait_handed_over(f.handoff, positioned, 1, a.from)) combine_receive_bulk<T>(a, f.receive_shape, items);
    } else {
      combine_send(f.send, blockIdx.x, send_blocks);
    }
    return;
  }
  const int block = int(blockIdx.x) - send_blocks, blocks = int(gridDim.x) - send_blocks;
  {
    const KernelStamp stamp(KernelKind::kScan);
    if (block == 0) {
      block_positions(a.mask, a.num_tokens, a.from.num_ranks, a.excl);
      if (threadIdx.x == 0) items.reset();  // before the reductions' first take (they wait for `positioned`)
      hand_over(f.handoff, positioned, 0, 1, 1);
    }
    if (!wait_handed_over(f.handoff, positioned, 1, a.from)) return;
  }
  if constexpr (kBulk)
    combine_receive_bulk<T>(a, f.receive_shape, items);
  else
    combine_receive<T>(a, block, blocks);
}

Members members(const NvlDevice& dev, const Group& g) {
  Members m{};
  m.num_ranks = g.size;
  m.self = g.self;
  m.rank = dev.rank();
  m.timeout_ns = timeout_ns();
  m.err = dev.errors_device();
  for (int s = 0; s < g.size; ++s) m.rank_of[s] = s == g.self ? dev.rank() : peer_of(dev, g, s);
  return m;
}

// One message to every other member (its number, and where it goes) and one from each.
SendTo send_to(NvlDevice& dev, const Group& g) {
  SendTo to{};
  static_cast<Members&>(to) = members(dev, g);
  for (int s = 0; s < g.size; ++s) {
    if (s == g.self) continue;
    const int p = to.rank_of[s];
    to.region[s] = dev.peer_in_region(p);
    to.meta[s] = dev.peer_meta_flag(p);
    to.chunks[s] = dev.peer_chunk_flags(p);
    to.ack[s] = dev.ack_flag(p);
    to.message[s] = ++dev.sent(p);
  }
  return to;
}
ReceiveFrom receive_from(NvlDevice& dev, const Group& g) {
  ReceiveFrom from{};
  static_cast<Members&>(from) = members(dev, g);
  for (int s = 0; s < g.size; ++s) {
    if (s == g.self) continue;
    const int p = from.rank_of[s];
    from.region[s] = dev.in_region(p);
    from.chunks[s] = dev.chunk_flags(p);
    from.message[s] = ++dev.received(p);
  }
  return from;
}

// Tells every member we finished reading its message (after the op's launch).
void acknowledge(NvlDevice& dev, const Group& g, const ReceiveFrom& from, cudaStream_t stream) {
  for (int s = 0; s < g.size; ++s)
    if (s != g.self) stream_write_value(stream, dev.peer_ack_flag(from.rank_of[s]), from.message[s]);
}

// The SM budget is split between the send blocks, a block per chunk of the message (every process must use the same
// split: the receivers count chunks; initialize() checks it), and the receive blocks. Receive sides move more than
// send sides (dispatch: every received row, own ones too; combine: every copy of a token, then its sum), so the
// SM-store kernels send with a third of the budget by default; with bulk copies a send block joins the receive side
// once its rows have left, and half of the budget sends (in the loopback at 24 SMs a half beat a third by 2-15% with
// bulk copies and lost by 8-51% with SM stores, bench/RESULTS.md). UCCL_EP_NVL_BULK is the same in every process.
int send_blocks() {
  const int wanted = num_send_sms() > 0 ? num_send_sms() : num_sms() / (bulk_copies() ? 2 : 3);
  return std::clamp(wanted, 1, std::min(kChunks, num_sms() - 1));
}
int receive_blocks() { return std::max(1, num_sms() - send_blocks()); }
// The fused scan's tokens per thread: the fewest (1, 2, 4 or kMaxScanRun) with which every source's units go to the
// receive blocks in one round, since a round is a few trips to a memory that the copies keep busy.
int scan_run(int num_tokens, int num_ranks) {
  int run = 1;
  while (run < kMaxScanRun && num_ranks * scan_units(num_tokens, kTransferThreads * run) > receive_blocks()) run *= 2;
  return run;
}

// Shared memory of the bulk-copy kernels (kernels/nvl/bulk.cuh). Stages of at most a row segment each for the row
// copies, larger ones for contiguous pieces; the combine receiver's stage holds a segment of each member's copy.
uint32_t align_down(uint64_t n, uint32_t to) { return uint32_t(n / to * to); }
BulkTuning g_tuning{};
// A stage is refilled one job behind its stores, so each issuing thread keeps stages - 1 loads in flight (with 2
// behind, one: the loopback's send kernels copied ~20% slower, bench/RESULTS.md).
int ring_lag() { return g_tuning.lag > 0 ? g_tuning.lag : 1; }
int stages_per_producer() {
  return std::max(g_tuning.stages_per_producer > 0 ? g_tuning.stages_per_producer : 3, ring_lag() + 1);
}
// The dispatch sender's rings: kMaxProducers issuing threads where each still gets its stages of a whole row (FP8
// rows of 7 KiB: a thread's own work per row bounds that sender, bench/RESULTS.md), else kProducers.
BulkShape row_stages(int64_t row_bytes, uint32_t tables_bytes) {
  BulkShape b{};
  b.tables_bytes = tables_bytes;
  b.lag = ring_lag();
  const uint32_t room = kBulkSharedBytes - tables_bytes;
  const auto most = [&](int producers) { return room / uint32_t(producers * stages_per_producer()) - 128; };
  b.producers = g_tuning.send_producers > 0        ? g_tuning.send_producers
                : most(kMaxProducers) >= row_bytes ? kMaxProducers
                                                   : kProducers;
  b.segment_bytes = uint32_t(std::min<int64_t>(row_bytes, align_down(most(b.producers), 16)));
  // Small rows go several a job: a job's own work costs its issuing thread about the same whatever the rows' size
  // (the SM's copies themselves keep their rate down to 3.5 KiB), and with token slots consecutive tokens' rows are
  // consecutive in x and in every message.
  const int fit = int(std::min<int64_t>(kMaxRowsPerJob, most(b.producers) / row_bytes));
  b.rows_per_job = std::max(1, g_tuning.send_rows > 0 ? std::min(g_tuning.send_rows, fit) : fit);
  b.stage_bytes = (b.segment_bytes * uint32_t(b.rows_per_job) + 127) / 128 * 128;
  b.stages = int(std::min<uint32_t>(kMaxStages, room / b.stage_bytes)) / b.producers * b.producers;  // each its own
  return b;
}
BulkShape piece_stages(int64_t row_bytes, int64_t tail_bytes, int stages) {
  BulkShape b{};
  b.lag = ring_lag();
  b.producers = kProducers;
  b.stage_bytes = align_down(kBulkSharedBytes / uint32_t(stages), 128);
  b.segment_bytes = uint32_t(std::min<int64_t>(row_bytes, align_down(b.stage_bytes - uint32_t(tail_bytes), 16)));
  b.stages = stages;
  return b;
}
BulkShape piece_stages(int64_t row_bytes, int64_t tail_bytes) {
  return piece_stages(row_bytes, tail_bytes, kProducers * stages_per_producer());
}
// The combine receiver: `per` stages for each of its warps, each stage a slot per member's copy of a row segment
// (segments of a row made even). Two stages let a warp sum one while the other loads, but halve the copies: in the
// loopback two won at 2 members (~2.9 KiB copies), one at 4 and 8 (copies of 1.6 KiB rather than 800 B: -10% at 8).
BulkShape combine_receive_stages(int64_t row_bytes, int num_ranks) {
  constexpr uint32_t kLeastCopyBytes = 2048;
  int per = kBulkSharedBytes / (2 * kTransferWarps) / uint32_t(num_ranks) >= kLeastCopyBytes ? 2 : 1;
  if (g_tuning.combine_stages > 0) per = g_tuning.combine_stages;
  BulkShape b = piece_stages(row_bytes, 0, per * kTransferWarps);
  const int64_t most = align_down(b.stage_bytes / uint32_t(num_ranks), 16);
  const int64_t segs = (row_bytes + most - 1) / most;
  b.segment_bytes = uint32_t(std::min<int64_t>(most, (row_bytes / segs + 15) / 16 * 16));
  return b;
}

// Bulk copies move 16-byte aligned runs of 16-byte multiples: rows that are not take the SM-store kernels.
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool bulk_dispatch(const DispatchSendArgs& s, const DispatchReceiveArgs& r) {
  return bulk_copies() && s.x_row_bytes % 16 == 0 && aligned16(s.x) && aligned16(r.recv_x) &&
         (!s.scales || (s.scale_row_bytes % 16 == 0 && aligned16(s.scales) && aligned16(r.recv_scales)));
}
bool bulk_combine(const CombineSendArgs& s, const CombineReceiveArgs& r) {
  return bulk_copies() && s.row_bytes % 16 == 0 && aligned16(s.y) && aligned16(r.out);
}

// The proxy path's send kernel (before its receive side, on the same stream).
template <class Args>
void launch_send(void (*kernel)(Args), const Args& a, cudaStream_t stream) {
  kernel<<<send_blocks(), kTransferThreads, 0, stream>>>(a);
  check(cudaGetLastError(), "send kernel");
}

// An NVLink op's launch (see DispatchLaunch): the budget's blocks, one per SM, all resident at once.
bool g_allow_budget_past_the_gpu = false;  // testing.hpp
void check_budget_fits(const NvlDevice& dev, const char* op) {
  const int sms = dev.sm_count();
  if (num_sms() > sms && !g_allow_budget_past_the_gpu)
    throw std::invalid_argument(
        std::string("uccl_ep ") + op + ": the SM budget (UCCL_EP_NUM_SMS=" + std::to_string(num_sms()) +
        ") is more than this GPU's " + std::to_string(sms) +
        " SMs; its send and receive blocks run at once, one per SM: set UCCL_EP_NUM_SMS <= " + std::to_string(sms));
}
template <class Launch>
void launch_fused(void (*kernel)(Launch), const Launch& f, uint32_t shared_bytes, cudaStream_t stream,
                  const char* what) {
  kernel<<<num_sms(), kTransferThreads, shared_bytes, stream>>>(f);
  check(cudaGetLastError(), what);
}

// Every member's routing has landed: one announcement per chunk and message.
FlagWaits routing_waits(NvlDevice& dev, const Group& g, const ReceiveFrom& from) {
  FlagWaits w{};
  for (int s = 0; s < g.size; ++s)
    if (s != g.self) {
      const int p = from.rank_of[s];
      w.flag[w.n] = dev.meta_flag(p);
      w.value[w.n] = from.message[s] * uint64_t(send_blocks());
      w.peer[w.n++] = p;
    }
  return w;
}

struct DispatchLayoutBytes {
  size_t x, scales, idx, weights, total;
};
DispatchLayoutBytes dispatch_layout(int num_tokens, int64_t x_row_bytes, int64_t scale_row_bytes, int topk,
                                    bool weights) {
  DispatchLayoutBytes l;
  l.x = 0;
  l.scales = l.x + align16(size_t(num_tokens) * x_row_bytes);
  l.idx = l.scales + align16(size_t(num_tokens) * scale_row_bytes);
  l.weights = l.idx + align16(size_t(num_tokens) * topk * 4);
  l.total = l.weights + (weights ? align16(size_t(num_tokens) * topk * 4) : 0);
  return l;
}
// A cached dispatch's message: the rows, then the token-in-rank mask [T, R].
size_t cached_mask_offset(int num_tokens, int64_t row_bytes) { return align16(size_t(num_tokens) * row_bytes); }
size_t cached_message_bytes(int num_tokens, int64_t row_bytes, int num_ranks) {
  return cached_mask_offset(num_tokens, row_bytes) + align16(size_t(num_tokens) * num_ranks);
}

// A (cached) dispatch's kernels, given where its messages go (`to`) and come from (`from`): the NVLink buffers of
// the members, or regions of the proxy's buffer.
struct DispatchKernels {
  DispatchSendArgs send;
  ScanArgs scan;
  DispatchReceiveArgs receive;
};
DispatchKernels dispatch_kernels(const DispatchArgs& a, const Group& g, const DispatchLayoutBytes& l,
                                 const Scratch& scratch, const SendTo& to, const ReceiveFrom& from) {
  DispatchKernels k{};
  k.send = DispatchSendArgs{to,
                            send_blocks(),
                            a.num_tokens,
                            a.topk_idx,
                            a.topk,
                            a.num_experts,
                            nullptr,
                            a.is_token_in_rank,
                            scratch.excl,
                            {},
                            static_cast<const char*>(a.x),
                            a.x_row_bytes,
                            l.x,
                            static_cast<const char*>(a.scales),
                            a.scale_row_bytes,
                            l.scales,
                            {}};
  k.send.routing[0] = {reinterpret_cast<const char*>(a.topk_idx), l.idx, int64_t(a.topk) * 4};
  k.send.routing[1] = {reinterpret_cast<const char*>(a.topk_weights), l.weights, int64_t(a.topk) * 4};
  Sources src{};
  for (int s = 0; s < g.size; ++s) {
    const char* base = from.region[s];
    const bool own = s == g.self;
    src.topk_idx[s] = own ? a.topk_idx : reinterpret_cast<const int32_t*>(base + l.idx);
    src.x[s] = own ? static_cast<const char*>(a.x) : base + l.x;
    src.scales[s] = own ? static_cast<const char*>(a.scales) : base + l.scales;
    src.weights[s] = own ? a.topk_weights : reinterpret_cast<const float*>(base + l.weights);
  }
  k.scan = ScanArgs{src,
                    true,
                    a.num_tokens,
                    a.topk,
                    a.num_experts,
                    g.size,
                    g.self,
                    from.rank,
                    a.capacity,
                    scratch.row_map,
                    a.recv_counts,
                    a.recv_num_tokens,
                    a.num_tokens_per_expert,
                    nullptr,
                    scratch.block_counts,
                    from.err,
                    scratch.row_before,
                    a.overflow == Overflow::kDrop,
                    nullptr,
                    {}};
  // Under Overflow::kError a member that may receive more rows than the capacity (each member sends at most its T
  // tokens) is checked by every member, so the overflow reaches every process's check_errors().
  if (a.overflow == Overflow::kError && int64_t(g.size) * a.num_tokens > a.capacity) {
    k.scan.receiver_counts = scratch.receiver_counts;
    for (int s = 0; s < g.size; ++s) k.scan.rank_of[s] = from.rank_of[s];
  }
  k.receive = DispatchReceiveArgs{from,
                                  src,
                                  true,
                                  send_blocks(),
                                  a.topk,
                                  a.num_experts,
                                  a.num_tokens,
                                  a.capacity,
                                  scratch.row_map,
                                  a.recv_counts,
                                  a.recv_num_tokens,
                                  a.x_row_bytes,
                                  a.scale_row_bytes,
                                  static_cast<char*>(a.recv_x),
                                  static_cast<char*>(a.recv_scales),
                                  a.recv_topk_idx,
                                  a.recv_topk_weights,
                                  scratch.row_before,
                                  a.num_tokens_per_expert,
                                  false};
  return k;
}
DispatchKernels cached_dispatch_kernels(const CachedDispatchArgs& a, const Group& g, const Scratch& scratch,
                                        const SendTo& to, const ReceiveFrom& from) {
  const size_t mask_at = cached_mask_offset(a.num_tokens, a.row_bytes);
  DispatchKernels k{};
  k.send = DispatchSendArgs{to,
                            send_blocks(),
                            a.num_tokens,
                            nullptr,
                            0,
                            0,
                            a.is_token_in_rank,
                            nullptr,
                            scratch.excl,
                            {},
                            static_cast<const char*>(a.x),
                            a.row_bytes,
                            0,
                            nullptr,
                            0,
                            0,
                            {}};
  k.send.routing[0] = {reinterpret_cast<const char*>(a.is_token_in_rank), mask_at, int64_t(g.size)};
  Sources src{};
  for (int s = 0; s < g.size; ++s) {
    const bool own = s == g.self;
    src.mask[s] = own ? a.is_token_in_rank : reinterpret_cast<const bool*>(from.region[s] + mask_at);
    src.x[s] = own ? static_cast<const char*>(a.x) : from.region[s];
  }
  // The counts land in scratch: the scan checks them against the handle's.
  k.scan = ScanArgs{src,
                    false,
                    a.num_tokens,
                    0,
                    0,
                    g.size,
                    g.self,
                    from.rank,
                    a.capacity,
                    scratch.row_map,
                    scratch.counts,
                    scratch.num_rows,
                    nullptr,
                    a.recv_counts,
                    scratch.block_counts,
                    from.err,
                    scratch.row_before,
                    a.overflow == Overflow::kDrop,
                    nullptr,
                    {}};
  k.receive = DispatchReceiveArgs{from,
                                  src,
                                  false,
                                  send_blocks(),
                                  0,
                                  0,
                                  a.num_tokens,
                                  a.capacity,
                                  scratch.row_map,
                                  scratch.counts,
                                  scratch.num_rows,
                                  a.row_bytes,
                                  0,
                                  static_cast<char*>(a.recv_x),
                                  nullptr,
                                  nullptr,
                                  nullptr,
                                  scratch.row_before,
                                  nullptr,
                                  false};
  return k;
}
// The proxy path's receive side once the routing is in: the scan, then the rows.
void launch_dispatch_receive(const DispatchKernels& k, cudaStream_t stream) {
  run_scan(k.scan, stream);
  dispatch_receive_kernel<<<receive_blocks(), kTransferThreads, 0, stream>>>(k.receive);
  check(cudaGetLastError(), "dispatch_receive_kernel");
}
// The NVLink op: its one launch, then the acknowledgements.
void launch_dispatch(NvlDevice& dev, const Group& g, const DispatchKernels& k, cudaStream_t stream) {
  DispatchLaunch f{};
  f.send = k.send;
  f.scan = k.scan;
  f.receive = k.receive;
  f.routing = routing_waits(dev, g, k.receive.from);
  f.run = scan_run(k.scan.num_tokens, k.scan.num_ranks);
  f.units = scan_units(k.scan.num_tokens, kTransferThreads * f.run);
  const size_t scan_words = size_t(2) * f.units * k.scan.num_ranks + 1;
  f.handoff = Handoff{dev.handoff_words(scan_words), dev.next_launch()};
  f.send.token_slots = f.receive.token_slots = true;
  uint32_t shared = 0;
  if (bulk_dispatch(k.send, k.receive)) {
    f.send_shape = row_stages(k.send.x_row_bytes, kSendTablesBytes);
    f.receive_shape = piece_stages(k.receive.x_row_bytes, k.receive.recv_scales ? k.receive.scale_row_bytes : 0);
    shared = std::max(f.send_shape.shared_bytes(), f.receive_shape.shared_bytes());
    launch_fused(dispatch_kernel<true>, f, shared, stream, "dispatch_kernel");
  } else {
    launch_fused(dispatch_kernel<false>, f, shared, stream, "dispatch_kernel");
  }
  acknowledge(dev, g, k.receive.from, stream);
}

struct CombineKernels {
  CombineSendArgs send;
  CombineReceiveArgs receive;
};
CombineKernels combine_kernels(const CombineArgs& a, const Scratch& scratch, const SendTo& to,
                               const ReceiveFrom& from) {
  const int64_t row_bytes = int64_t(a.hidden) * float_bytes(a.dtype);
  return {CombineSendArgs{to, send_blocks(), static_cast<const char*>(a.y), row_bytes, a.capacity, a.recv_counts,
                          a.overflow == Overflow::kDrop},
          CombineReceiveArgs{from, send_blocks(), static_cast<const char*>(a.y), row_bytes, a.capacity, a.num_tokens,
                             a.recv_counts, a.is_token_in_rank, scratch.excl, static_cast<char*>(a.out)}};
}
void launch_positions(const CombineArgs& a, int num_ranks, const Scratch& scratch, cudaStream_t stream) {
  positions_kernel<<<1, kScanThreads, 0, stream>>>(a.is_token_in_rank, a.num_tokens, num_ranks, scratch.excl);
  check(cudaGetLastError(), "positions_kernel");
}
void launch_combine_receive(const CombineReceiveArgs& ra, bool bf16, cudaStream_t stream) {
  if (bf16)
    combine_receive_kernel<__nv_bfloat16><<<receive_blocks(), kTransferThreads, 0, stream>>>(ra);
  else
    combine_receive_kernel<float><<<receive_blocks(), kTransferThreads, 0, stream>>>(ra);
  check(cudaGetLastError(), "combine_receive_kernel");
}
void launch_combine(NvlDevice& dev, const Group& g, const CombineKernels& k, bool bf16, cudaStream_t stream) {
  CombineLaunch f{};
  f.send = k.send;
  f.receive = k.receive;
  f.handoff = Handoff{dev.handoff_words(2), dev.next_launch()};
  uint32_t shared = 0;
  if (bulk_combine(k.send, k.receive)) {
    f.send_shape = piece_stages(k.send.row_bytes, 0);
    f.receive_shape = combine_receive_stages(k.receive.row_bytes, k.receive.from.num_ranks);
    shared = std::max(f.send_shape.shared_bytes(), f.receive_shape.shared_bytes());
    launch_fused(bf16 ? combine_kernel<__nv_bfloat16, true> : combine_kernel<float, true>, f, shared, stream,
                 "combine_kernel");
  } else {
    launch_fused(bf16 ? combine_kernel<__nv_bfloat16, false> : combine_kernel<float, false>, f, shared, stream,
                 "combine_kernel");
  }
  acknowledge(dev, g, k.receive.from, stream);
}

// ---- Across nodes: the proxy runtime's registered buffer in place of the NVLink peers (see api.hpp) ----

Members proxy_members(const ProxyHalf& half) {
  const Group& g = half.group();
  Members m{};
  m.num_ranks = g.size;
  m.self = g.self;
  m.rank = int(half.dev().rank());
  m.timeout_ns = timeout_ns();
  m.err = half.errors();
  for (int s = 0; s < g.size; ++s) m.rank_of[s] = g.ranks[s];
  return m;
}
// Member s's rows go to our send region for it (the push kernel sends them on); the progress words, of no use
// here (ProxyGpu), go to the sink, and no acknowledgement is awaited in the send kernel (the push kernel waits).
SendTo proxy_send_to(const ProxyHalf& half) {
  SendTo to{};
  static_cast<Members&>(to) = proxy_members(half);
  for (int s = 0; s < to.num_ranks; ++s) {
    if (s == to.self) continue;
    to.region[s] = half.buffer() + half.dev().send_offset(uint32_t(to.rank_of[s]));
    to.meta[s] = half.gpu().sink;
    to.chunks[s] = half.gpu().sink + 1;
    to.ack[s] = half.gpu().landed;  // >= 0 = message - 1
    to.message[s] = 1;
  }
  return to;
}
ReceiveFrom proxy_receive_from(const ProxyHalf& half) {
  ReceiveFrom from{};
  static_cast<Members&>(from) = proxy_members(half);
  for (int s = 0; s < from.num_ranks; ++s) {
    if (s == from.self) continue;
    from.region[s] = half.buffer() + half.dev().recv_offset(uint32_t(from.rank_of[s]));
    from.chunks[s] = half.gpu().landed;
    from.message[s] = 1;
  }
  return from;
}

// What the push kernel sends each member: pieces of our send region for it, piece i at offset[i] of
// fixed[i] + per_row[i] bytes per row the member gets (dispatch: from the send kernel's layout; combine: the rows
// it sent us).
struct MessagePieces {
  ProxyOut out;
  int num_ranks, rank, num_tokens, num_pieces;
  const int32_t* excl;    // dispatch: [T, R] the send kernel's layout
  const bool* mask;       // dispatch: [T, R]
  const int32_t* counts;  // combine: [R]
  uint64_t offset[4], fixed[4], per_row[4];
  DeviceErrors* err;
};
void add_piece(MessagePieces& m, size_t offset, size_t fixed, int64_t per_row) {
  m.offset[m.num_pieces] = offset;
  m.fixed[m.num_pieces] = fixed;
  m.per_row[m.num_pieces++] = uint64_t(per_row);
}
__global__ void push_messages_kernel(MessagePieces m) {
  const auto rows_to = [&](int d) -> uint64_t {
    if (m.counts) return uint64_t(max(m.counts[d], 0));
    if (m.num_tokens == 0) return 0;
    const int last = (m.num_tokens - 1) * m.num_ranks + d;  // rows before the last token, and its own
    return uint64_t(m.excl[last] + int(m.mask[last]));
  };
  push_messages(m.out, m.num_ranks, m.rank, m.err, [&](int d, int i, uint64_t& begin, uint64_t& bytes) {
    if (i >= m.num_pieces) return false;
    begin = m.offset[i];
    bytes = m.fixed[i] + rows_to(d) * m.per_row[i];
    return true;
  });
}

// Refusals before anything is sent: a message of `bytes` in `pieces` pieces to each member must fit a region of
// the proxy's buffer and a message's writes.
void check_proxy_message(const uccl_ep::Device& dev, const Group& g, size_t bytes, int pieces, const char* op) {
  if (g.size > kMaxRanks)
    throw std::invalid_argument(std::string("uccl_ep ") + op + ": GPU-initiated normal mode takes groups of at most " +
                                std::to_string(kMaxRanks) + " ranks, got " + std::to_string(g.size));
  if (bytes > dev.region_bytes()) {
    const size_t page = 4096, region = (bytes + page - 1) / page * page;
    throw std::invalid_argument(std::string("uccl_ep ") + op + ": a message of this shape needs " +
                                std::to_string(bytes) + " bytes per peer but a region of the proxy's buffer holds " +
                                std::to_string(dev.region_bytes()) + "; raise UCCL_EP_BUFFER_BYTES to at least " +
                                std::to_string(kScratchBytes + 2 * size_t(dev.num_ranks()) * region));
  }
  if (!fits_writes(dev, pieces, int64_t(bytes)))
    throw std::invalid_argument(
        std::string("uccl_ep ") + op +
        ": UCCL_EP_MAX_WRITE_BYTES is too small for these rows (a message may hold 2047 writes)");
}

// The ops' device scratch on the proxy path, grown as needed (every proxy op waits for its kernels, so none runs).
Scratch proxy_scratch(ProxyGpu& gpu, int capacity, int num_tokens) {
  const size_t bytes = scratch_bytes(capacity, num_tokens);
  if (bytes > gpu.scratch_bytes) {
    if (gpu.scratch) cudaFree(gpu.scratch);
    gpu.scratch = nullptr;
    gpu.scratch_bytes = 0;
    check(cudaMalloc(&gpu.scratch, bytes), "cudaMalloc scratch");
    gpu.scratch_bytes = bytes;
  }
  return scratch_at(gpu.scratch, capacity, num_tokens);
}

// One op on the proxy path: the send kernel and the push on XLA's stream (ProxyHalf::send waits for them), then
// each member's message, and `receive` on it (ProxyHalf::receive acknowledges every member).
template <class Send, class Receive>
void run_over_proxy(ProxyHalf& half, MessagePieces m, cudaStream_t stream, Send&& send, Receive&& receive) {
  half.send(ProxyOp::kNormal, [&] {
    send();
    m.out = half.proxy_out();
    m.num_ranks = half.group().size;
    m.rank = int(half.dev().rank());
    m.err = half.errors();
    push_messages_kernel<<<1, kWarp, 0, stream>>>(m);
    check(cudaGetLastError(), "push_messages_kernel");
  });
  half.receive(ProxyOp::kNormal, [&] {
    uccl_ep::Device& dev = half.dev();
    const Group& g = half.group();
    FlagWaits w{};
    for (int s = 0; s < g.size; ++s) {
      if (s == g.self) continue;
      const uint32_t peer = uint32_t(g.ranks[s]);
      w.flag[w.n] = device_view(dev.released_word(peer, 0));
      w.value[w.n] = dev.consumed(peer, 0) + 1;
      w.peer[w.n++] = int(peer);
    }
    if (w.n) wait_flags_kernel<<<1, kWarp, 0, stream>>>(w, timeout_ns(), half.errors(), int(dev.rank()));
    check(cudaGetLastError(), "wait_flags_kernel");
    receive();
  });
}

}  // namespace

int normal_send_blocks() { return send_blocks(); }

void set_kernel_stamps(int cuda_device, uint64_t* stamps, bool sides_apart) {
  check(cudaSetDevice(cuda_device), "cudaSetDevice");
  check(cudaMemcpyToSymbol(g_kernel_stamps, &stamps, sizeof(stamps)), "cudaMemcpyToSymbol");
  sides_apart = sides_apart && stamps;
  check(cudaMemcpyToSymbol(g_sides_apart, &sides_apart, sizeof(sides_apart)), "cudaMemcpyToSymbol");
}

void allow_budget_past_the_gpu(bool allow) { g_allow_budget_past_the_gpu = allow; }

void set_bulk_tuning(const BulkTuning& tuning) {
  if (tuning.lag < 0 || tuning.lag > kMaxLag || tuning.stages_per_producer < 0 ||
      tuning.stages_per_producer * kProducers > kMaxStages || tuning.combine_stages < 0 ||
      tuning.combine_stages * kTransferWarps > kMaxStages ||
      (tuning.send_producers != 0 && tuning.send_producers != kProducers && tuning.send_producers != kMaxProducers) ||
      tuning.send_rows < 0 || tuning.send_rows > kMaxRowsPerJob)
    throw std::invalid_argument("set_bulk_tuning: lag 0 to " + std::to_string(kMaxLag) + ", stages_per_producer 0 to " +
                                std::to_string(kMaxStages / kProducers) + ", combine_stages 0 to " +
                                std::to_string(kMaxStages / kTransferWarps) + ", send_producers 0, " +
                                std::to_string(kProducers) + " or " + std::to_string(kMaxProducers) +
                                ", send_rows 0 to " + std::to_string(kMaxRowsPerJob));
  g_tuning = tuning;
}

size_t dispatch_message_bytes(int num_tokens, int64_t x_row_bytes, int64_t scale_row_bytes, int topk, bool weights) {
  return dispatch_layout(num_tokens, x_row_bytes, scale_row_bytes, topk, weights).total;
}

size_t combine_message_bytes(int num_tokens, int hidden, FloatType dtype) {
  return align16(size_t(num_tokens) * hidden * size_t(float_bytes(dtype)));
}

void dispatch(NvlDevice& dev, const Group& g, const DispatchArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  check_group(dev, g, "dispatch");
  check_budget_fits(dev, "dispatch");
  const auto l = dispatch_layout(a.num_tokens, a.x_row_bytes, a.scale_row_bytes, a.topk, a.topk_weights != nullptr);
  check_fits(dev, l.total, "dispatch");
  const Scratch scratch = op_scratch(dev, a.capacity, a.num_tokens);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  dev.timing_begin(stream);
  launch_dispatch(dev, g, dispatch_kernels(a, g, l, scratch, send_to(dev, g), receive_from(dev, g)), stream);
  dev.timing_end(stream, "dispatch");
}

void cached_dispatch(NvlDevice& dev, const Group& g, const CachedDispatchArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  check_group(dev, g, "cached_dispatch");
  check_budget_fits(dev, "cached_dispatch");
  check_fits(dev, cached_message_bytes(a.num_tokens, a.row_bytes, g.size), "cached_dispatch");
  const Scratch scratch = op_scratch(dev, a.capacity, a.num_tokens);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  launch_dispatch(dev, g, cached_dispatch_kernels(a, g, scratch, send_to(dev, g), receive_from(dev, g)), stream);
}

void combine(NvlDevice& dev, const Group& g, const CombineArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  check_group(dev, g, "combine");
  check_budget_fits(dev, "combine");
  check_fits(dev, combine_message_bytes(a.num_tokens, a.hidden, a.dtype), "combine");
  const Scratch scratch = op_scratch(dev, 0, a.num_tokens);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  dev.timing_begin(stream);
  launch_combine(dev, g, combine_kernels(a, scratch, send_to(dev, g), receive_from(dev, g)),
                 a.dtype == FloatType::kBF16, stream);
  dev.timing_end(stream, "combine");
}

void dispatch(uccl_ep::Device& dev, const Group& g, const DispatchArgs& a, cudaStream_t stream) {
  ProxyHalf half(dev, g, "dispatch", stream);
  const bool has_w = a.topk_weights != nullptr;
  const auto l = dispatch_layout(a.num_tokens, a.x_row_bytes, a.scale_row_bytes, a.topk, has_w);
  check_proxy_message(dev, g, l.total, 4, "dispatch");
  const Scratch scratch = proxy_scratch(half.gpu(), a.capacity, a.num_tokens);
  const DispatchKernels k = dispatch_kernels(a, g, l, scratch, proxy_send_to(half), proxy_receive_from(half));
  MessagePieces m{};
  m.num_tokens = a.num_tokens;
  m.excl = scratch.excl;
  m.mask = a.is_token_in_rank;
  add_piece(m, l.x, 0, a.x_row_bytes);
  add_piece(m, l.scales, 0, a.scale_row_bytes);
  add_piece(m, l.idx, size_t(a.num_tokens) * a.topk * 4, 0);
  if (has_w) add_piece(m, l.weights, size_t(a.num_tokens) * a.topk * 4, 0);
  run_over_proxy(
      half, m, stream, [&] { launch_send(dispatch_send_kernel, k.send, stream); },
      [&] { launch_dispatch_receive(k, stream); });
}

void cached_dispatch(uccl_ep::Device& dev, const Group& g, const CachedDispatchArgs& a, cudaStream_t stream) {
  ProxyHalf half(dev, g, "cached_dispatch", stream);
  check_proxy_message(dev, g, cached_message_bytes(a.num_tokens, a.row_bytes, g.size), 2, "cached_dispatch");
  const Scratch scratch = proxy_scratch(half.gpu(), a.capacity, a.num_tokens);
  const DispatchKernels k = cached_dispatch_kernels(a, g, scratch, proxy_send_to(half), proxy_receive_from(half));
  MessagePieces m{};
  m.num_tokens = a.num_tokens;
  m.excl = scratch.excl;
  m.mask = a.is_token_in_rank;
  add_piece(m, 0, 0, a.row_bytes);
  add_piece(m, cached_mask_offset(a.num_tokens, a.row_bytes), size_t(a.num_tokens) * g.size, 0);
  run_over_proxy(
      half, m, stream, [&] { launch_send(dispatch_send_kernel, k.send, stream); },
      [&] { launch_dispatch_receive(k, stream); });
}

void combine(uccl_ep::Device& dev, const Group& g, const CombineArgs& a, cudaStream_t stream) {
  ProxyHalf half(dev, g, "combine", stream);
  check_proxy_message(dev, g, combine_message_bytes(a.num_tokens, a.hidden, a.dtype), 1, "combine");
  const Scratch scratch = proxy_scratch(half.gpu(), 0, a.num_tokens);
  const CombineKernels k = combine_kernels(a, scratch, proxy_send_to(half), proxy_receive_from(half));
  MessagePieces m{};
  m.counts = a.recv_counts;
  add_piece(m, 0, 0, k.send.row_bytes);
  run_over_proxy(
      half, m, stream, [&] { launch_send(combine_send_kernel, k.send, stream); },
      [&] {
        launch_positions(a, g.size, scratch, stream);
        launch_combine_receive(k.receive, (a.dtype == FloatType::kBF16), stream);
      });
}

void preload_intranode_kernels() {
  load_kernels(positions_kernel, dispatch_count_kernel, dispatch_place_kernel, dispatch_send_kernel,
               dispatch_receive_kernel, combine_send_kernel, combine_receive_kernel<float>,
               combine_receive_kernel<__nv_bfloat16>, wait_flags_kernel, push_messages_kernel, acknowledge_kernel,
               dispatch_kernel<true>, dispatch_kernel<false>, combine_kernel<float, true>,
               combine_kernel<__nv_bfloat16, true>, combine_kernel<float, false>, combine_kernel<__nv_bfloat16, false>);
  allow_shared_bytes(kBulkSharedBytes, dispatch_kernel<true>, combine_kernel<float, true>,
                     combine_kernel<__nv_bfloat16, true>);
}

}  // namespace uccl_ep::nvl
