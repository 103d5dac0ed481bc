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
// A dispatch region: [counts: int32 per local expert of the receiver, 256-byte aligned][row map][token rows].
// A token goes to each rank once, however many of that rank's experts it chose (at K = 8 of 256 experts on two
// ranks, a quarter of the NVLink bytes of a copy per expert); the receiver fans it out. The row map lists the
// receiver's rows grouped by its local expert, then the sender's token order, as MapEntry (token row, slot =
// token * K + k, the slot's router weight where the dispatch carries them);
// the sender computes every position itself (each warp counts over the routing), so no atomics decide the layout
// and results are deterministic. Token rows: [x | scales], each part 16-byte aligned; with an FP8 cast the
// sender casts x on the way (kernels/fp8.hpp), so x is read once and no FP8 copy of it is made.
// A combine region: [counts][rows]: each y row at its slot on its source (the handle's src_slot), so the source
// reads token t's k-th expert output at row t * K + k without working out the routing again. Over the proxy the
// rows are packed instead (in slot order, packed_position), so a message is one run of bytes, not a write per row.
// Where the dispatch carried the router weights (each map entry holds its slot's), combine sums each token's rows
// on the expert's rank, weighted, and sends one row per (token, rank), to the token's first slot naming one of the
// rank's experts; the counts then count those rows, and the source reads each rank's row at weight 1.
#include <algorithm>
#include <any>
#include <climits>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_fp8.h>

#include "../../proxy/runtime.hpp"
#include "api.hpp"
#include "device_common.cuh"
#include "proxy_path.cuh"
#include "ring_producer.cuh"

namespace uccl_ep::nvl {
namespace {

constexpr int kThreads = 1024;
// Blocks of a send kernel: fixed, because receivers count arrivals by block (UCCL_EP_LL_NUM_SMS sets the
// receive kernels' blocks).
constexpr int kSendBlocks = 128;   // fewer leave SMs idle in the receive phase of a fused op
constexpr int kSendThreads = 512;  // 128 registers a thread: the copy loop keeps its loads in flight unspilled
constexpr int64_t kCombineSegmentBytes = 1024;  // a warp's share of a combined row: two 16-byte vectors a lane

// Where a send kernel writes (by group position).
struct Outbox {
  char* region[kMaxLowLatencyRanks];
  uint64_t* arrivals[kMaxLowLatencyRanks];  // NVLink: the receiver's counter of our blocks
  uint64_t seq[kMaxLowLatencyRanks];
  ProxyOut proxy;
};
// What a receive kernel reads (by group position).
struct Inbox {
  const char* region[kMaxLowLatencyRanks];
  // NVLink: our counter of the sender's blocks; proxy: its released-message word; null: nothing to wait for (our
  // own rows, written by an earlier launch).
  const uint64_t* arrivals[kMaxLowLatencyRanks];
  uint64_t want[kMaxLowLatencyRanks];  // the count that means this op's message is in
  uint64_t seq[kMaxLowLatencyRanks];   // the pair's op count (error reports)
  int rank[kMaxLowLatencyRanks];
  bool packed;  // combine over the proxy: a sender's rows come packed in slot order (packed_position)
};

struct Shape {
  int num_ranks, local_experts, max_tokens;        // R, L, N
  int64_t counts_bytes, row_bytes, capacity_rows;  // region layout: combine rows; dispatch: token rows, map entries
  int64_t tokens_at;                               // dispatch: where the token rows start (after the row map)
  int rank;                                        // this GPU's global rank (error reports)
  uint64_t* phases;                                // UCCL_EP_KERNEL_TIMING=2: SM clock stamps, else null
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

// The whole block: topk_idx into shared `idx`, out-of-range entries -1 (and reported, with `report_bad`). A thread's
// entries are loaded kAtOnce at a time before any is checked or stored (one load after another's store waited for it).
__device__ void load_slots(const int32_t* topk_idx, int pairs, int topk, int num_experts, int* idx, DeviceErrors* err,
                           int rank, bool report_bad) {
  constexpr int kAtOnce = 4;
  const int threads = int(blockDim.x);
  for (int p0 = int(threadIdx.x); p0 < pairs; p0 += kAtOnce * threads) {
    int e[kAtOnce];
#pragma unroll
    for (int i = 0; i < kAtOnce; ++i) e[i] = p0 + i * threads < pairs ? topk_idx[p0 + i * threads] : -1;
#pragma unroll
    for (int i = 0; i < kAtOnce; ++i) {
      const int p = p0 + i * threads;
      if (p >= pairs) break;
      if (e[i] < -1 || e[i] >= num_experts) {
        if (report_bad) report(err, kBadExpertIndex, rank, p / topk, p % topk, e[i]);
        e[i] = -1;
      }
      idx[p] = e[i];
    }
  }
}

// Block 0 only (the whole block): count[e] = the slots of idx ([pairs], -1 unused) that chose expert e.
__device__ void count_by_expert(const int* idx, int pairs, int num_experts, int* count) {
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) count[e] = 0;
  block_sync();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x)
    if (idx[p] >= 0) atomicAdd(&count[idx[p]], 1);
}

// Block 0, after count_by_expert: an expert holds N rows from each rank, which only a token naming it in several
// slots can pass (the host kernels refuse such a call on every rank). Reported here, on the sender, with such a
// token; the rows still go, each receiver keeping what fits its experts' slabs (R * N rows; past it, kOverCapacity).
__device__ void report_rows_past_n(const int* idx, int num_tokens, int topk, int num_experts, int max_tokens,
                                   const int* count, DeviceErrors* err, int rank) {
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    if (count[e] <= max_tokens) continue;
    int token = -1;
    for (int t = 0; t < num_tokens && token < 0; ++t) {
      int named = 0;
      for (int k = 0; k < topk; ++k) named += idx[t * topk + k] == e;
      if (named > 1) token = t;
    }
    report(err, kExpertRowsPastN, rank, int64_t(max_tokens) << 32 | e, count[e], token);
  }
}

// After the block's stores: block 0 writes each target's counts (write_counts(), its threads), then every block
// announces itself to every target: one release fence (ordering all of the block's stores before the adds), then a
// relaxed add to each target's arrival word. On the
// proxy path the blocks count themselves instead (a system fence first: the rows are in host memory the proxy
// reads); returns true in the last block to finish, which then pushes the messages (whole block).
template <class WriteCounts>
__device__ bool finish_send(const Outbox& to, int num_ranks, WriteCounts&& write_counts) {
  if (blockIdx.x == 0) write_counts();
  block_sync();
  if (!to.proxy.ring.slots) {
    if (threadIdx.x == 0) {
      fence_acq_rel_sys();
      for (int d = 0; d < num_ranks; ++d) add_relaxed_sys(to.arrivals[d], 1);
    }
    return false;
  }
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(to.proxy.done, 1u) == gridDim.x - 1;
    if (last) {
      *to.proxy.done = 0;  // for the next launch (stream order)
      __threadfence_system();
    }
  }
  block_sync();
  return last;
}

// Lane s of warp 0 waits for source s's arrival counter, all sources at once (one after another, each poll was a
// round trip); false (on every thread) if one did not come in time. An earlier timeout (error code 5 pending) ends
// the wait at once: the stream is out of step after it.
static_assert(kMaxLowLatencyRanks <= kWarp, "wait_sources gives each source a lane of one warp");
__device__ bool wait_sources(const Inbox& from, int num_ranks, uint64_t timeout_ns, DeviceErrors* err, int rank) {
  __shared__ bool ok;
  if (threadIdx.x < kWarp) {
    const int s = int(threadIdx.x);
    const bool arrived =
        s >= num_ranks || !from.arrivals[s] ||
        wait_flag(from.arrivals[s], from.want[s], int64_t(from.seq[s]), timeout_ns, err, rank, from.rank[s]);
    const bool all = __all_sync(0xffffffffu, arrived);
    if (s == 0) ok = all;
  }
  block_sync();
  return ok;
}

// What the dispatch's send phase reads, and what its receive phase writes.
struct DispatchSource {
  const char* x;
  int64_t in_row_bytes;                // bytes of a row of x as given (float32 / bfloat16 with a cast)
  int64_t x_row_bytes;                 // bytes of a row as sent (hidden with a cast)
  const char* scales;                  // given scales (no cast), else null
  int64_t scale_row_bytes, scales_at;  // scales_at: where the scales start in a token row
  Fp8Cast cast;
  bool x_bf16;
  const int32_t* topk_idx;
  const float* topk_weights;  // or null
  int num_tokens, topk, num_experts;
};
struct DispatchTarget {
  int64_t x_row_bytes, scale_row_bytes, scales_at;
  char* recv_x;
  char* recv_scales;
  int32_t* recv_count;
  int32_t* layout;
  int32_t* src_slot;
  float* recv_weights;
};
// What the combine's send phase reads, and what its receive phase reads and writes.
struct CombineSource {
  const char* y;
  int64_t row_bytes;
  const int32_t* layout;
  const int32_t* src_slot;   // [L, R * N]: where each row of y goes on its source
  const float* row_weights;  // [L, R * N] or null: sum each token's rows here (combine_send_sums)
  int topk;                  // K of the dispatch (decodes src_slot)
};
struct CombineTarget {
  const int32_t* topk_idx;
  const float* topk_weights;
  int num_tokens, topk, num_experts;
  int64_t row_bytes;
  char* out;
};

// A row-map entry: the receiver's token row holding the token, the slot on the source (token * K + k), and the
// slot's router weight (0 where the dispatch carries none).
struct MapEntry {
  int token_row, slot;
  float weight;
  int unused;
};
static_assert(sizeof(MapEntry) == sizeof(int4) && sizeof(MapEntry) == kMapEntryBytes,
              "a map entry is one 16-byte load");

// A token's trip to one rank: which token, to which rank, into which of that rank's token rows.
struct TokenTrip {
  int token, rank, row, unused;
};

// One warp, for slot p of the routing `idx` (shared, [T * K], -1 where unused) with expert e on rank d: where its
// entry goes in d's row map (the slots for d's experts below e, then the earlier slots for e), which of d's token
// rows holds the token (the earlier tokens that chose any expert of d) and whether an earlier slot of the same
// token already sends it to d. Every lane counts a share of the tokens; no shared counters, no block barrier.
struct SlotPlace {
  int entry, row;
  bool first_to_rank;
};
__device__ SlotPlace place_slot(const int* idx, int num_tokens, int topk, int p, int e, int local, int lane) {
  const int lo = e / local * local, hi = lo + local, t = p / topk;
  int entry = 0, row = 0, earlier_here = 0;
  for (int u = lane; u < num_tokens; u += kWarp) {
    bool to_rank = false;
    for (int k = 0; k < topk; ++k) {
      const int q = u * topk + k, v = idx[q];
      entry += (v >= lo && v < e) || (v == e && q < p);
      to_rank |= v >= lo && v < hi;
      earlier_here += u == t && q < p && v >= lo && v < hi;
    }
    row += to_rank && u < t;
  }
  for (int d = kWarp / 2; d > 0; d /= 2) {
    entry += __shfl_xor_sync(0xffffffffu, entry, d);
    row += __shfl_xor_sync(0xffffffffu, row, d);
    earlier_here += __shfl_xor_sync(0xffffffffu, earlier_here, d);
  }
  return {entry, row, earlier_here == 0};
}

// 8 channels of T (bfloat16 or float32) a lane, as float32.
template <typename T>
struct Channels8;
template <>
struct Channels8<__nv_bfloat16> {
  int4 raw;
  __device__ void load(const char* p) { raw = __ldg(reinterpret_cast<const int4*>(p)); }
  __device__ float get(int i) const { return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(&raw)[i]); }
};
template <>
struct Channels8<float> {
  float4 raw[2];
  __device__ void load(const char* p) {
    raw[0] = __ldg(reinterpret_cast<const float4*>(p));
    raw[1] = __ldg(reinterpret_cast<const float4*>(p) + 1);
  }
  __device__ float get(int i) const { return reinterpret_cast<const float*>(raw)[i]; }
};

// One warp casts 256-channel steps [step0, step1) of a token row x (T: bfloat16 or float32) to FP8 into `out`
// (hidden bytes) with a float32 scale per 128 channels into `scales`: lanes 0-15 take a step's first block, 16-31
// its second, 8 channels a lane; each half finds its block's amax by shuffles. kBatch steps' loads are issued
// before any is converted.
template <typename T>
__device__ void warp_cast_fp8(const char* x, int hidden, int step0, int step1, Fp8Cast cast, char* out, float* scales,
                              int lane) {
  constexpr int kBatch = 4;
  const int blocks = hidden / kFp8Block;
  for (int base = step0; base < step1; base += kBatch) {
    Channels8<T> v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int block = 2 * (base + b) + lane / 16;
      if (base + b < step1 && block < blocks) v[b].load(x + int64_t((base + b) * 256 + lane * 8) * sizeof(T));
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int block = 2 * (base + b) + lane / 16;
      const bool active = base + b < step1 && block < blocks;
      float amax = 0.f;
      if (active)
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = nan_max(amax, fabsf(v[b].get(i)));
      for (int d = 8; d > 0; d /= 2) amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, d));
      if (!active) continue;
      const float scale = fp8_scale(amax, cast), inverse = 1.f / scale;
      uint2 packed;
      uint16_t* pairs = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        pairs[i] = __nv_cvt_float2_to_fp8x2(make_float2(v[b].get(2 * i) * inverse, v[b].get(2 * i + 1) * inverse),
                                            __NV_SATFINITE, __NV_E4M3);
      *reinterpret_cast<uint2*>(out + (base + b) * 256 + lane * 8) = packed;
      if (lane % 16 == 0) scales[block] = scale;
    }
  }
}

// The last send block of an op on the proxy path (whole block): the messages of every other member. Over the
// proxy a message is a run of writes: only the pieces of a region that hold something go.

// Dispatch: member d's counts and row-map entries (one piece from the region's start), then its token rows.
__device__ void push_dispatch_messages(const DispatchSource& in, const Shape& shape, const ProxyOut& p, const int* idx,
                                       DeviceErrors* err) {
  __shared__ int entries[kMaxLowLatencyRanks], rows[kMaxLowLatencyRanks];
  const int R = shape.num_ranks, local = shape.local_experts;
  for (int d = threadIdx.x; d < R; d += blockDim.x) entries[d] = rows[d] = 0;
  block_sync();
  for (int t = threadIdx.x; t < in.num_tokens; t += blockDim.x) {
    unsigned to_rank = 0;
    for (int k = 0; k < in.topk; ++k) {
      const int e = idx[t * in.topk + k];
      if (e < 0) continue;
      atomicAdd(&entries[e / local], 1);
      to_rank |= 1u << (e / local);
    }
    for (int d = 0; d < R; ++d)
      if (to_rank >> d & 1) atomicAdd(&rows[d], 1);
  }
  block_sync();
  if (threadIdx.x < kWarp)
    push_messages(p, R, shape.rank, err, [&](int d, int piece, uint64_t& begin, uint64_t& bytes) {
      if (piece > 1) return false;
      begin = piece == 0 ? 0 : uint64_t(shape.tokens_at);
      bytes = piece == 0 ? uint64_t(shape.counts_bytes) + uint64_t(entries[d]) * sizeof(MapEntry)
                         : uint64_t(rows[d]) * uint64_t(shape.row_bytes);
      return true;
    });
}

// Combine: member s's counts and its `sent[s]` rows, packed in slot order after them (packed_position): one piece.
__device__ void push_combine_messages(const Shape& shape, const ProxyOut& p, const int* sent, DeviceErrors* err) {
  if (threadIdx.x < kWarp)
    push_messages(p, shape.num_ranks, shape.rank, err, [&](int s, int piece, uint64_t& begin, uint64_t& bytes) {
      begin = 0;
      bytes = uint64_t(shape.counts_bytes) + uint64_t(sent[s]) * uint64_t(shape.row_bytes);
      return piece == 0;
    });
}

// Combine over the proxy (one warp, every lane): where the row of source s with slot j goes in s's message: after
// s's rows with a lower slot, so the message is one run of rows; the source finds the same place from its routing
// (the slots below j that chose an expert of this rank). from_source[s * (L + 1) + l]: s's rows of experts < l.
__device__ int64_t packed_position(const CombineSource& in, const Shape& shape, const int* begin,
                                   const int* from_source, int s, int64_t j, int lane) {
  const int R = shape.num_ranks, L = shape.local_experts;
  const int64_t slab = int64_t(R) * shape.max_tokens;
  const int* prefix = from_source + s * (L + 1);
  int below = 0;
  for (int i = lane; i < prefix[L]; i += kWarp) {
    const int l = group_of(prefix, L, i);  // the expert: the last l with prefix[l] <= i
    below += in.src_slot[int64_t(l) * slab + begin[l * R + s] + (i - prefix[l])] < j;
  }
  for (int d = kWarp / 2; d > 0; d /= 2) below += __shfl_xor_sync(0xffffffffu, below, d);
  return below;
}

// Each phase below is a whole-block device function over the kernel's dynamic shared memory `smem`; a kernel runs
// one phase (split calls) or both (send, then receive: one launch per op).

// Block b sends tokens [b * per_block, (b + 1) * per_block): first every warp places slots of those tokens (one
// warp a slot: its row-map entry goes out at once, and the token's first slot for each rank records a trip), then
// the block's warps share the trips, each taking a piece of a row, so all warps copy however few trips there are.
__device__ void dispatch_send(const DispatchSource& in, const Shape& shape, const Outbox& to, DeviceErrors* err,
                              int* smem) {
  const int pairs = in.num_tokens * in.topk, local = shape.local_experts;
  const int per_block = (in.num_tokens + gridDim.x - 1) / gridDim.x;
  const int t0 = min(in.num_tokens, int(blockIdx.x) * per_block), t1 = min(in.num_tokens, t0 + per_block);
  TokenTrip* trips = reinterpret_cast<TokenTrip*>(smem);  // [per_block * R]
  int* idx = reinterpret_cast<int*>(trips + per_block * shape.num_ranks);
  int* count = idx + pairs;  // [num_experts] (block 0): slots per expert, the receivers' counts
  __shared__ int num_trips;
  stamp(shape, kDispatchSend, 0);
  if (threadIdx.x == 0) num_trips = 0;
  load_slots(in.topk_idx, pairs, in.topk, in.num_experts, idx, err, shape.rank, blockIdx.x == 0);
  block_sync();

  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  for (int p = t0 * in.topk + warp; p < t1 * in.topk; p += warps) {
    const int e = idx[p];
    if (e < 0) continue;
    const SlotPlace at = place_slot(idx, in.num_tokens, in.topk, p, e, local, lane);
    if (lane != 0 || at.entry >= shape.capacity_rows) continue;  // the host refused shapes where it can happen
    const int d = e / local;
    const float weight = in.topk_weights ? in.topk_weights[p] : 0.f;
    reinterpret_cast<int4*>(to.region[d] + shape.counts_bytes)[at.entry] =
        make_int4(at.row, p, __float_as_int(weight), 0);
    if (at.first_to_rank) trips[atomicAdd(&num_trips, 1)] = TokenTrip{p / in.topk, d, at.row, 0};
  }
  block_sync();
  stamp(shape, kDispatchSend, 1);

  // Pieces per trip: enough for every warp, each at least a 256-channel step (cast) or 512 bytes (copy).
  const int n = num_trips;
  const bool cast = in.cast != Fp8Cast::kNone;
  const int steps = cast ? int((in.x_row_bytes + 255) / 256) : int((in.x_row_bytes + 511) / 512);
  const int pieces = n == 0 ? 1 : max(1, min(steps, warps / n));
  for (int w = warp; w < n * pieces; w += warps) {
    const TokenTrip trip = trips[w / pieces];
    const int piece = w % pieces, s0 = steps * piece / pieces, s1 = steps * (piece + 1) / pieces;
    char* row = to.region[trip.rank] + shape.tokens_at + int64_t(trip.row) * shape.row_bytes;
    const char* src = in.x + int64_t(trip.token) * in.in_row_bytes;
    if (cast) {
      float* scales = reinterpret_cast<float*>(row + in.scales_at);
      if (in.x_bf16)
        warp_cast_fp8<__nv_bfloat16>(src, int(in.x_row_bytes), s0, s1, in.cast, row, scales, lane);
      else
        warp_cast_fp8<float>(src, int(in.x_row_bytes), s0, s1, in.cast, row, scales, lane);
    } else {
      const int64_t b0 = min(in.x_row_bytes, int64_t(s0) * 512), b1 = min(in.x_row_bytes, int64_t(s1) * 512);
      warp_copy(row + b0, src + b0, b1 - b0, lane);
      if (piece == 0 && in.scale_row_bytes)
        warp_copy(row + in.scales_at, in.scales + int64_t(trip.token) * in.scale_row_bytes, in.scale_row_bytes, lane);
    }
  }
  stamp(shape, kDispatchSend, 2);
  if (blockIdx.x == 0) {  // the receivers' counts, while the block's stores drain (not before the copies)
    count_by_expert(idx, pairs, in.num_experts, count);
    block_sync();
    report_rows_past_n(idx, in.num_tokens, in.topk, in.num_experts, shape.max_tokens, count, err, shape.rank);
  }
  const bool last = finish_send(to, shape.num_ranks, [&] {
    for (int i = threadIdx.x; i < in.num_experts; i += blockDim.x)
      reinterpret_cast<int*>(to.region[i / local])[i % local] = count[i];
  });
  if (last) push_dispatch_messages(in, shape, to.proxy, idx, err);
  stamp(shape, kDispatchSend, 3);
}

__device__ void dispatch_recv(const DispatchTarget& out, const Shape& shape, const Inbox& from, uint64_t timeout_ns,
                              DeviceErrors* err, int* smem) {
  const int R = shape.num_ranks, L = shape.local_experts;
  const int64_t slab = int64_t(R) * shape.max_tokens;  // rows per local expert
  int* count = smem;                                   // [s * L + l]
  int* offset = count + R * L;  // [l * R + s]: where source s's rows of expert l start in recv_x[l]
  int* first = offset + R * L;  // [s * L + l]: where they start in source s's row map
  int* total = first + R * L;   // [l]
  int* rows_from = total + L;   // [R + 1]: prefix of each source's rows
  stamp(shape, kDispatchRecv, 0);
  if (!wait_sources(from, R, timeout_ns, err, shape.rank)) return;
  stamp(shape, kDispatchRecv, 1);
  for (int i = threadIdx.x; i < R * L; i += blockDim.x)
    count[i] = __ldcg(reinterpret_cast<const int*>(from.region[i / L]) + i % L);
  block_sync();
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
      if (acc > slab) report(err, kOverCapacity, shape.rank, acc, slab, 0);
    }
  }
  const int warp = threadIdx.x / kWarp;
  if (warp < R) {  // source `warp`: where each expert's rows start in its map, its rows, then the prefix over sources
    const int rows = warp_exclusive_scan(
        L, [&](int l) { return count[warp * L + l]; }, [&](int l, int v) { first[warp * L + l] = v; });
    if (threadIdx.x % kWarp == 0) rows_from[warp + 1] = rows;
  }
  block_sync();
  if (threadIdx.x == 0) {
    rows_from[0] = 0;
    for (int s = 0; s < R; ++s) rows_from[s + 1] += rows_from[s];
  }
  block_sync();

  stamp(shape, kDispatchRecv, 2);
  // One warp a row: its expert and position follow from the counts; the map names the token row and the slot.
  const int lane = threadIdx.x % kWarp, warps_per_block = blockDim.x / kWarp;
  for (int i = blockIdx.x * warps_per_block + threadIdx.x / kWarp; i < rows_from[R]; i += gridDim.x * warps_per_block) {
    int s = 0;
    while (i >= rows_from[s + 1]) ++s;
    const int r = i - rows_from[s];
    if (r >= shape.capacity_rows) continue;  // the sender refused such shapes already
    int4 entry = make_int4(0, 0, 0, 0);
    if (lane == 0) entry = __ldcg(reinterpret_cast<const int4*>(from.region[s] + shape.counts_bytes) + r);
    const int token_row = __shfl_sync(0xffffffffu, entry.x, 0), slot = __shfl_sync(0xffffffffu, entry.y, 0);
    // The expert: the last l whose rows start at or before r.
    const int l = group_of(first + s * L, L, r), j = r - first[s * L + l];
    if (token_row < 0 || token_row >= shape.max_tokens || slot < 0) {  // not what a sender of ours writes
      if (lane == 0) report(err, kUnknownRowSource, shape.rank, from.rank[s], token_row, slot);
      continue;
    }
    if (offset[l * R + s] + j >= slab) continue;  // past the capacity: reported above
    const int64_t o = int64_t(l) * slab + offset[l * R + s] + j;
    const char* row = from.region[s] + shape.tokens_at + int64_t(token_row) * shape.row_bytes;
    warp_copy<Load::kCoherent>(out.recv_x + o * out.x_row_bytes, row, out.x_row_bytes, lane);
    if (out.scale_row_bytes)
      warp_copy<Load::kCoherent>(out.recv_scales + o * out.scale_row_bytes, row + out.scales_at, out.scale_row_bytes,
                                 lane);
    if (lane == 0) {
      out.src_slot[o] = slot;
      out.recv_weights[o] = __int_as_float(entry.z);
    }
  }
  stamp(shape, kDispatchRecv, 3);
  // Padding rows: no source token (their data is not written).
  for (int64_t o = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; o < int64_t(L) * slab;
       o += int64_t(gridDim.x) * blockDim.x)
    if (o % slab >= total[o / slab]) {
      out.src_slot[o] = -1;
      out.recv_weights[o] = 0.f;
    }
  stamp(shape, kDispatchRecv, 4);
}

// A warp's share of a 1 KiB segment of up to kRowsInFlight rows (null: none): each lane loads its vectors of every
// row before it adds any (one row at a time leaves the loads latency-bound), then adds them weighted into acc.
constexpr int kSegmentVecs = kCombineSegmentBytes / 16 / kWarp;
template <typename T, int kRowsInFlight, Load kLoad>
__device__ __forceinline__ void add_rows(float (&acc)[kSegmentVecs][Vec<T>::kN],
                                         const int4* const (&rows)[kRowsInFlight], const float (&weight)[kRowsInFlight],
                                         int64_t v0, int64_t row_vecs) {
  int4 v[kRowsInFlight][kSegmentVecs];
#pragma unroll
  for (int r = 0; r < kRowsInFlight; ++r)
#pragma unroll
    for (int u = 0; u < kSegmentVecs; ++u)
      if (rows[r] && v0 + u * kWarp < row_vecs) v[r][u] = load16<kLoad>(rows[r] + v0 + u * kWarp);
#pragma unroll
  for (int r = 0; r < kRowsInFlight; ++r)
#pragma unroll
    for (int u = 0; u < kSegmentVecs; ++u)
      if (rows[r] && v0 + u * kWarp < row_vecs) Vec<T>::add(acc[u], v[r][u], weight[r]);
}

// Where the dispatch carried the router weights (in.row_weights): each token's rows here, weighted and summed in
// float32, go back as one row of T to the token's first slot naming one of this rank's experts, the rows of
// kRowsInFlight slots loaded before any is added. Every block finds each (source, token)'s first slot here and that
// slot's expert (first_k: k * kFirstSlot + l, kNoSlot where none), then counts the rows it sends each source by that
// expert (sums[l * R + s], the counts the source checks); a block sends the tokens of its share of the R * N, whose
// rows it notes in rows_of.
constexpr int kFirstSlot = 1 << 16;  // first_k's slot unit: local experts < 65536
constexpr int kNoSlot = INT_MAX;
template <typename T, int kRowsInFlight>
__device__ void combine_send_sums(const CombineSource& in, const Shape& shape, const Outbox& to, const int* rows,
                                  const int* begin, const int* cum, int all_rows, int* sums, int* first_k, int* rows_of,
                                  DeviceErrors* err) {
  const int R = shape.num_ranks, L = shape.local_experts, N = shape.max_tokens, K = in.topk;
  const int64_t slab = int64_t(R) * N;
  const int tokens = R * N, per_block = (tokens + gridDim.x - 1) / gridDim.x;
  const int p0 = min(tokens, int(blockIdx.x) * per_block), p1 = min(tokens, p0 + per_block);
  const bool proxy = to.proxy.ring.slots != nullptr;
  for (int i = threadIdx.x; i < tokens; i += blockDim.x) first_k[i] = kNoSlot;
  for (int i = threadIdx.x; i < (p1 - p0) * K; i += blockDim.x) rows_of[i] = -1;
  for (int i = threadIdx.x; i < L * R; i += blockDim.x) sums[i] = 0;
  block_sync();
  // Row i of y's rows: its (source, token) p and slot k, or false where the handle names no slot (block 0 reports
  // it; the first report is the one kept).
  auto decode = [&](int i, int& p, int& k, int64_t& o, int& l, int& s) {
    l = group_of(cum, L, i);
    const int r = i - cum[l];
    s = 0;
    while (s < R - 1 && r >= begin[l * R + s] + rows[l * R + s]) ++s;
    o = int64_t(l) * slab + r;
    const int j = in.src_slot[o];
    if (j < 0 || j >= N * K) {
      if (blockIdx.x == 0) report(err, kNoSourceSlot, shape.rank, l, r, j);
      return false;
    }
    p = s * N + j / K;
    k = j % K;
    return true;
  };
  for (int i = threadIdx.x; i < all_rows; i += blockDim.x) {
    int p, k, l, s;
    int64_t o;
    if (!decode(i, p, k, o, l, s)) continue;
    atomicMin(&first_k[p], k * kFirstSlot + l);
    if (p >= p0 && p < p1) rows_of[(p - p0) * K + k] = int(o);
  }
  block_sync();
  for (int p = threadIdx.x; p < tokens; p += blockDim.x)
    if (first_k[p] != kNoSlot) atomicAdd(&sums[(first_k[p] % kFirstSlot) * R + p / N], 1);
  block_sync();

  const int lane = threadIdx.x % kWarp, warps = blockDim.x / kWarp;
  const int64_t row_vecs = in.row_bytes / 16;
  const int64_t segments = (in.row_bytes + kCombineSegmentBytes - 1) / kCombineSegmentBytes;
  for (int64_t w = threadIdx.x / kWarp; w < int64_t(p1 - p0) * segments; w += warps) {
    const int q = int(w / segments), p = p0 + q;
    if (first_k[p] == kNoSlot) continue;  // nothing of this token here
    const int k0 = first_k[p] / kFirstSlot;
    const int s = p / N, t = p % N;
    const int64_t v0 = (w % segments) * kCombineSegmentBytes / 16 + lane;
    float acc[kSegmentVecs][Vec<T>::kN] = {};
    for (int k1 = k0; k1 < K; k1 += kRowsInFlight) {
      const int4* rows[kRowsInFlight];
      float weight[kRowsInFlight];
#pragma unroll
      for (int r = 0; r < kRowsInFlight; ++r) {
        const int k = k1 + r, o = k < K ? rows_of[q * K + k] : -1;
        rows[r] = o >= 0 ? reinterpret_cast<const int4*>(in.y + int64_t(o) * in.row_bytes) : nullptr;
        weight[r] = o >= 0 ? in.row_weights[o] : 0.f;
      }
      add_rows<T, kRowsInFlight, Load::kReadOnly>(acc, rows, weight, v0, row_vecs);
    }
    int64_t at = int64_t(t) * K + k0;
    if (proxy) {  // packed: after the source's earlier tokens that have a row here (the source's position scan)
      int below = 0;
      for (int u = lane; u < t; u += kWarp) below += first_k[s * N + u] != kNoSlot;
      for (int d = kWarp / 2; d > 0; d /= 2) below += __shfl_xor_sync(0xffffffffu, below, d);
      at = below;
    }
    int4* dst = reinterpret_cast<int4*>(to.region[s] + shape.counts_bytes + at * shape.row_bytes);
#pragma unroll
    for (int u = 0; u < kSegmentVecs; ++u)
      if (v0 + u * kWarp < row_vecs) dst[v0 + u * kWarp] = Vec<T>::pack(acc[u]);
  }
}

template <typename T>
__device__ void combine_send(const CombineSource& in, const Shape& shape, const Outbox& to, DeviceErrors* err,
                             int* smem) {
  const int R = shape.num_ranks, L = shape.local_experts;
  const int64_t slab = int64_t(R) * shape.max_tokens;
  const bool proxy = to.proxy.ring.slots != nullptr, sums_here = in.row_weights != nullptr;
  int* rows = smem;              // [l * R + s]: the handle's layout
  int* begin = rows + R * L;     // [l * R + s]: where source s's rows start in y[l]
  int* cum = begin + R * L;      // [L + 1]: prefix of rows per expert
  int* in_expert = cum + L + 1;  // [L]: rows of expert l
  int* sent = in_expert + L;     // [R]: rows sent to each source (its message, on the proxy path)
  int* from_source = sent + R;   // proxy path: [s * (L + 1) + l], source s's rows of experts < l
  int* sums = from_source + (proxy ? R * (L + 1) : 0);  // sums_here: [l * R + s], combine_send_sums
  int* first_k = sums + R * L;                          // sums_here: [R * N]
  int* rows_of = first_k + R * shape.max_tokens;        // sums_here: [a block's tokens * K]
  __shared__ bool valid;
  stamp(shape, kCombineSend, 0);
  if (threadIdx.x == 0) valid = true;
  for (int i = threadIdx.x; i < R * L; i += blockDim.x) rows[i] = max(0, in.layout[i]);
  block_sync();
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int in_l = 0;
    for (int s = 0; s < R; ++s) {
      begin[l * R + s] = in_l;
      in_l += rows[l * R + s];
    }
    in_expert[l] = in_l;
    if (in_l > slab) valid = false;
  }
  if (proxy && !sums_here)
    for (int src = threadIdx.x; src < R; src += blockDim.x) {
      int acc = 0;
      for (int l = 0; l < L; ++l) {
        from_source[src * (L + 1) + l] = acc;
        acc += rows[l * R + src];
      }
      from_source[src * (L + 1) + L] = acc;
    }
  block_sync();
  if (threadIdx.x < kWarp) {
    const int all = warp_exclusive_scan(L, [&](int l) { return in_expert[l]; }, [&](int l, int v) { cum[l] = v; });
    if (threadIdx.x == 0) {
      cum[L] = all;
      if (!valid && blockIdx.x == 0) report(err, kHandleDisagreesWithY, shape.rank, all, int64_t(L) * slab, 0);
    }
  }
  block_sync();

  stamp(shape, kCombineSend, 1);
  const int lane = threadIdx.x % kWarp, warps_per_block = blockDim.x / kWarp;
  const int all_rows = valid ? cum[L] : 0;
  if (sums_here) {
    combine_send_sums<T, 4>(in, shape, to, rows, begin, cum, all_rows, sums, first_k, rows_of, err);
  } else {
    for (int i = blockIdx.x * warps_per_block + threadIdx.x / kWarp; i < all_rows; i += gridDim.x * warps_per_block) {
      const int l = group_of(cum, L, i), r = i - cum[l];  // the expert: the last l with cum[l] <= i
      int s = 0;
      while (r >= begin[l * R + s] + rows[l * R + s]) ++s;
      const int64_t j = in.src_slot[int64_t(l) * slab + r];
      if (j < 0 || j >= shape.capacity_rows) {  // the layout counts a row the dispatch did not deliver here
        if (lane == 0) report(err, kNoSourceSlot, shape.rank, l, r, j);
        continue;
      }
      const int64_t at = proxy ? packed_position(in, shape, begin, from_source, s, j, lane) : j;
      warp_copy(to.region[s] + shape.counts_bytes + at * shape.row_bytes, in.y + (int64_t(l) * slab + r) * in.row_bytes,
                in.row_bytes, lane);
    }
  }
  stamp(shape, kCombineSend, 2);
  // The counts each source checks: the rows sent it, by local expert (where sums go, the expert of the token's
  // first slot here).
  const int* counted = sums_here ? sums : rows;
  for (int s = threadIdx.x; s < R; s += blockDim.x) {
    int n = 0;
    for (int l = 0; l < L && valid; ++l) n += counted[l * R + s];
    sent[s] = n;
  }
  const bool last = finish_send(to, R, [&] {
    for (int i = threadIdx.x; i < R * L; i += blockDim.x)
      reinterpret_cast<int*>(to.region[i / L])[i % L] = valid ? counted[(i % L) * R + i / L] : 0;
  });
  if (last) push_combine_messages(shape, to.proxy, sent, err);
  stamp(shape, kCombineSend, 3);
}

// (token, 1 KiB segment) work items: each lane sums two 16-byte vectors of every selected expert's row, weighted,
// in float32, kRowsInFlight rows at a time (add_rows; 4 rows fit the registers of 512-thread blocks, 2 those of
// 1024-thread ones).
template <typename T, int kRowsInFlight>
__device__ void combine_recv(const CombineTarget& out, const Shape& shape, const Inbox& from, uint64_t timeout_ns,
                             DeviceErrors* err, int* smem) {
  const int pairs = out.num_tokens * out.topk, L = shape.local_experts, topk = out.topk;
  int* idx = smem;                          // [pairs]: topk_idx, -1 where unused or out of range
  int* count = idx + pairs;                 // [num_experts] (block 0): slots per expert, for the stale-handle check
  int* position = count + out.num_experts;  // packed: [pairs], the slot's row in its expert's rank's message
  stamp(shape, kCombineRecv, 0);
  load_slots(out.topk_idx, pairs, topk, out.num_experts, idx, err, shape.rank, blockIdx.x == 0);
  block_sync();
  if (from.packed && threadIdx.x / kWarp < shape.num_ranks) {  // warp d: the slots that chose an expert of rank d
    const int d = threadIdx.x / kWarp;
    auto to_d = [&](int i) { return int(idx[i] >= 0 && idx[i] / L == d); };
    warp_exclusive_scan(pairs, to_d, [&](int i, int v) {
      if (to_d(i)) position[i] = v;
    });
  }
  block_sync();
  if (blockIdx.x == 0) count_by_expert(idx, pairs, out.num_experts, count);
  block_sync();
  stamp(shape, kCombineRecv, 1);
  if (!wait_sources(from, shape.num_ranks, timeout_ns, err, shape.rank)) return;
  stamp(shape, kCombineRecv, 2);

  const int lane = threadIdx.x % kWarp, warps_per_block = blockDim.x / kWarp;
  const int64_t row_vecs = out.row_bytes / 16;
  const int64_t segments = (out.row_bytes + kCombineSegmentBytes - 1) / kCombineSegmentBytes;
  for (int64_t w = blockIdx.x * warps_per_block + threadIdx.x / kWarp; w < int64_t(out.num_tokens) * segments;
       w += int64_t(gridDim.x) * warps_per_block) {
    const int t = int(w / segments);
    const int64_t v0 = (w % segments) * kCombineSegmentBytes / 16 + lane;
    float acc[kSegmentVecs][Vec<T>::kN] = {};
    for (int k0 = 0; k0 < topk; k0 += kRowsInFlight) {
      const int4* rows[kRowsInFlight];
      float weight[kRowsInFlight];
#pragma unroll
      for (int r = 0; r < kRowsInFlight; ++r) {
        const int k = k0 + r, e = k < topk ? idx[t * topk + k] : -1;
        int64_t j = int64_t(t) * topk + k;  // the row's slot: where the expert's rank put it (or packed)
        const bool used = e >= 0 && j < shape.capacity_rows;
        if (from.packed && used) j = position[t * topk + k];
        weight[r] = used ? out.topk_weights[t * topk + k] : 0.f;
        rows[r] = used ? reinterpret_cast<const int4*>(from.region[e / L] + shape.counts_bytes + j * shape.row_bytes)
                       : nullptr;
      }
      add_rows<T, kRowsInFlight, Load::kCoherent>(acc, rows, weight, v0, row_vecs);
    }
    int4* dst = reinterpret_cast<int4*>(out.out + int64_t(t) * out.row_bytes);
#pragma unroll
    for (int u = 0; u < kSegmentVecs; ++u)
      if (v0 + u * kWarp < row_vecs) dst[v0 + u * kWarp] = Vec<T>::pack(acc[u]);
  }
  // The stale-handle check after block 0's sums, so that its load does not hold back the block's first rows.
  for (int e = threadIdx.x; e < out.num_experts && blockIdx.x == 0; e += blockDim.x) {
    const int got = __ldcg(reinterpret_cast<const int*>(from.region[e / L]) + e % L);
    if (got != count[e]) report(err, kLowLatencyRowCount, shape.rank, got, e % L, from.rank[e / L]);
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
// T: the rows' type (the send phase reads it where it sums a token's rows).
template <typename T>
struct CombinePhases {
  using In = CombineSource;
  using Out = CombineTarget;
  template <bool kFused>
  __device__ static void send(const In& in, const Shape& shape, const Outbox& to, DeviceErrors* err, int* smem) {
    combine_send<T>(in, shape, to, err, smem);
  }
  template <bool kFused>
  __device__ static void recv(const Out& out, const Shape& shape, const Inbox& from, uint64_t timeout_ns,
                              DeviceErrors* err, int* smem) {
    combine_recv<T, kFused ? 4 : 2>(out, shape, from, timeout_ns, err, smem);
  }
};

// One launch of an op's send phase, receive phase, or both (fused: the receive reuses the shared memory).
template <class Phases, bool kSend, bool kRecv>
__global__ void __launch_bounds__(kMaxThreads<kSend, kRecv>, 1)
    phase_kernel(typename Phases::In in, typename Phases::Out out, Shape shape, Outbox to, Inbox from,
                 uint64_t timeout_ns, DeviceErrors* err) {
  extern __shared__ int smem[];
  if constexpr (kSend) Phases::template send<kRecv>(in, shape, to, err, smem);
  if constexpr (kSend && kRecv) block_sync();
  if constexpr (kRecv) Phases::template recv<kSend>(out, shape, from, timeout_ns, err, smem);
}
template <bool kSend, bool kRecv>
constexpr auto dispatch_kernel = phase_kernel<DispatchPhases, kSend, kRecv>;
template <typename T, bool kSend, bool kRecv>
constexpr auto combine_kernel = phase_kernel<CombinePhases<T>, kSend, kRecv>;

// Where an op's low-latency regions live: the NVLink buffers (NvlDevice) or the proxy runtime's registered buffer
// (Device, GPUs on several nodes). Each gives a sender's region bytes and what to tell a caller whose shapes need more.
int64_t region_stride(const NvlDevice& dev) { return int64_t(dev.low_latency_stride()); }
int64_t region_stride(const uccl_ep::Device& dev) { return int64_t(dev.region_bytes()); }
uint64_t* phase_words(const NvlDevice& dev) { return dev.phases_device(); }
uint64_t* phase_words(const uccl_ep::Device&) { return nullptr; }
void check_area(const NvlDevice& dev, const Group& g, const char* op) {
  check_group(dev, g, op);
  if (dev.low_latency_stride() == 0)
    throw std::invalid_argument(std::string("uccl_ep ") + op +
                                ": no low-latency buffer; initialize with low_latency_buffer_bytes > 0");
}
void check_area(const uccl_ep::Device& dev, const Group& g, const char* op) {
  if (g.size > kMaxLowLatencyRanks)
    throw std::invalid_argument(std::string("uccl_ep ") + op + ": GPU-initiated low-latency groups hold at most " +
                                std::to_string(kMaxLowLatencyRanks) +
                                " ranks (UCCL_EP_GPU_INITIATED=0 stages through the host)");
  for (int s = 0; s < g.size; ++s)
    if (g.ranks[s] < 0 || uint32_t(g.ranks[s]) >= dev.num_ranks())
      throw std::invalid_argument(std::string("uccl_ep ") + op + ": group member " + std::to_string(g.ranks[s]) +
                                  " is not a rank of the runtime");
  if (uint32_t(g.ranks[g.self]) != dev.rank()) throw std::logic_error("uccl_ep: group does not hold this rank");
}
std::string bytes_advice(const uccl_ep::Device& dev, int64_t need_per_sender) {
  return "a region of the proxy buffer holds " + std::to_string(dev.region_bytes()) + " bytes, these shapes need " +
         std::to_string(need_per_sender) + "; set UCCL_EP_BUFFER_BYTES >= " +
         std::to_string(buffer_bytes_for_region(uint64_t(need_per_sender), dev.num_ranks())) +
         " (jax_uccl_ep.proxy_buffer_bytes gives it for a job's shapes)";
}

template <class Dev>
Shape shape_of(const Dev& dev, const Group& g, int num_experts, int max_tokens, int64_t row_bytes, const char* op) {
  check_area(dev, g, op);
  if (num_experts % g.size != 0)
    throw std::invalid_argument(std::string("uccl_ep ") + op + ": num_experts must be divisible by the group size");
  Shape s;
  s.num_ranks = g.size;
  s.local_experts = num_experts / g.size;
  s.max_tokens = max_tokens;
  s.counts_bytes = counts_bytes(s.local_experts);
  s.row_bytes = row_bytes;
  s.capacity_rows = std::max<int64_t>(0, (region_stride(dev) - s.counts_bytes) / row_bytes);
  s.tokens_at = 0;
  s.rank = int(dev.rank());
  s.phases = phase_words(dev);
  return s;
}

// Shared memory of a kernel; above the default 48 KiB it must be allowed first.
template <class Kernel>
size_t shared_bytes(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
          "cudaFuncSetAttribute (shared memory; fewer tokens or experts per call)");
  return bytes;
}

// The cuda device an op's kernels run on.
int cuda_device_of(const NvlDevice& dev) { return dev.cuda_device(); }
int cuda_device_of(const uccl_ep::Device& dev) { return dev.ordinal(); }

// Refuses shapes whose kernels need more shared memory a block than the GPU gives (the opt-in limit less the
// kernel's static shared memory), before anything moves: every rank has the same shapes, so every rank refuses,
// where the launch would fail on some ranks after their counters moved.
template <class Kernel>
void check_shared(Kernel kernel, size_t bytes, int cuda_device, const char* op, const std::string& grows_with) {
  if (bytes <= 32 * 1024) return;  // every GPU these kernels build for gives a block more
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> limits;  // the driver's answer, per kernel and GPU
  size_t limit = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), cuda_device);
    auto it = limits.find(key);
    if (it == limits.end()) {
      int optin = 0;
      check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, cuda_device),
            "cudaDeviceGetAttribute");
      cudaFuncAttributes attributes{};
      check(cudaFuncGetAttributes(&attributes, kernel), "cudaFuncGetAttributes");
      it = limits.emplace(key, size_t(optin) - attributes.sharedSizeBytes).first;
    }
    limit = it->second;
  }
  if (bytes > limit)
    throw std::invalid_argument(std::string("uccl_ep ") + op + ": these shapes need " + std::to_string(bytes) +
                                " bytes of shared memory a block, more than the " + std::to_string(limit) +
                                " this GPU gives (it grows with " + grows_with +
                                "); call with fewer tokens (max_tokens_per_rank) or experts");
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
    from.want[s] = seq * kSendBlocks;
    from.seq[s] = seq;
    from.rank[s] = p;
  }
  return from;
}

std::string bytes_advice(const NvlDevice& dev, int64_t need_per_sender) {
  const size_t need = size_t(2) * dev.num_ranks() * ((need_per_sender + 255) / 256 * 256);
  return "the low-latency buffer holds " + std::to_string(dev.low_latency_stride()) + " bytes per sender, these " +
         "shapes need " + std::to_string(need_per_sender) +
         "; initialize with low_latency_buffer_bytes >= " + std::to_string((need + 8191) / 8192 * 8192) +
         " (jax_uccl_ep.low_latency_buffer_bytes gives it)";
}

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

// Send: the block's token trips, the routing, slots per expert (dispatch_send).
size_t dispatch_send_shared(const LowLatencyDispatchArgs& a, const Shape& shape) {
  const size_t per_block = (size_t(a.num_tokens) + kSendBlocks - 1) / kSendBlocks;
  return per_block * shape.num_ranks * sizeof(TokenTrip) +
         (size_t(a.num_tokens) * a.topk + size_t(a.num_experts)) * sizeof(int);
}
size_t dispatch_recv_shared(const Shape& shape) {
  const size_t R = shape.num_ranks, L = shape.local_experts;
  return (3 * R * L + L + R + 1) * sizeof(int);
}

template <class Dev>
Shape dispatch_shape(const Dev& dev, const Group& g, const LowLatencyDispatchArgs& a) {
  const int64_t token_row = token_row_bytes(a.x_row_bytes, a.scale_row_bytes);
  Shape shape = shape_of(dev, g, a.num_experts, a.max_tokens_per_rank, token_row, "low_latency_dispatch");
  shape.capacity_rows = int64_t(a.max_tokens_per_rank) * a.topk;  // row map entries
  shape.tokens_at = shape.counts_bytes + row_map_bytes(a.max_tokens_per_rank, a.topk);
  // A source sends a receiver at most N tokens and N * K map entries: refuse shapes that might not fit before
  // anything moves (every rank has the same shapes and buffer, so every rank refuses).
  const int64_t need = dispatch_region_bytes(shape.local_experts, a.max_tokens_per_rank, a.topk, token_row);
  if (need > region_stride(dev))
    throw std::invalid_argument("uccl_ep low_latency_dispatch: " + bytes_advice(dev, need));
  if (a.num_tokens > a.max_tokens_per_rank)  // the region has N token rows (the receive half passes 0 tokens)
    throw std::invalid_argument("uccl_ep low_latency_dispatch: " + std::to_string(a.num_tokens) +
                                " tokens, more than max_tokens_per_rank=" + std::to_string(a.max_tokens_per_rank));
  if (a.cast != Fp8Cast::kNone && (a.x_row_bytes % kFp8Block != 0 || a.x_row_bytes <= 0))
    throw std::invalid_argument("uccl_ep low_latency_dispatch: an FP8 cast needs hidden a multiple of 128");
  const size_t send = dispatch_send_shared(a, shape), recv = dispatch_recv_shared(shape);
  check_shared(dispatch_kernel<true, true>, std::max(send, recv), cuda_device_of(dev), "low_latency_dispatch",
               send >= recv ? "tokens x top-k and experts" : "ranks x local experts");
  return shape;
}
DispatchSource dispatch_source(const LowLatencyDispatchArgs& a) {
  const bool cast = a.cast != Fp8Cast::kNone;
  return {static_cast<const char*>(a.x),
          cast ? a.x_row_bytes * (a.x_bf16 ? 2 : 4) : a.x_row_bytes,
          a.x_row_bytes,
          cast ? nullptr : static_cast<const char*>(a.scales),
          a.scale_row_bytes,
          int64_t(align16(a.x_row_bytes)),
          a.cast,
          a.x_bf16,
          a.topk_idx,
          a.topk_weights,
          a.num_tokens,
          a.topk,
          a.num_experts};
}
DispatchTarget dispatch_target(const LowLatencyDispatchArgs& a) {
  return {a.x_row_bytes,
          a.scale_row_bytes,
          int64_t(align16(a.x_row_bytes)),
          static_cast<char*>(a.recv_x),
          static_cast<char*>(a.recv_scales),
          a.recv_count,
          a.layout,
          a.src_slot,
          a.recv_weights};
}
int64_t combine_row_bytes(const LowLatencyCombineArgs& a) { return int64_t(a.hidden) * float_bytes(a.dtype); }
// Send: the layout, where each source's rows start, prefixes, rows to each source; on the proxy path each source's
// rows by expert; where a token's rows are summed here, combine_send_sums's counts, first slots and rows.
size_t combine_send_shared(const LowLatencyCombineArgs& a, const Shape& shape, bool proxy) {
  const size_t R = shape.num_ranks, L = shape.local_experts, N = shape.max_tokens;
  size_t words = 2 * R * L + 2 * L + 1 + R + (proxy ? R * (L + 1) : 0);
  if (a.row_weights) words += R * L + R * N + (R * N + kSendBlocks - 1) / kSendBlocks * size_t(a.topk);
  return words * sizeof(int);
}
// The combine kernels by the rows' type.
template <bool kSend, bool kRecv>
auto combine_kernel_for(const LowLatencyCombineArgs& a) {
  return a.dtype == FloatType::kBF16 ? combine_kernel<__nv_bfloat16, kSend, kRecv>
                                     : combine_kernel<float, kSend, kRecv>;
}
// Receive: the routing, slots per expert; packed (proxy path) each slot's row in its message.
size_t combine_recv_shared(const LowLatencyCombineArgs& a, bool packed, int num_tokens) {
  return (size_t(num_tokens) * a.topk * (packed ? 2 : 1) + a.num_experts) * sizeof(int);
}
size_t combine_recv_shared(const LowLatencyCombineArgs& a, bool packed) {
  return combine_recv_shared(a, packed, a.num_tokens);
}

template <class Dev>
Shape combine_shape(const Dev& dev, const Group& g, const LowLatencyCombineArgs& a) {
  if (combine_row_bytes(a) % 16 != 0)
    throw std::invalid_argument(
        "uccl_ep low_latency_combine: on GPUs rows must be a multiple of 16 bytes (hidden "
        "a multiple of 8 for bfloat16, 4 for float32), got hidden " +
        std::to_string(a.hidden));
  Shape shape = shape_of(dev, g, a.num_experts, a.max_tokens_per_rank, combine_row_bytes(a), "low_latency_combine");
  // Rows go back to slot t * K + k of their source: every region needs room for N * K combine rows. Refuse before
  // anything moves (every rank has the same shapes and buffer, so every rank refuses, in either half).
  const int64_t need = combine_region_bytes(shape.local_experts, a.max_tokens_per_rank, a.topk, shape.row_bytes);
  if (need > region_stride(dev)) throw std::invalid_argument("uccl_ep low_latency_combine: " + bytes_advice(dev, need));
  if (a.row_weights && (shape.local_experts >= kFirstSlot || a.topk >= INT_MAX / kFirstSlot))
    throw std::invalid_argument("uccl_ep low_latency_combine: with the weights carried, at most " +
                                std::to_string(kFirstSlot - 1) + " local experts and top-" +
                                std::to_string(INT_MAX / kFirstSlot - 1));
  constexpr bool proxy = std::is_same_v<Dev, uccl_ep::Device>;  // its rows go packed
  // The receive side at N tokens: a send half does not know T (<= N), and must refuse what its receive half would.
  const size_t send = combine_send_shared(a, shape, proxy), recv = combine_recv_shared(a, proxy, a.max_tokens_per_rank);
  check_shared(combine_kernel_for<true, true>(a), std::max(send, recv), cuda_device_of(dev), "low_latency_combine",
               send < recv                ? "tokens x top-k"
               : a.row_weights != nullptr ? "ranks x max_tokens_per_rank, the weights carried"
                                          : "ranks x local experts");
  return shape;
}
CombineSource combine_source(const LowLatencyCombineArgs& a) {
  return {static_cast<const char*>(a.y), combine_row_bytes(a), a.layout, a.src_slot, a.row_weights, a.topk};
}
CombineTarget combine_target(const LowLatencyCombineArgs& a) {
  return {a.topk_idx,           a.topk_weights,           a.num_tokens, a.topk, a.num_experts,
          combine_row_bytes(a), static_cast<char*>(a.out)};
}
// One launch of a phase kernel: send-only grids are kSendBlocks x kSendThreads (receivers count arrivals by
// block), receive-only low_latency_blocks() x kThreads, fused as a send grid.
template <class Kernel, class In, class Out>
void launch(Kernel kernel, int blocks, int threads, size_t smem, cudaStream_t stream, const In& in, const Out& out,
            const Shape& shape, const Outbox& to, const Inbox& from, DeviceErrors* err, const char* what) {
  kernel<<<blocks, threads, shared_bytes(kernel, smem), stream>>>(in, out, shape, to, from, timeout_ns(), err);
  check(cudaGetLastError(), what);
}

void launch_combine_recv(const LowLatencyCombineArgs& a, const Shape& shape, const Inbox& from, DeviceErrors* err,
                         cudaStream_t stream) {
  launch(combine_kernel_for<false, true>(a), low_latency_blocks(), kThreads, combine_recv_shared(a, from.packed),
         stream, CombineSource{}, combine_target(a), shape, Outbox{}, from, err, "low_latency combine receive kernel");
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
  launch(kernel, kSendBlocks, kSendThreads, smem, stream, in, out, shape, to, from, dev.errors_device(), label);
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
         dispatch_source(a), DispatchTarget{}, shape, to, Inbox{}, dev.errors_device(),
         "low_latency dispatch send kernel");
  dev.timing_end(stream, "low_latency_dispatch send");
  dev.timing_begin(stream);
}

void low_latency_dispatch_recv(NvlDevice& dev, const Group& g, const LowLatencyDispatchArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  const Shape shape = dispatch_shape(dev, g, a);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  const Inbox from = inbox(dev, g);
  launch(dispatch_kernel<false, true>, low_latency_blocks(), kThreads, dispatch_recv_shared(shape), stream,
         DispatchSource{}, dispatch_target(a), shape, Outbox{}, from, dev.errors_device(),
         "low_latency dispatch receive kernel");
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
  launch(combine_kernel_for<true, false>(a), kSendBlocks, kSendThreads, combine_send_shared(a, shape, false), stream,
         combine_source(a), CombineTarget{}, shape, to, Inbox{}, dev.errors_device(),
         "low_latency combine send kernel");
  dev.timing_end(stream, "low_latency_combine send");
  dev.timing_begin(stream);
}

void low_latency_combine_recv(NvlDevice& dev, const Group& g, const LowLatencyCombineArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  const Shape shape = combine_shape(dev, g, a);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  launch_combine_recv(a, shape, inbox(dev, g), dev.errors_device(), stream);
  dev.timing_end(stream, "low_latency_combine receive");
}

void low_latency_combine(NvlDevice& dev, const Group& g, const LowLatencyCombineArgs& a, cudaStream_t stream) {
  const Shape shape = combine_shape(dev, g, a);
  run_fused(dev, g, stream, combine_kernel_for<true, true>(a),
            std::max(combine_send_shared(a, shape, false), combine_recv_shared(a, false)), shape, combine_source(a),
            combine_target(a), "low_latency_combine", [&] {
              low_latency_combine_send(dev, g, a, stream);
              low_latency_combine_recv(dev, g, a, stream);
            });
}

// ---- Across nodes: the proxy runtime's registered buffer in place of the NVLink peers (see api.hpp) ----

namespace {

std::mutex& proxy_gpus_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::map<int, ProxyGpu>& proxy_gpus() {
  static std::map<int, ProxyGpu> gpus;  // lives as long as the process, like the CUDA context
  return gpus;
}
// Each GPU's error word (host addresses).
std::vector<DeviceErrors*> proxy_error_words() {
  std::lock_guard<std::mutex> lock(proxy_gpus_mutex());
  std::vector<DeviceErrors*> words;
  for (auto& [device, g] : proxy_gpus())
    if (g.errors_host) words.push_back(g.errors_host);
  return words;
}

// Rows for member d go to our send region for it; our own rows straight to our receive region for us.
Outbox outbox(const ProxyHalf& half, const ProxyOut& p) {
  const Group& g = half.group();
  Outbox to{};
  for (int d = 0; d < g.size; ++d) {
    const uint32_t peer = uint32_t(g.ranks[d]);
    to.region[d] = half.buffer() + (d == g.self ? half.dev().recv_offset(peer) : half.dev().send_offset(peer));
  }
  to.proxy = p;
  return to;
}
Inbox inbox(const ProxyHalf& half) {
  const Group& g = half.group();
  uccl_ep::Device& dev = half.dev();
  Inbox from{};
  from.packed = true;  // a combine's rows come packed (packed_position); a dispatch's layout is the same as NVLink's
  for (int s = 0; s < g.size; ++s) {
    const uint32_t peer = uint32_t(g.ranks[s]);
    from.region[s] = half.buffer() + dev.recv_offset(peer);
    from.rank[s] = int(peer);
    if (s == g.self) continue;  // our own rows: written by our send kernel, launched before this one
    from.arrivals[s] = device_view(dev.released_word(peer, 0));
    from.want[s] = from.seq[s] = dev.consumed(peer, 0) + 1;
  }
  return from;
}

}  // namespace

ProxyGpu& proxy_gpu(int cuda_device) {
  std::lock_guard<std::mutex> lock(proxy_gpus_mutex());
  ProxyGpu& g = proxy_gpus()[cuda_device];
  if (!g.done) {
    void* p = nullptr;
    check(cudaHostAlloc(&p, sizeof(DeviceErrors), cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
    std::memset(p, 0, sizeof(DeviceErrors));
    g.errors_host = static_cast<DeviceErrors*>(p);
    g.errors_device = device_view(g.errors_host);
    uint64_t* words = nullptr;
    check(cudaMalloc(&words, sizeof(uint64_t) * (1 + 2 * kChunks)), "cudaMalloc");
    // Every chunk of message 1 complete: the most a progress word's low half holds that still reads as positive.
    std::vector<uint64_t> landed(kChunks, uint64_t(1) << 32 | 0x7fffffffu);
    check(cudaMemcpy(words + 1 + kChunks, landed.data(), kChunks * sizeof(uint64_t), cudaMemcpyHostToDevice),
          "cudaMemcpy");
    g.sink = words;
    g.landed = words + 1 + kChunks;
    check(cudaMalloc(&g.done, sizeof(unsigned int)), "cudaMalloc");
    check(cudaMemset(g.done, 0, sizeof(unsigned int)), "cudaMemset");
    // Before any kernel of this GPU waits on a peer (see api.hpp).
    preload_low_latency_kernels();
    preload_intranode_kernels();
  }
  return g;
}

DeviceErrors* proxy_error_word(int cuda_device) { return proxy_gpu(cuda_device).errors_device; }

void check_proxy_errors(const char* op) {
  for (DeviceErrors* word : proxy_error_words()) raise_pending_device_error(word, op);
}

void low_latency_dispatch_send(uccl_ep::Device& dev, const Group& g, const LowLatencyDispatchArgs& a,
                               cudaStream_t stream) {
  ProxyHalf half(dev, g, "low_latency_dispatch", stream);
  const Shape shape = dispatch_shape(dev, g, a);
  if (!fits_writes(dev, 2, dispatch_region_bytes(shape.local_experts, a.max_tokens_per_rank, a.topk, shape.row_bytes)))
    throw std::invalid_argument(
        "uccl_ep low_latency_dispatch: UCCL_EP_MAX_WRITE_BYTES is too small for these rows "
        "(a message may hold 2047 writes)");
  half.send(ProxyOp::kLowLatencyDispatch, [&] {
    launch(dispatch_kernel<true, false>, kSendBlocks, kSendThreads, dispatch_send_shared(a, shape), stream,
           dispatch_source(a), DispatchTarget{}, shape, outbox(half, half.proxy_out()), Inbox{}, half.errors(),
           "low_latency dispatch send kernel");
  });
}

void low_latency_dispatch_recv(uccl_ep::Device& dev, const Group& g, const LowLatencyDispatchArgs& a,
                               cudaStream_t stream) {
  ProxyHalf half(dev, g, "low_latency_dispatch", stream);
  const Shape shape = dispatch_shape(dev, g, a);
  half.receive(ProxyOp::kLowLatencyDispatch, [&] {
    launch(dispatch_kernel<false, true>, low_latency_blocks(), kThreads, dispatch_recv_shared(shape), stream,
           DispatchSource{}, dispatch_target(a), shape, Outbox{}, inbox(half), half.errors(),
           "low_latency dispatch receive kernel");
  });
}

void low_latency_dispatch(uccl_ep::Device& dev, const Group& g, const LowLatencyDispatchArgs& a, cudaStream_t stream) {
  low_latency_dispatch_send(dev, g, a, stream);
  low_latency_dispatch_recv(dev, g, a, stream);
}

void low_latency_combine_send(uccl_ep::Device& dev, const Group& g, const LowLatencyCombineArgs& a,
                              cudaStream_t stream) {
  ProxyHalf half(dev, g, "low_latency_combine", stream);
  const Shape shape = combine_shape(dev, g, a);
  // A message: the counts and up to N * K rows, packed.
  if (!fits_writes(dev, 1, shape.counts_bytes + shape.row_bytes * a.max_tokens_per_rank * a.topk))
    throw std::invalid_argument(
        "uccl_ep low_latency_combine: UCCL_EP_MAX_WRITE_BYTES is too small for these rows "
        "(a message may hold 2047 writes)");
  half.send(ProxyOp::kLowLatencyCombine, [&] {
    launch(combine_kernel_for<true, false>(a), kSendBlocks, kSendThreads, combine_send_shared(a, shape, true), stream,
           combine_source(a), CombineTarget{}, shape, outbox(half, half.proxy_out()), Inbox{}, half.errors(),
           "low_latency combine send kernel");
  });
}

void low_latency_combine_recv(uccl_ep::Device& dev, const Group& g, const LowLatencyCombineArgs& a,
                              cudaStream_t stream) {
  ProxyHalf half(dev, g, "low_latency_combine", stream);
  const Shape shape = combine_shape(dev, g, a);
  half.receive(ProxyOp::kLowLatencyCombine, [&] { launch_combine_recv(a, shape, inbox(half), half.errors(), stream); });
}

void low_latency_combine(uccl_ep::Device& dev, const Group& g, const LowLatencyCombineArgs& a, cudaStream_t stream) {
  low_latency_combine_send(dev, g, a, stream);
  low_latency_combine_recv(dev, g, a, stream);
}

void preload_low_latency_kernels() {
  load_kernels(dispatch_kernel<true, false>, dispatch_kernel<false, true>, dispatch_kernel<true, true>,
               combine_kernel<__nv_bfloat16, true, false>, combine_kernel<float, true, false>,
               combine_kernel<__nv_bfloat16, false, true>, combine_kernel<float, false, true>,
               combine_kernel<__nv_bfloat16, true, true>, combine_kernel<float, true, true>, acknowledge_kernel);
}

}  // namespace uccl_ep::nvl
