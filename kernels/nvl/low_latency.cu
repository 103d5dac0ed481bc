// Low-latency (decode) mode over NVLink: SM kernels store each token's rows straight into the peers' buffers
// (peer memory mapped through CUDA IPC), one row per selected expert, and raise a flag per receiver; the receive
// kernels wait for the flags (with a deadline) and unpack into XLA's static expert-major outputs.
//
// Every ordered pair of ranks counts its low-latency ops (sends on one side, receives on the other). Op j of a
// pair uses half j % 2 of the receiver's low-latency area, in the sender's region. Each of the sender's
// kSendBlocks blocks adds 1 to the sender's arrival counter in the receiver's flag words, with release
// semantics, once its rows (and block 0's counts) are stored; the receiver waits for j * kSendBlocks. Two halves
// suffice: a sender starts op j + 2 only after its receive of op j + 1 finished, which waited for the
// receiver's send of op j + 1, which the receiver's stream ran after the receive that read op j. So no
// acknowledgement travels back.
//
// A region: [counts: int32 per local expert of the receiver, 256-byte aligned][rows]. Rows are grouped by the
// receiver's local expert, then the sender's token order; the sender computes every position itself (a stable
// counting pass over its routing), so no atomics decide the layout and results are deterministic.
//   dispatch row: [x | scales | (local expert, token, position, slot)], each part 16-byte aligned; slot = token * K + k
//   combine row:  [y row] at the row's slot on its source (the handle's src_slot), so the source reads token t's
//                 k-th expert output at row t * K + k without working out the routing again
#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "api.hpp"
#include "device_common.cuh"

namespace uccl_ep::nvl {
namespace {

constexpr int kThreads = 1024;
// Blocks of a send kernel: fixed, because receivers count arrivals by block (UCCL_EP_LL_NUM_SMS sets the
// receive kernels' blocks).
constexpr int kSendBlocks = 64;
constexpr int kSendThreads = 512;  // 128 registers a thread: the copy loop keeps its loads in flight unspilled
constexpr int64_t kCombineSegmentBytes = 1024;  // a warp's share of a combined row: two 16-byte vectors a lane

// Where a send kernel writes (by group position).
struct Outbox {
  char* region[kMaxRanks];
  uint64_t* arrivals[kMaxRanks];  // the receiver's counter of our blocks
  uint64_t seq[kMaxRanks];
};
// What a receive kernel reads (by group position).
struct Inbox {
  const char* region[kMaxRanks];
  const uint64_t* arrivals[kMaxRanks];  // our counter of the sender's blocks
  uint64_t seq[kMaxRanks];
  int rank[kMaxRanks];
};

struct Shape {
  int num_ranks, local_experts, max_tokens;  // R, L, N
  int64_t counts_bytes, row_bytes, capacity_rows;  // region layout
  int rank;                                        // this GPU's global rank (error reports)
  uint64_t* phases;                                // UCCL_EP_KERNEL_TIMING=2: SM clock stamps, else null
  bool routing_by_warps;                           // else UCCL_EP_LL_ROUTING=one_warp (see route_slots)
};

// Phase stamps for profiling (block 0, thread 0; SM clock): word kernel * 8 + phase.
enum PhaseKernel { kDispatchSend = 0, kDispatchRecv = 1, kCombineSend = 2, kCombineRecv = 3 };
__device__ __forceinline__ void stamp(const Shape& shape, int kernel, int phase) {
  if (shape.phases && blockIdx.x == 0 && threadIdx.x == 0) shape.phases[kernel * 8 + phase] = clock64();
}

// One warp: exclusive prefix sums of load(0..n) into store(i, prefix); returns the total on every lane.
template <class Load, class Store>
__device__ int warp_exclusive_scan(int n, Load&& load, Store&& store) {
  const int lane = threadIdx.x % kWarp;
  int carry = 0;
  for (int base = 0; base < n; base += kWarp) {
    const int i = base + lane;
    const int v = i < n ? load(i) : 0;
    int inclusive = v;
    for (int d = 1; d < kWarp; d <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += u;
    }
    if (i < n) store(i, carry + inclusive - v);
    carry += __shfl_sync(0xffffffffu, inclusive, kWarp - 1);
  }
  return carry;
}

// One warp: the position of each slot in [begin, end) among the earlier slots of that range for the same expert,
// added to counts[e] (the range's slots per expert so far), walked 32 at a time: match_any groups the lanes of
// one expert.
__device__ void count_slots(const int* idx, int begin, int end, int* pos, int* counts) {
  const int lane = threadIdx.x % kWarp;
  for (int base = begin; base < end; base += kWarp) {
    const int p = base + lane;
    const int e = p < end ? idx[p] : -1;
    const unsigned same = __match_any_sync(0xffffffffu, e >= 0 ? e : -2 - lane);
    const int before_warp = e >= 0 ? counts[e] : 0;
    __syncwarp();
    if (e >= 0) {
      const int before_lane = __popc(same & ((1u << lane) - 1));
      pos[p] = before_warp + before_lane;
      if (before_lane == 0) counts[e] = before_warp + __popc(same);
    }
    __syncwarp();
  }
}

// The whole block: topk_idx into shared `idx`, out-of-range entries -1 (and reported, with `report_bad`).
__device__ void load_slots(const int32_t* topk_idx, int pairs, int topk, int num_experts, int* idx, DeviceErrors* err,
                           int rank, bool report_bad) {
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    int e = topk_idx[p];
    if (e < -1 || e >= num_experts) {
      if (report_bad) report(err, 1, rank, p / topk, p % topk, e);
      e = -1;
    }
    idx[p] = e;
  }
}

// The routing of this rank's slots, in shared memory: idx (topk_idx, out-of-range entries -1), pos (each slot's
// position among this rank's slots for the same expert, in token order), count (slots per expert) and first
// (where expert e's rows start among the rows for e's rank), computed by the whole block (it ends synchronized).
//
// With `warp_counts` ([warps * num_experts] shared ints): every warp counts a contiguous chunk of the
// slots and a scan over warps joins them (the default); without, warp 0 walks all slots
// (UCCL_EP_LL_ROUTING=one_warp). Out-of-range entries are reported with `report_bad`.
__device__ void route_slots(const int32_t* topk_idx, int pairs, int topk, int num_experts, int num_ranks, int* idx,
                            int* pos, int* count, int* first, int* warp_counts, DeviceErrors* err, int rank,
                            bool report_bad) {
  const int warps = blockDim.x / kWarp, warp = threadIdx.x / kWarp;
  load_slots(topk_idx, pairs, topk, num_experts, idx, err, rank, report_bad);
  for (int i = threadIdx.x; i < (warp_counts ? warps : 1) * num_experts; i += blockDim.x)
    (warp_counts ? warp_counts : count)[i] = 0;
  __syncthreads();
  const int chunk = warp_counts ? (pairs + warps * kWarp - 1) / (warps * kWarp) * kWarp : pairs;
  if (warp_counts)
    count_slots(idx, warp * chunk, min(pairs, (warp + 1) * chunk), pos, warp_counts + warp * num_experts);
  else if (warp == 0)
    count_slots(idx, 0, pairs, pos, count);
  __syncthreads();
  if (warp_counts) {
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {  // each warp's start, per expert
      int running = 0;
      for (int w = 0; w < warps; ++w) {
        const int c = warp_counts[w * num_experts + e];
        warp_counts[w * num_experts + e] = running;
        running += c;
      }
      count[e] = running;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x)
      if (idx[p] >= 0) pos[p] += warp_counts[(p / chunk) * num_experts + idx[p]];
  }
  const int local = num_experts / num_ranks;
  if (warp < num_ranks)  // one warp per rank
    warp_exclusive_scan(local, [&](int l) { return count[warp * local + l]; },
                        [&](int l, int v) { first[warp * local + l] = v; });
  __syncthreads();
}

// After the block's stores: block 0 writes each target's counts (write_counts(), its threads), then every block
// announces itself to every target with one release add (ordering all of the block's stores before it).
template <class WriteCounts>
__device__ void finish_send(const Outbox& to, int num_ranks, WriteCounts&& write_counts) {
  if (blockIdx.x == 0) write_counts();
  __syncthreads();
  if (threadIdx.x == 0)
    for (int d = 0; d < num_ranks; ++d) add_release_sys(to.arrivals[d], 1);
}

// Thread 0 waits for every source's arrival counter; false (on every thread) if one did not come in time. An
// earlier timeout (error code 5 pending) ends the wait at once: the stream is out of step after it.
__device__ bool wait_sources(const Inbox& from, int num_ranks, uint64_t timeout_ns, DeviceErrors* err, int rank) {
  __shared__ bool ok;
  if (threadIdx.x == 0) {
    ok = true;
    for (int s = 0; s < num_ranks && ok; ++s)
      ok = wait_flag(from.arrivals[s], from.seq[s] * kSendBlocks, int64_t(from.seq[s]), timeout_ns, err, rank,
                     from.rank[s]);
  }
  __syncthreads();
  return ok;
}

// What the dispatch's send phase reads, and what its receive phase writes.
struct DispatchSource {
  const char* x;
  int64_t x_row_bytes;
  const char* scales;
  int64_t scale_row_bytes, scales_at;  // scales_at: where the scales start in a row
  const int32_t* topk_idx;
  int num_tokens, topk, num_experts;
};
struct DispatchTarget {
  int64_t x_row_bytes, scale_row_bytes, scales_at;
  char* recv_x;
  char* recv_scales;
  int32_t* recv_count;
  int32_t* layout;
  int32_t* src_slot;
};
// What the combine's send phase reads, and what its receive phase reads and writes.
struct CombineSource {
  const char* y;
  int64_t row_bytes;
  const int32_t* layout;
  const int32_t* src_slot;  // [L, R * N]: where each row of y goes on its source
};
struct CombineTarget {
  const int32_t* topk_idx;
  const float* topk_weights;
  int num_tokens, topk, num_experts;
  int64_t row_bytes;
  char* out;
};

// Each phase below is a whole-block device function over the kernel's dynamic shared memory `smem`; a kernel runs
// one phase (split calls) or both (send, then receive: one launch per op).

__device__ void dispatch_send(const DispatchSource& in, const Shape& shape, const Outbox& to, DeviceErrors* err,
                              int* smem) {
  const int pairs = in.num_tokens * in.topk, local = shape.local_experts;
  int* idx = smem;
  int* pos = idx + pairs;
  int* count = pos + pairs;
  int* first = count + in.num_experts;
  int* warp_counts = shape.routing_by_warps ? first + in.num_experts : nullptr;
  stamp(shape, kDispatchSend, 0);
  route_slots(in.topk_idx, pairs, in.topk, in.num_experts, shape.num_ranks, idx, pos, count, first, warp_counts, err,
              shape.rank, blockIdx.x == 0);
  stamp(shape, kDispatchSend, 1);

  // One warp per (token, slot): the rows of a token are read K times, from L2.
  const int lane = threadIdx.x % kWarp, warps_per_block = blockDim.x / kWarp;
  for (int p = blockIdx.x * warps_per_block + threadIdx.x / kWarp; p < pairs; p += gridDim.x * warps_per_block) {
    const int e = idx[p];
    if (e < 0) continue;
    const int d = e / local, t = p / in.topk, j = first[e] + pos[p];
    if (j >= shape.capacity_rows) continue;  // the host refused shapes where this can happen
    char* row = to.region[d] + shape.counts_bytes + int64_t(j) * shape.row_bytes;
    warp_copy(row, in.x + int64_t(t) * in.x_row_bytes, in.x_row_bytes, lane);
    if (in.scale_row_bytes)
      warp_copy(row + in.scales_at, in.scales + int64_t(t) * in.scale_row_bytes, in.scale_row_bytes, lane);
    if (lane == 0) *reinterpret_cast<int4*>(row + shape.row_bytes - 16) = make_int4(e % local, t, pos[p], p);
  }
  stamp(shape, kDispatchSend, 2);
  finish_send(to, shape.num_ranks, [&] {
    for (int i = threadIdx.x; i < in.num_experts; i += blockDim.x)
      reinterpret_cast<int*>(to.region[i / local])[i % local] = count[i];
  });
  stamp(shape, kDispatchSend, 3);
}

__device__ void dispatch_recv(const DispatchTarget& out, const Shape& shape, const Inbox& from, uint64_t timeout_ns,
                              DeviceErrors* err, int* smem) {
  const int R = shape.num_ranks, L = shape.local_experts;
  const int64_t slab = int64_t(R) * shape.max_tokens;  // rows per local expert
  int* count = smem;            // [s * L + l]
  int* offset = count + R * L;  // [l * R + s]: where source s's rows of expert l start
  int* total = offset + R * L;  // [l]
  int* rows_from = total + L;   // [R + 1]: prefix of each source's rows
  stamp(shape, kDispatchRecv, 0);
  if (!wait_sources(from, R, timeout_ns, err, shape.rank)) return;
  stamp(shape, kDispatchRecv, 1);
  for (int i = threadIdx.x; i < R * L; i += blockDim.x)
    count[i] = __ldcg(reinterpret_cast<const int*>(from.region[i / L]) + i % L);
  __syncthreads();
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      offset[l * R + s] = acc;
      acc += count[s * L + l];
      if (blockIdx.x == 0) out.layout[l * R + s] = count[s * L + l];
    }
    total[l] = acc;
    if (blockIdx.x == 0) {
      out.recv_count[l] = int(min(int64_t(acc), slab));
      if (acc > slab) report(err, 2, shape.rank, acc, slab, 0);
    }
  }
  const int warp = threadIdx.x / kWarp;
  if (warp < R) {  // rows of source `warp`, then their prefix over sources
    const int rows = warp_exclusive_scan(L, [&](int l) { return count[warp * L + l]; }, [](int, int) {});
    if (threadIdx.x % kWarp == 0) rows_from[warp + 1] = rows;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    rows_from[0] = 0;
    for (int s = 0; s < R; ++s) rows_from[s + 1] += rows_from[s];
  }
  __syncthreads();

  stamp(shape, kDispatchRecv, 2);
  const int lane = threadIdx.x % kWarp, warps_per_block = blockDim.x / kWarp;
  for (int i = blockIdx.x * warps_per_block + threadIdx.x / kWarp; i < rows_from[R]; i += gridDim.x * warps_per_block) {
    int s = 0;
    while (i >= rows_from[s + 1]) ++s;
    if (i - rows_from[s] >= shape.capacity_rows) continue;  // the sender refused such shapes already
    const char* row = from.region[s] + shape.counts_bytes + int64_t(i - rows_from[s]) * shape.row_bytes;
    int4 tail = make_int4(0, 0, 0, 0);
    if (lane == 0) tail = __ldcg(reinterpret_cast<const int4*>(row + shape.row_bytes - 16));
    const int l = __shfl_sync(0xffffffffu, tail.x, 0), j = __shfl_sync(0xffffffffu, tail.z, 0),
              slot = __shfl_sync(0xffffffffu, tail.w, 0);
    if (l < 0 || l >= L || j < 0 || j >= count[s * L + l] || offset[l * R + s] + j >= slab) continue;
    const int64_t o = int64_t(l) * slab + offset[l * R + s] + j;
    warp_copy<Load::kCoherent>(out.recv_x + o * out.x_row_bytes, row, out.x_row_bytes, lane);
    if (out.scale_row_bytes)
      warp_copy<Load::kCoherent>(out.recv_scales + o * out.scale_row_bytes, row + out.scales_at, out.scale_row_bytes,
                                 lane);
    if (lane == 0) out.src_slot[o] = slot;
  }
  stamp(shape, kDispatchRecv, 3);
  // Padding rows: no source token (their data is not written).
  for (int64_t o = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; o < int64_t(L) * slab;
       o += int64_t(gridDim.x) * blockDim.x)
    if (o % slab >= total[o / slab]) out.src_slot[o] = -1;
  stamp(shape, kDispatchRecv, 4);
}

__device__ void combine_send(const CombineSource& in, const Shape& shape, const Outbox& to, DeviceErrors* err,
                             int* smem) {
  const int R = shape.num_ranks, L = shape.local_experts;
  const int64_t slab = int64_t(R) * shape.max_tokens;
  int* rows = smem;               // [l * R + s]: the handle's layout
  int* begin = rows + R * L;      // [l * R + s]: where source s's rows start in y[l]
  int* cum = begin + R * L;       // [L + 1]: prefix of rows per expert
  int* in_expert = cum + L + 1;   // [L]: rows of expert l
  __shared__ bool valid;
  stamp(shape, kCombineSend, 0);
  if (threadIdx.x == 0) valid = true;
  for (int i = threadIdx.x; i < R * L; i += blockDim.x) rows[i] = max(0, in.layout[i]);
  __syncthreads();
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int in_l = 0;
    for (int s = 0; s < R; ++s) {
      begin[l * R + s] = in_l;
      in_l += rows[l * R + s];
    }
    in_expert[l] = in_l;
    if (in_l > slab) valid = false;
  }
  __syncthreads();
  if (threadIdx.x < kWarp) {
    const int all = warp_exclusive_scan(L, [&](int l) { return in_expert[l]; }, [&](int l, int v) { cum[l] = v; });
    if (threadIdx.x == 0) {
      cum[L] = all;
      if (!valid && blockIdx.x == 0) report(err, 4, shape.rank, all, int64_t(L) * slab, 0);
    }
  }
  __syncthreads();

  stamp(shape, kCombineSend, 1);
  const int lane = threadIdx.x % kWarp, warps_per_block = blockDim.x / kWarp;
  const int all_rows = valid ? cum[L] : 0;
  for (int i = blockIdx.x * warps_per_block + threadIdx.x / kWarp; i < all_rows; i += gridDim.x * warps_per_block) {
    int lo = 0, hi = L;  // the expert: the last l with cum[l] <= i
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (cum[mid] <= i) lo = mid; else hi = mid;
    }
    const int l = lo, r = i - cum[l];
    int s = 0;
    while (r >= begin[l * R + s] + rows[l * R + s]) ++s;
    const int64_t j = in.src_slot[int64_t(l) * slab + r];
    if (j < 0 || j >= shape.capacity_rows) {  // the layout counts a row the dispatch did not deliver here
      if (lane == 0) report(err, 9, shape.rank, l, r, j);
      continue;
    }
    warp_copy(to.region[s] + shape.counts_bytes + j * shape.row_bytes, in.y + (int64_t(l) * slab + r) * in.row_bytes,
              in.row_bytes, lane);
  }
  stamp(shape, kCombineSend, 2);
  finish_send(to, R, [&] {
    for (int i = threadIdx.x; i < R * L; i += blockDim.x)
      reinterpret_cast<int*>(to.region[i / L])[i % L] = valid ? rows[(i % L) * R + i / L] : 0;
  });
  stamp(shape, kCombineSend, 3);
}

// (token, 1 KiB segment) work items: each lane sums two 16-byte vectors of every selected expert's row, weighted,
// in float32, with the rows of kRowsInFlight experts loaded before any is added (one row at a time leaves the
// loads latency-bound; 4 rows fit the registers of 512-thread blocks, 2 those of 1024-thread ones).
template <typename T, int kRowsInFlight>
__device__ void combine_recv(const CombineTarget& out, const Shape& shape, const Inbox& from, uint64_t timeout_ns,
                             DeviceErrors* err, int* smem) {
  const int pairs = out.num_tokens * out.topk, L = shape.local_experts, topk = out.topk;
  int* idx = smem;            // [pairs]: topk_idx, -1 where unused or out of range
  int* count = idx + pairs;   // [num_experts] (block 0): slots per expert, for the stale-handle check
  stamp(shape, kCombineRecv, 0);
  load_slots(out.topk_idx, pairs, topk, out.num_experts, idx, err, shape.rank, false);
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < out.num_experts; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x)
      if (idx[p] >= 0) atomicAdd(&count[idx[p]], 1);
  }
  __syncthreads();
  stamp(shape, kCombineRecv, 1);
  if (!wait_sources(from, shape.num_ranks, timeout_ns, err, shape.rank)) return;
  stamp(shape, kCombineRecv, 2);
  for (int e = threadIdx.x; e < out.num_experts && blockIdx.x == 0; e += blockDim.x) {
    const int got = __ldcg(reinterpret_cast<const int*>(from.region[e / L]) + e % L);
    if (got != count[e]) report(err, 6, shape.rank, got, e % L, from.rank[e / L]);
  }

  const int lane = threadIdx.x % kWarp, warps_per_block = blockDim.x / kWarp;
  const int64_t row_vecs = out.row_bytes / 16;
  const int64_t segments = (out.row_bytes + kCombineSegmentBytes - 1) / kCombineSegmentBytes;
  constexpr int kVecs = kCombineSegmentBytes / 16 / kWarp;
  for (int64_t w = blockIdx.x * warps_per_block + threadIdx.x / kWarp; w < int64_t(out.num_tokens) * segments;
       w += int64_t(gridDim.x) * warps_per_block) {
    const int t = int(w / segments);
    const int64_t v0 = (w % segments) * kCombineSegmentBytes / 16 + lane;
    float acc[kVecs][Vec<T>::kN] = {};
    for (int k0 = 0; k0 < topk; k0 += kRowsInFlight) {
      int4 v[kRowsInFlight][kVecs];
      float weight[kRowsInFlight];
      bool used[kRowsInFlight];
#pragma unroll
      for (int r = 0; r < kRowsInFlight; ++r) {
        const int k = k0 + r, e = k < topk ? idx[t * topk + k] : -1;
        const int64_t j = int64_t(t) * topk + k;  // the row's slot: where the expert's rank put it
        used[r] = e >= 0 && j < shape.capacity_rows;
        weight[r] = used[r] ? out.topk_weights[t * topk + k] : 0.f;
        const int4* row = used[r] ? reinterpret_cast<const int4*>(from.region[e / L] + shape.counts_bytes +
                                                                  j * shape.row_bytes) : nullptr;
#pragma unroll
        for (int u = 0; u < kVecs; ++u)
          if (used[r] && v0 + u * kWarp < row_vecs) v[r][u] = __ldcg(row + v0 + u * kWarp);
      }
#pragma unroll
      for (int r = 0; r < kRowsInFlight; ++r)
#pragma unroll
        for (int u = 0; u < kVecs; ++u)
          if (used[r] && v0 + u * kWarp < row_vecs) Vec<T>::add(acc[u], v[r][u], weight[r]);
    }
    int4* dst = reinterpret_cast<int4*>(out.out + int64_t(t) * out.row_bytes);
#pragma unroll
    for (int u = 0; u < kVecs; ++u)
      if (v0 + u * kWarp < row_vecs) dst[v0 + u * kWarp] = Vec<T>::pack(acc[u]);
  }
  stamp(shape, kCombineRecv, 3);
}

// Send-only and fused launches use kSendThreads a block (the copy loop's registers); receive-only kThreads.
template <bool kSend, bool kRecv>
constexpr int kMaxThreads = kSend ? kSendThreads : kThreads;

// The phases of each op, for phase_kernel.
struct DispatchPhases {
  using In = DispatchSource;
  using Out = DispatchTarget;
  template <bool kFused>
  __device__ static void send(const In& in, const Shape& shape, const Outbox& to, DeviceErrors* err, int* smem) {
    dispatch_send(in, shape, to, err, smem);
  }
  template <bool kFused>
  __device__ static void recv(const Out& out, const Shape& shape, const Inbox& from, uint64_t timeout_ns,
                              DeviceErrors* err, int* smem) {
    dispatch_recv(out, shape, from, timeout_ns, err, smem);
  }
};
// T: the rows' type, which only the receive phase reads.
template <typename T>
struct CombinePhases {
  using In = CombineSource;
  using Out = CombineTarget;
  template <bool kFused>
  __device__ static void send(const In& in, const Shape& shape, const Outbox& to, DeviceErrors* err, int* smem) {
    combine_send(in, shape, to, err, smem);
  }
  template <bool kFused>
  __device__ static void recv(const Out& out, const Shape& shape, const Inbox& from, uint64_t timeout_ns,
                              DeviceErrors* err, int* smem) {
    combine_recv<T, kFused ? 4 : 2>(out, shape, from, timeout_ns, err, smem);
  }
};

// One launch of an op's send phase, receive phase, or both (fused: the receive reuses the shared memory).
template <class Phases, bool kSend, bool kRecv>
__global__ void __launch_bounds__(kMaxThreads<kSend, kRecv>, 1) phase_kernel(
    typename Phases::In in, typename Phases::Out out, Shape shape, Outbox to, Inbox from, uint64_t timeout_ns,
    DeviceErrors* err) {
  extern __shared__ int smem[];
  if constexpr (kSend) Phases::template send<kRecv>(in, shape, to, err, smem);
  if constexpr (kSend && kRecv) __syncthreads();
  if constexpr (kRecv) Phases::template recv<kSend>(out, shape, from, timeout_ns, err, smem);
}
template <bool kSend, bool kRecv>
constexpr auto dispatch_kernel = phase_kernel<DispatchPhases, kSend, kRecv>;
template <typename T, bool kSend, bool kRecv>
constexpr auto combine_kernel = phase_kernel<CombinePhases<T>, kSend, kRecv>;

int64_t counts_bytes(int local_experts) { return (int64_t(local_experts) * 4 + 255) / 256 * 256; }
int64_t dispatch_row_bytes(int64_t x_row_bytes, int64_t scale_row_bytes) {
  return int64_t(align16(x_row_bytes) + align16(scale_row_bytes)) + 16;
}

Shape shape_of(const NvlDevice& dev, const Group& g, int num_experts, int max_tokens, int64_t row_bytes,
               const char* op) {
  check_group(dev, g, op);
  if (num_experts % g.size != 0)
    throw std::invalid_argument(std::string("uccl_ep ") + op + ": num_experts must be divisible by the group size");
  if (dev.low_latency_stride() == 0)
    throw std::invalid_argument(std::string("uccl_ep ") + op +
                                ": no low-latency buffer; initialize with low_latency_buffer_bytes > 0");
  Shape s;
  s.num_ranks = g.size;
  s.local_experts = num_experts / g.size;
  s.max_tokens = max_tokens;
  s.counts_bytes = counts_bytes(s.local_experts);
  s.row_bytes = row_bytes;
  s.capacity_rows = std::max<int64_t>(0, (int64_t(dev.low_latency_stride()) - s.counts_bytes) / row_bytes);
  s.rank = dev.rank();
  s.phases = dev.phases_device();
  s.routing_by_warps = low_latency_routing_by_warps();
  return s;
}

// Shared memory of route_slots' users: idx and pos per slot, count and first per expert (+ counts per warp).
size_t routing_shared_bytes(int pairs, int num_experts, const Shape& shape, int threads) {
  const size_t warp_counts = shape.routing_by_warps ? size_t(threads / kWarp) * num_experts : 0;
  return (2 * size_t(pairs) + 2 * size_t(num_experts) + warp_counts) * sizeof(int);
}

// Shared memory of a kernel; above the default 48 KiB it must be allowed first.
template <class Kernel>
size_t shared_bytes(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
                               "cudaFuncSetAttribute (shared memory; fewer tokens or experts per call)");
  return bytes;
}

// Send side: the next op of each pair, its half and the peer's region and flag for us.
Outbox outbox(NvlDevice& dev, const Group& g) {
  Outbox to{};
  for (int s = 0; s < g.size; ++s) {
    const int p = peer_of(dev, g, s);
    const uint64_t seq = ++dev.low_latency_sent(p);
    to.region[s] = dev.peer_low_latency_region(p, int(seq & 1));
    to.arrivals[s] = dev.peer_low_latency_arrivals(p);
    to.seq[s] = seq;
  }
  return to;
}

Inbox inbox(NvlDevice& dev, const Group& g) {
  Inbox from{};
  for (int s = 0; s < g.size; ++s) {
    const int p = peer_of(dev, g, s);
    const uint64_t seq = ++dev.low_latency_received(p);
    from.region[s] = dev.low_latency_region(int(seq & 1), p);
    from.arrivals[s] = dev.low_latency_arrivals(p);
    from.seq[s] = seq;
    from.rank[s] = p;
  }
  return from;
}

std::string bytes_advice(const NvlDevice& dev, int64_t need_per_sender) {
  const size_t need = size_t(2) * dev.num_ranks() * ((need_per_sender + 255) / 256 * 256);
  return "the low-latency buffer holds " + std::to_string(dev.low_latency_stride()) + " bytes per sender, these " +
         "shapes need " + std::to_string(need_per_sender) + "; initialize with low_latency_buffer_bytes >= " +
         std::to_string((need + 8191) / 8192 * 8192) + " (jax_uccl_ep.low_latency_buffer_bytes gives it)";
}

}  // namespace

size_t low_latency_bytes_for(int num_ranks, int num_experts, int max_tokens_per_rank, int topk,
                             int64_t x_row_bytes, int64_t scale_row_bytes, int64_t combine_row) {
  const int64_t row = std::max(dispatch_row_bytes(x_row_bytes, scale_row_bytes), int64_t(align16(combine_row)));
  const int64_t region = counts_bytes(num_experts / std::max(1, num_ranks)) + int64_t(max_tokens_per_rank) * topk * row;
  const size_t half = size_t(num_ranks) * ((region + 255) / 256 * 256);
  return 2 * ((half + 4095) / 4096 * 4096);
}

namespace {

// A fused launch's blocks wait for each other's sends, so all of them must be resident at once; where they are
// not (a small GPU, or a partition of one), the op runs as its two launches instead.
template <class Kernel>
bool fits_at_once(Kernel kernel, int blocks, int threads, size_t smem, int cuda_device) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, size_t, int>, bool> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), smem, cuda_device);
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  // The occupancy calculator counts 0 blocks above the kernel's shared-memory limit: raise it first.
  check(cudaSetDevice(cuda_device), "cudaSetDevice");
  shared_bytes(kernel, smem);
  int per_sm = 0, sms = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem), "cudaOccupancy");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, cuda_device), "cudaDeviceGetAttribute");
  return known[key] = int64_t(per_sm) * sms >= blocks;
}

Shape dispatch_shape(const NvlDevice& dev, const Group& g, const LowLatencyDispatchArgs& a) {
  const int64_t row_bytes = dispatch_row_bytes(a.x_row_bytes, a.scale_row_bytes);
  Shape shape = shape_of(dev, g, a.num_experts, a.max_tokens_per_rank, row_bytes, "low_latency_dispatch");
  // A source sends a receiver at most N * K rows: refuse shapes that might not fit before anything moves (every
  // rank has the same shapes and buffer, so every rank refuses).
  const int64_t need = shape.counts_bytes + int64_t(a.max_tokens_per_rank) * a.topk * row_bytes;
  if (need > int64_t(dev.low_latency_stride()))
    throw std::invalid_argument("uccl_ep low_latency_dispatch: " + bytes_advice(dev, need));
  return shape;
}
DispatchSource dispatch_source(const LowLatencyDispatchArgs& a) {
  return {static_cast<const char*>(a.x), a.x_row_bytes, static_cast<const char*>(a.scales), a.scale_row_bytes,
          int64_t(align16(a.x_row_bytes)), a.topk_idx, a.num_tokens, a.topk, a.num_experts};
}
DispatchTarget dispatch_target(const LowLatencyDispatchArgs& a) {
  return {a.x_row_bytes, a.scale_row_bytes, int64_t(align16(a.x_row_bytes)), static_cast<char*>(a.recv_x),
          static_cast<char*>(a.recv_scales), a.recv_count, a.layout, a.src_slot};
}
size_t dispatch_send_shared(const LowLatencyDispatchArgs& a, const Shape& shape) {
  return routing_shared_bytes(a.num_tokens * a.topk, a.num_experts, shape, kSendThreads);
}
size_t dispatch_recv_shared(const Shape& shape) {
  const size_t R = shape.num_ranks, L = shape.local_experts;
  return (2 * R * L + L + R + 1) * sizeof(int);
}

int64_t combine_row_bytes(const LowLatencyCombineArgs& a) { return int64_t(a.hidden) * (a.bf16 ? 2 : 4); }
Shape combine_shape(const NvlDevice& dev, const Group& g, const LowLatencyCombineArgs& a) {
  if (combine_row_bytes(a) % 16 != 0)
    throw std::invalid_argument("uccl_ep low_latency_combine: on GPUs rows must be a multiple of 16 bytes (hidden "
                                "a multiple of 8 for bfloat16, 4 for float32), got hidden " + std::to_string(a.hidden));
  Shape shape = shape_of(dev, g, a.num_experts, a.max_tokens_per_rank, combine_row_bytes(a), "low_latency_combine");
  // Rows go back to slot t * K + k of their source: every region needs room for N * K combine rows. Refuse before
  // anything moves (every rank has the same shapes and buffer, so every rank refuses, in either half).
  const int64_t need = shape.counts_bytes + int64_t(a.max_tokens_per_rank) * a.topk * shape.row_bytes;
  if (need > int64_t(dev.low_latency_stride()))
    throw std::invalid_argument("uccl_ep low_latency_combine: " + bytes_advice(dev, need));
  return shape;
}
CombineSource combine_source(const LowLatencyCombineArgs& a) {
  return {static_cast<const char*>(a.y), combine_row_bytes(a), a.layout, a.src_slot};
}
CombineTarget combine_target(const LowLatencyCombineArgs& a) {
  return {a.topk_idx, a.topk_weights, a.num_tokens, a.topk, a.num_experts, combine_row_bytes(a),
          static_cast<char*>(a.out)};
}
size_t combine_send_shared(const Shape& shape) {
  const size_t R = shape.num_ranks, L = shape.local_experts;
  return (2 * R * L + 2 * L + 1) * sizeof(int);
}
size_t combine_recv_shared(const LowLatencyCombineArgs& a) {
  return (size_t(a.num_tokens) * a.topk + a.num_experts) * sizeof(int);
}

// One launch of a phase kernel: send-only grids are kSendBlocks x kSendThreads (receivers count arrivals by
// block), receive-only low_latency_blocks() x kThreads, fused as a send grid.
template <class Kernel, class In, class Out>
void launch(Kernel kernel, int blocks, int threads, size_t smem, cudaStream_t stream, const In& in, const Out& out,
            const Shape& shape, const Outbox& to, const Inbox& from, NvlDevice& dev, const char* what) {
  kernel<<<blocks, threads, shared_bytes(kernel, smem), stream>>>(in, out, shape, to, from, timeout_ns(),
                                                                   dev.errors_device());
  check(cudaGetLastError(), what);
}

// An op's send and receive as one launch of `kernel`, or through `split()` (its two launches) where the fused
// kernel's blocks cannot all be resident at once (or UCCL_EP_LL_FUSED=0).
template <class Kernel, class In, class Out, class Split>
void run_fused(NvlDevice& dev, const Group& g, cudaStream_t stream, Kernel kernel, size_t smem, const Shape& shape,
               const In& in, const Out& out, const char* label, Split&& split) {
  if (!low_latency_fused() || !fits_at_once(kernel, kSendBlocks, kSendThreads, smem, dev.cuda_device())) {
    split();
    return;
  }
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  const Outbox to = outbox(dev, g);
  const Inbox from = inbox(dev, g);
  dev.timing_begin(stream);
  launch(kernel, kSendBlocks, kSendThreads, smem, stream, in, out, shape, to, from, dev, label);
  dev.timing_end(stream, label);
}

}  // namespace

void low_latency_dispatch_send(NvlDevice& dev, const Group& g, const LowLatencyDispatchArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  const Shape shape = dispatch_shape(dev, g, a);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  const Outbox to = outbox(dev, g);
  dev.timing_begin(stream);
  launch(dispatch_kernel<true, false>, kSendBlocks, kSendThreads, dispatch_send_shared(a, shape), stream,
         dispatch_source(a), DispatchTarget{}, shape, to, Inbox{}, dev, "low_latency dispatch send kernel");
  dev.timing_end(stream, "low_latency_dispatch send");
  dev.timing_begin(stream);
}

void low_latency_dispatch_recv(NvlDevice& dev, const Group& g, const LowLatencyDispatchArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  const Shape shape = dispatch_shape(dev, g, a);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  const Inbox from = inbox(dev, g);
  launch(dispatch_kernel<false, true>, low_latency_blocks(), kThreads, dispatch_recv_shared(shape), stream,
         DispatchSource{}, dispatch_target(a), shape, Outbox{}, from, dev, "low_latency dispatch receive kernel");
  dev.timing_end(stream, "low_latency_dispatch receive");
}

void low_latency_dispatch(NvlDevice& dev, const Group& g, const LowLatencyDispatchArgs& a, cudaStream_t stream) {
  const Shape shape = dispatch_shape(dev, g, a);
  run_fused(dev, g, stream, dispatch_kernel<true, true>,
            std::max(dispatch_send_shared(a, shape), dispatch_recv_shared(shape)), shape, dispatch_source(a),
            dispatch_target(a), "low_latency_dispatch", [&] {
              low_latency_dispatch_send(dev, g, a, stream);
              low_latency_dispatch_recv(dev, g, a, stream);
            });
}

void low_latency_combine_send(NvlDevice& dev, const Group& g, const LowLatencyCombineArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  const Shape shape = combine_shape(dev, g, a);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  const Outbox to = outbox(dev, g);
  dev.timing_begin(stream);
  launch(combine_kernel<__nv_bfloat16, true, false>, kSendBlocks, kSendThreads, combine_send_shared(shape), stream,
         combine_source(a), CombineTarget{}, shape, to, Inbox{}, dev, "low_latency combine send kernel");
  dev.timing_end(stream, "low_latency_combine send");
  dev.timing_begin(stream);
}

void low_latency_combine_recv(NvlDevice& dev, const Group& g, const LowLatencyCombineArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  const Shape shape = combine_shape(dev, g, a);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  const Inbox from = inbox(dev, g);
  const size_t smem = combine_recv_shared(a);
  if (a.bf16)
    launch(combine_kernel<__nv_bfloat16, false, true>, low_latency_blocks(), kThreads, smem, stream, CombineSource{},
           combine_target(a), shape, Outbox{}, from, dev, "low_latency combine receive kernel");
  else
    launch(combine_kernel<float, false, true>, low_latency_blocks(), kThreads, smem, stream, CombineSource{},
           combine_target(a), shape, Outbox{}, from, dev, "low_latency combine receive kernel");
  dev.timing_end(stream, "low_latency_combine receive");
}

void low_latency_combine(NvlDevice& dev, const Group& g, const LowLatencyCombineArgs& a, cudaStream_t stream) {
  const Shape shape = combine_shape(dev, g, a);
  run_fused(dev, g, stream, a.bf16 ? combine_kernel<__nv_bfloat16, true, true> : combine_kernel<float, true, true>,
            std::max(combine_send_shared(shape), combine_recv_shared(a)), shape,
            combine_source(a), combine_target(a), "low_latency_combine", [&] {
              low_latency_combine_send(dev, g, a, stream);
              low_latency_combine_recv(dev, g, a, stream);
            });
}

void preload_low_latency_kernels() {
  load_kernels(dispatch_kernel<true, false>, dispatch_kernel<false, true>, dispatch_kernel<true, true>,
               combine_kernel<__nv_bfloat16, true, false>, combine_kernel<__nv_bfloat16, false, true>,
               combine_kernel<float, false, true>, combine_kernel<__nv_bfloat16, true, true>,
               combine_kernel<float, true, true>);
}

}  // namespace uccl_ep::nvl
