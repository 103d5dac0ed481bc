// What normal mode's two paths share (api.hpp): the group and its message words as a kernel sees them, the SM-store
// send and receive sides of dispatch and combine, and the host's arguments for them. The NVLink path
// (normal_nvlink.cu) runs these sides in its one launch per op where rows cannot take bulk copies; the proxy path
// (normal_proxy.cu) runs them as separate kernels against the proxy's registered buffer. Included by those two .cu
// files only (everything but the declarations at the end is in an anonymous namespace).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "api.hpp"
#include "device_common.cuh"
#include "normal_scan.cuh"

namespace uccl_ep::nvl {
namespace {

constexpr int kPieceTokens = 16;  // receive work items: this many tokens of a send block's chunk

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
  // How the words that announce something to several members go out after the one system fence that orders what
  // they announce: relaxed (true), or a release each, whose fence waits for the word before it to reach its member
  // (set_bulk_tuning's announce_one_fence; false on the proxy path).
  bool one_fence;
};
// And a receive side, of each member's message to us.
struct ReceiveFrom : Members {
  const char* region[kMaxRanks];  // our in-region written by the member
  const uint64_t* chunks[kMaxRanks];
  uint64_t message[kMaxRanks];
};

// Thread i runs wait(u) for u = i, i + blockDim.x, ... < count while no wait of the block has failed; returns (to the
// whole block) whether every one succeeded. The fence and barrier pass what the awaited words published on to every
// thread of the block.
template <class Wait>
__device__ bool block_waits(int count, const Wait& wait) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  block_sync();
  for (int u = threadIdx.x; u < count && !failed; u += blockDim.x)
    if (!wait(u)) failed = 1;
  __threadfence();
  block_sync();
  const bool ok = !failed;
  block_sync();  // `failed` is reused
  return ok;
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
  block_sync();
  return ok;
}

// A chunk's progress word: the message's number in the high half, how much of the chunk (tokens, or rows back in
// combine) has landed in the low half, so it only grows from message to message.
__device__ __forceinline__ uint64_t progress(uint64_t message, int done) { return message << 32 | uint32_t(done); }

// A barrier among the block's threads [first, first + threads) (whole warps): named barrier 1, or 0 for the whole
// block.
__device__ __forceinline__ void group_barrier(int threads) {
  asm volatile("barrier.sync %0, %1;" ::"r"(threads == int(blockDim.x) ? 0 : 1), "r"(threads) : "memory");
}

// After the writes of `threads` threads of the block (this one is `thread`): a system fence by the first of them
// (cumulative over their writes, which the barrier orders before it), then the words that announce them: `chunks`
// more chunks' routing (meta), or chunk c's progress done_for(s).
__device__ void announce_meta(const SendTo& to, int chunks = 1, int thread = threadIdx.x, int threads = blockDim.x) {
  group_barrier(threads);
  if (thread != 0) return;
  __threadfence_system();
  for (int s = 0; s < to.num_ranks; ++s)
    if (s != to.self) to.one_fence ? add_relaxed_sys(to.meta[s], chunks) : add_release_sys(to.meta[s], chunks);
}
template <class DoneFor>
__device__ void announce_progress(const SendTo& to, int c, const DoneFor& done_for) {
  block_sync();
  if (threadIdx.x != 0) return;
  __threadfence_system();
  for (int s = 0; s < to.num_ranks; ++s) {
    if (s == to.self) continue;
    const uint64_t word = progress(to.message[s], done_for(s));
    to.one_fence ? store_relaxed_sys(to.chunks[s] + c, word) : store_release_sys(to.chunks[s] + c, word);
  }
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
    strided_copy16(reinterpret_cast<int4*>(dst), reinterpret_cast<const int4*>(src), bytes / 16, thread, threads);
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
  block_sync();
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
  block_sync();
  for (int d = 0; d < R; ++d) base[d] = counted[d];
  block_sync();  // `counted` is reused by the next chunk's call
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
  block_sync();  // excl and mask_out are read by other warps of the block
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
  bool pulled;                     // src: the members' own inputs, all there before the launch (pull_dispatch_kernel)
  // dispatch(layout="expert") where the receive writes the pair buffer (pair_layout.cuh): row o goes to pair slots
  // pair_of[o * topk + k] of recv_x and recv_scales (the pair buffer) instead of row o; a slot of pair_capacity names
  // none. No expert indices are localized and no padding row written (the layout did both).
  const int32_t* pair_of;
  int pair_capacity;
};

// Where source s's rows are in its message: ours (the op's inputs) and, with token slots, a member's at their
// token's row; else a member's packed in token order.
__device__ __forceinline__ bool rows_at_tokens(const DispatchReceiveArgs& a, int s) {
  return s == a.from.self || a.token_slots;
}

// Output row o's expert slot k: local expert l (-1: another GPU's expert) and weight w (0 for another GPU's); a
// local expert's row is counted (each kept row's slots are localized once).
__device__ __forceinline__ void put_localized(const DispatchReceiveArgs& a, int o, int k, int l, float w) {
  if (l >= 0) atomicAdd(a.num_tokens_per_expert + l, 1);
  a.recv_topk_idx[o * a.topk + k] = l;
  if (a.recv_topk_weights) a.recv_topk_weights[o * a.topk + k] = l >= 0 ? w : 0.f;
}

// Output row o's expert slot k, from source s's token t (its weight loaded only for a local expert).
__device__ __forceinline__ void localize_slot(const DispatchReceiveArgs& a, int o, int s, int t, int k, int first,
                                              int local_experts) {
  const int l = local_index(a.src.topk_idx[s][t * a.topk + k], first, local_experts);
  put_localized(a, o, k, l, a.recv_topk_weights && l >= 0 ? a.src.weights[s][t * a.topk + k] : 0.f);
}

// Output row o's every slot, by one thread, the row's indices and weights loaded before any is stored: a member's
// routing is read over NVLink, where a load behind each store waits a round trip per slot, and with the copies'
// traffic those round trips outlast the copies of a small dispatch.
__device__ __forceinline__ void localize_row(const DispatchReceiveArgs& a, int o, int s, int t, int first,
                                             int local_experts) {
  constexpr int kAtOnce = 8;
  const int K = a.topk;
  const int32_t* idx = a.src.topk_idx[s] + int64_t(t) * K;
  const float* weights = a.recv_topk_weights ? a.src.weights[s] + int64_t(t) * K : nullptr;
  for (int k0 = 0; k0 < K; k0 += kAtOnce) {
    int e[kAtOnce];
    float w[kAtOnce];
#pragma unroll
    for (int q = 0; q < kAtOnce; ++q) {
      e[q] = k0 + q < K ? idx[k0 + q] : -1;
      w[q] = weights && k0 + q < K ? weights[k0 + q] : 0.f;
    }
#pragma unroll
    for (int q = 0; q < kAtOnce; ++q)
      if (k0 + q < K) put_localized(a, o, k0 + q, local_index(e[q], first, local_experts), w[q]);
  }
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
  // Row o's x and scale rows to output row `to` (landed while we ran, unless they are our own).
  const auto copy_to = [&](int64_t to, int64_t row) {
    char* out_x = a.recv_x + to * a.x_row_bytes;
    const char* in_x = a.src.x[s] + row * a.x_row_bytes;
    if (own)
      warp_copy(out_x, in_x, a.x_row_bytes, lane);
    else
      warp_copy<Load::kCoherent>(out_x, in_x, a.x_row_bytes, lane);
    if (a.recv_scales) {
      char* out_s = a.recv_scales + to * a.scale_row_bytes;
      const char* in_s = a.src.scales[s] + row * a.scale_row_bytes;
      if (own)
        warp_copy(out_s, in_s, a.scale_row_bytes, lane);
      else
        warp_copy<Load::kCoherent>(out_s, in_s, a.scale_row_bytes, lane);
    }
  };
  for (int o = o0 + warp; o < o1; o += warps) {
    const int t = a.row_map[o].y;
    const int64_t row = at_tokens ? t : o - offset;
    if (a.pair_of) {  // the row to each of its pair slots: lane k holds slot k (top-k <= a warp)
      const int slot = lane < a.topk ? a.pair_of[int64_t(o) * a.topk + lane] : a.pair_capacity;
      for (int k = 0; k < a.topk; ++k) {
        const int to = __shfl_sync(0xffffffffu, slot, k);
        if (to < a.pair_capacity) copy_to(to, row);
      }
      continue;
    }
    copy_to(o, row);
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
      block_sync();
      const bool arrived = ok;
      block_sync();  // ok is reused
      if (!arrived) continue;
    }
    copy_rows(a, s, o0, o1, offset, warp, warps, lane, first, local_experts);
  }
  const int all_warps = blocks * warps;
  for (int o = kept + block * warps + warp; !a.pair_of && o < a.capacity; o += all_warps) pad_row(a, o, lane);
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

struct CombineReceiveArgs {
  ReceiveFrom from;
  int chunks;
  const char* y;
  int64_t row_bytes;
  int capacity, num_tokens;
  const int32_t* recv_counts;
  const bool* mask;  // [T, R] this rank's
  int32_t* excl;     // [T + 1, R] from positions_kernel, or in one launch its first receive blocks (a member each)
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
    block_sync();  // the previous item's readers of `failed` are done
    if (threadIdx.x == 0) failed = 0;
    block_sync();
    if (threadIdx.x < R * a.chunks) {
      const int d = threadIdx.x / a.chunks, c = threadIdx.x % a.chunks;
      const int lo = a.excl[t0 * R + d], hi = a.excl[t1 * R + d], n = a.excl[T_ * R + d];
      const int c0 = chunk_begin(n, a.chunks, c), c1 = chunk_begin(n, a.chunks, c + 1);
      if (d != from.self && lo < hi && c0 < c1 && c0 < hi && c1 > lo && wait_progress(from, d, c, min(hi, c1) - c0) < 0)
        failed = 1;
    }
    block_sync();
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

// The SM budget is split between the send blocks, a block per chunk of the message (every process must use the same
// split: the receivers count chunks; initialize() checks it), and the receive blocks. Receive sides move more than
// send sides (dispatch: every received row, own ones too; combine: every copy of a token, then its sum), so the
// SM-store kernels send with a third of the budget by default; with bulk copies a send block joins the receive side
// once its rows have left, and half of the budget sends (in the loopback at 24 SMs a half beat a third by 2-15% with
// bulk copies and lost by 8-51% with SM stores, bench/RESULTS.md). UCCL_EP_NVL_BULK is the same in every process.
inline int send_blocks() {
  const int wanted = num_send_sms() > 0 ? num_send_sms() : num_sms() / (bulk_copies() ? 2 : 3);
  return std::clamp(wanted, 1, std::min(kChunks, num_sms() - 1));
}
inline int receive_blocks() { return std::max(1, num_sms() - send_blocks()); }

// A (cached) dispatch's kernels, given where its messages go (`to`) and come from (`from`): the NVLink buffers of
// the members, or regions of the proxy's buffer.
struct DispatchKernels {
  DispatchSendArgs send;
  ScanArgs scan;
  DispatchReceiveArgs receive;
};
inline DispatchKernels dispatch_kernels(const DispatchArgs& a, const Group& g, const DispatchLayoutBytes& l,
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
                                  false,
                                  false,
                                  nullptr,
                                  0};
  return k;
}
inline DispatchKernels cached_dispatch_kernels(const CachedDispatchArgs& a, const Group& g, const Scratch& scratch,
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
                                  false,
                                  false,
                                  nullptr,
                                  0};
  return k;
}

struct CombineKernels {
  CombineSendArgs send;
  CombineReceiveArgs receive;
};
inline CombineKernels combine_kernels(const CombineArgs& a, const Scratch& scratch, const SendTo& to,
                                      const ReceiveFrom& from) {
  const int64_t row_bytes = int64_t(a.hidden) * float_bytes(a.dtype);
  return {CombineSendArgs{to, send_blocks(), static_cast<const char*>(a.y), row_bytes, a.capacity, a.recv_counts,
                          a.overflow == Overflow::kDrop},
          CombineReceiveArgs{from, send_blocks(), static_cast<const char*>(a.y), row_bytes, a.capacity, a.num_tokens,
                             a.recv_counts, a.is_token_in_rank, scratch.excl, static_cast<char*>(a.out)}};
}

}  // namespace

// The proxy path's kernels (normal_proxy.cu), which preload_intranode_kernels loads and set_kernel_stamps points at
// the stamps: without separate compilation each translation unit has its own kernels and __device__ globals.
void preload_proxy_normal_kernels();
void set_proxy_kernel_stamps(uint64_t* stamps, cudaStream_t stream);

}  // namespace uccl_ep::nvl
