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
//   dispatch row: [x | scales | (local expert, token, position, 0)], each part 16-byte aligned
//   combine row:  [y row], in the order the dispatch delivered that (expert rank, source) pair
#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

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
  bool routing_by_warps;                           // UCCL_EP_LL_ROUTING=warps (see route_slots)
};

// Phase stamps for profiling (block 0, thread 0; SM clock): word kernel * 8 + phase.
enum PhaseKernel { kDispatchSend = 0, kDispatchRecv = 1, kCombineSend = 2, kCombineRecv = 3 };
__device__ __forceinline__ void stamp(const Shape& shape, int kernel, int phase) {
  if (shape.phases && blockIdx.x == 0 && threadIdx.x == 0) shape.phases[kernel * 8 + phase] = clock64();
}

// The whole block: copies topk_idx into shared `idx` (out-of-range entries become -1, reported once with
// `report_bad`), then finds the position of each (token, slot) among this rank's slots for the same expert, in
// token order, and the slots per expert (`count`). Ends with the block synchronized.
// With `warp_counts` ([warps * num_experts] shared ints) every warp counts a contiguous chunk of the slots and a
// scan over warps joins them (UCCL_EP_LL_ROUTING=warps, not yet measured); without, warp 0 walks all slots.
__device__ void route_slots(const int32_t* topk_idx, int pairs, int topk, int num_experts, int* idx, int* pos,
                            int* count, int* warp_counts, DeviceErrors* err, int rank, bool report_bad) {
  const int warps = blockDim.x / kWarp, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    int e = topk_idx[p];
    if (e < -1 || e >= num_experts) {
      if (report_bad) report(err, 1, rank, p / topk, p % topk, e);
      e = -1;
    }
    idx[p] = e;
  }
  int* counts = warp_counts ? warp_counts + warp * num_experts : count;  // this warp's counters
  for (int i = threadIdx.x; i < (warp_counts ? warps : 1) * num_experts; i += blockDim.x)
    (warp_counts ? warp_counts : count)[i] = 0;
  __syncthreads();
  // Slots [begin, end) for this warp, walked 32 at a time: match_any groups the lanes of one expert.
  const int chunk = warp_counts ? (pairs + warps * kWarp - 1) / (warps * kWarp) * kWarp : pairs;
  const int begin = warp_counts ? warp * chunk : 0;
  const int end = warp_counts || warp == 0 ? min(pairs, begin + chunk) : 0;
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
  if (!warp_counts) {
    __syncthreads();
    return;
  }
  __syncthreads();
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
  __syncthreads();
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

// first[e]: where expert e's rows start among the rows for e's rank (one warp per rank). Ends synchronized.
__device__ void expert_offsets(const int* count, int* first, int num_ranks, int local) {
  const int warp = threadIdx.x / kWarp;
  if (warp < num_ranks)
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

__global__ void __launch_bounds__(kSendThreads) dispatch_send_kernel(
    const char* x, int64_t x_row_bytes, const char* scales, int64_t scale_row_bytes, int64_t scales_at,
    const int32_t* topk_idx, int num_tokens, int topk, int num_experts, Shape shape, Outbox to,
    DeviceErrors* err) {
  extern __shared__ int smem[];
  const int pairs = num_tokens * topk, local = shape.local_experts;
  int* idx = smem;
  int* pos = idx + pairs;
  int* count = pos + pairs;
  int* first = count + num_experts;
  int* warp_counts = shape.routing_by_warps ? first + num_experts : nullptr;
  stamp(shape, kDispatchSend, 0);
  route_slots(topk_idx, pairs, topk, num_experts, idx, pos, count, warp_counts, err, shape.rank, blockIdx.x == 0);
  expert_offsets(count, first, shape.num_ranks, local);
  stamp(shape, kDispatchSend, 1);

  // One warp per (token, slot): the rows of a token are read K times, from L2.
  const int lane = threadIdx.x % kWarp, warps_per_block = blockDim.x / kWarp;
  for (int p = blockIdx.x * warps_per_block + threadIdx.x / kWarp; p < pairs; p += gridDim.x * warps_per_block) {
    const int e = idx[p];
    if (e < 0) continue;
    const int d = e / local, t = p / topk, j = first[e] + pos[p];
    if (j >= shape.capacity_rows) continue;  // the host refused shapes where this can happen
    char* row = to.region[d] + shape.counts_bytes + int64_t(j) * shape.row_bytes;
    warp_copy(row, x + int64_t(t) * x_row_bytes, x_row_bytes, lane);
    if (scale_row_bytes) warp_copy(row + scales_at, scales + int64_t(t) * scale_row_bytes, scale_row_bytes, lane);
    if (lane == 0) *reinterpret_cast<int4*>(row + shape.row_bytes - 16) = make_int4(e % local, t, pos[p], 0);
  }
  stamp(shape, kDispatchSend, 2);
  finish_send(to, shape.num_ranks, [&] {
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
      reinterpret_cast<int*>(to.region[i / local])[i % local] = count[i];
  });
  stamp(shape, kDispatchSend, 3);
}

__global__ void __launch_bounds__(kThreads) dispatch_recv_kernel(
    Inbox from, Shape shape, int64_t x_row_bytes, int64_t scale_row_bytes, int64_t scales_at, char* recv_x,
    char* recv_scales, int32_t* recv_count, int32_t* layout, int32_t* src_token, uint64_t timeout_ns,
    DeviceErrors* err) {
  extern __shared__ int smem[];
  const int R = shape.num_ranks, L = shape.local_experts;
  const int64_t slab = int64_t(R) * shape.max_tokens;  // rows per local expert
  int* count = smem;         // [s * L + l]
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
      if (blockIdx.x == 0) layout[l * R + s] = count[s * L + l];
    }
    total[l] = acc;
    if (blockIdx.x == 0) {
      recv_count[l] = int(min(int64_t(acc), slab));
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
    const int l = __shfl_sync(0xffffffffu, tail.x, 0), t = __shfl_sync(0xffffffffu, tail.y, 0),
              j = __shfl_sync(0xffffffffu, tail.z, 0);
    if (l < 0 || l >= L || j < 0 || j >= count[s * L + l] || offset[l * R + s] + j >= slab) continue;
    const int64_t o = int64_t(l) * slab + offset[l * R + s] + j;
    warp_copy<Load::kCoherent>(recv_x + o * x_row_bytes, row, x_row_bytes, lane);
    if (scale_row_bytes)
      warp_copy<Load::kCoherent>(recv_scales + o * scale_row_bytes, row + scales_at, scale_row_bytes, lane);
    if (lane == 0) src_token[o] = t;
  }
  stamp(shape, kDispatchRecv, 3);
  // Padding rows: no source token (their data is not written).
  for (int64_t o = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; o < int64_t(L) * slab; o += int64_t(gridDim.x) * blockDim.x)
    if (o % slab >= total[o / slab]) src_token[o] = -1;
  stamp(shape, kDispatchRecv, 4);
}

__global__ void __launch_bounds__(kSendThreads) combine_send_kernel(const char* y, int64_t y_row_bytes,
                                                                const int32_t* layout, Shape shape, Outbox to,
                                                                DeviceErrors* err) {
  extern __shared__ int smem[];
  const int R = shape.num_ranks, L = shape.local_experts;
  const int64_t slab = int64_t(R) * shape.max_tokens;
  int* rows = smem;            // [l * R + s]: the handle's layout
  int* begin = rows + R * L;   // [l * R + s]: where source s's rows start in y[l]
  int* first = begin + R * L;  // [s * L + l]: where expert l's rows start in source s's region
  int* cum = first + R * L;    // [L + 1]: prefix of rows per expert
  int* in_expert = cum + L + 1;  // [L]: rows of expert l
  __shared__ bool valid;
  stamp(shape, kCombineSend, 0);
  if (threadIdx.x == 0) valid = true;
  for (int i = threadIdx.x; i < R * L; i += blockDim.x) rows[i] = max(0, layout[i]);
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
  const int warp = threadIdx.x / kWarp;
  if (warp == 0) {
    const int all = warp_exclusive_scan(L, [&](int l) { return in_expert[l]; }, [&](int l, int v) { cum[l] = v; });
    if (threadIdx.x == 0) {
      cum[L] = all;
      if (!valid && blockIdx.x == 0) report(err, 4, shape.rank, all, int64_t(L) * slab, 0);
    }
  }
  if (warp >= 1 && warp <= R) {  // warp s + 1: where each expert's rows start in source s's region
    const int s = warp - 1;
    const int all = warp_exclusive_scan(L, [&](int l) { return rows[l * R + s]; },
                                        [&](int l, int v) { first[s * L + l] = v; });
    if (threadIdx.x % kWarp == 0 && all > shape.capacity_rows && blockIdx.x == 0)
      report(err, 8, shape.rank, all, shape.capacity_rows, shape.row_bytes);
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
    const int64_t j = first[s * L + l] + (r - begin[l * R + s]);
    if (j >= shape.capacity_rows) continue;
    warp_copy(to.region[s] + shape.counts_bytes + j * shape.row_bytes, y + (int64_t(l) * slab + r) * y_row_bytes,
              y_row_bytes, lane);
  }
  stamp(shape, kCombineSend, 2);
  finish_send(to, R, [&] {
    for (int i = threadIdx.x; i < R * L; i += blockDim.x)
      reinterpret_cast<int*>(to.region[i / L])[i % L] = valid ? rows[(i % L) * R + i / L] : 0;
  });
  stamp(shape, kCombineSend, 3);
}

// (token, 1 KiB segment) work items: each lane sums two 16-byte vectors of every selected expert's row, weighted,
// in float32.
template <typename T>
__global__ void __launch_bounds__(kThreads) combine_recv_kernel(Inbox from, Shape shape, const int32_t* topk_idx,
                                                                const float* topk_weights, int num_tokens, int topk,
                                                                int num_experts, int64_t y_row_bytes, char* out,
                                                                uint64_t timeout_ns, DeviceErrors* err) {
  extern __shared__ int smem[];
  const int pairs = num_tokens * topk, L = shape.local_experts;
  int* idx = smem;
  int* pos = idx + pairs;
  int* count = pos + pairs;
  int* first = count + num_experts;
  int* warp_counts = shape.routing_by_warps ? first + num_experts : nullptr;
  stamp(shape, kCombineRecv, 0);
  route_slots(topk_idx, pairs, topk, num_experts, idx, pos, count, warp_counts, err, shape.rank, false);
  expert_offsets(count, first, shape.num_ranks, L);
  stamp(shape, kCombineRecv, 1);
  if (!wait_sources(from, shape.num_ranks, timeout_ns, err, shape.rank)) return;
  stamp(shape, kCombineRecv, 2);
  for (int e = threadIdx.x; e < num_experts && blockIdx.x == 0; e += blockDim.x) {
    const int got = __ldcg(reinterpret_cast<const int*>(from.region[e / L]) + e % L);
    if (got != count[e]) report(err, 6, shape.rank, got, e % L, from.rank[e / L]);
  }

  const int lane = threadIdx.x % kWarp, warps_per_block = blockDim.x / kWarp;
  const int64_t segments = (y_row_bytes + kCombineSegmentBytes - 1) / kCombineSegmentBytes;
  constexpr int kVecs = kCombineSegmentBytes / 16 / kWarp;
  for (int64_t w = blockIdx.x * warps_per_block + threadIdx.x / kWarp; w < int64_t(num_tokens) * segments;
       w += int64_t(gridDim.x) * warps_per_block) {
    const int t = int(w / segments);
    const int64_t v0 = (w % segments) * kCombineSegmentBytes / 16, v1 = min(y_row_bytes / 16, v0 + kCombineSegmentBytes / 16);
    float acc[kVecs][Vec<T>::kN] = {};
    for (int k = 0; k < topk; ++k) {
      const int e = idx[t * topk + k];
      if (e < 0) continue;
      const int64_t j = first[e] + pos[t * topk + k];
      if (j >= shape.capacity_rows) continue;
      const int4* row = reinterpret_cast<const int4*>(from.region[e / L] + shape.counts_bytes + j * shape.row_bytes);
      const float weight = topk_weights[t * topk + k];
      int4 v[kVecs];
#pragma unroll
      for (int u = 0; u < kVecs; ++u)
        if (v0 + lane + u * kWarp < v1) v[u] = __ldcg(row + v0 + lane + u * kWarp);
#pragma unroll
      for (int u = 0; u < kVecs; ++u)
        if (v0 + lane + u * kWarp < v1) Vec<T>::add(acc[u], v[u], weight);
    }
    int4* dst = reinterpret_cast<int4*>(out + int64_t(t) * y_row_bytes);
#pragma unroll
    for (int u = 0; u < kVecs; ++u)
      if (v0 + lane + u * kWarp < v1) dst[v0 + lane + u * kWarp] = Vec<T>::pack(acc[u]);
  }
  stamp(shape, kCombineRecv, 3);
}

int64_t counts_bytes(int local_experts) { return (int64_t(local_experts) * 4 + 255) / 256 * 256; }
int64_t dispatch_row_bytes(int64_t x_row_bytes, int64_t scale_row_bytes) {
  return int64_t(align16(x_row_bytes) + align16(scale_row_bytes)) + 16;
}

bool routing_by_warps() {
  static const bool on = [] {
    const char* v = std::getenv("UCCL_EP_LL_ROUTING");
    return v && std::string(v) == "warps";
  }();
  return on;
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
  s.routing_by_warps = routing_by_warps();
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

void low_latency_dispatch_send(NvlDevice& dev, const Group& g, const LowLatencyDispatchArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  const int64_t row_bytes = dispatch_row_bytes(a.x_row_bytes, a.scale_row_bytes);
  Shape shape = shape_of(dev, g, a.num_experts, a.max_tokens_per_rank, row_bytes, "low_latency_dispatch");
  // A source sends a receiver at most N * K rows: refuse shapes that might not fit before anything moves (every
  // rank has the same shapes and buffer, so every rank refuses).
  const int64_t need = shape.counts_bytes + int64_t(a.max_tokens_per_rank) * a.topk * row_bytes;
  if (need > int64_t(dev.low_latency_stride()))
    throw std::invalid_argument("uccl_ep low_latency_dispatch: " + bytes_advice(dev, need));
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  const Outbox to = outbox(dev, g);
  dev.timing_begin(stream);
  const size_t smem = shared_bytes(dispatch_send_kernel, routing_shared_bytes(a.num_tokens * a.topk, a.num_experts,
                                                                            shape, kSendThreads));
  dispatch_send_kernel<<<kSendBlocks, kSendThreads, smem, stream>>>(
      static_cast<const char*>(a.x), a.x_row_bytes, static_cast<const char*>(a.scales), a.scale_row_bytes,
      int64_t(align16(a.x_row_bytes)), a.topk_idx, a.num_tokens, a.topk, a.num_experts, shape, to,
      dev.errors_device());
  check(cudaGetLastError(), "low_latency dispatch_send_kernel");
  dev.timing_end(stream, "low_latency_dispatch send");
  dev.timing_begin(stream);
}

void low_latency_dispatch_recv(NvlDevice& dev, const Group& g, const LowLatencyDispatchArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  const int64_t row_bytes = dispatch_row_bytes(a.x_row_bytes, a.scale_row_bytes);
  Shape shape = shape_of(dev, g, a.num_experts, a.max_tokens_per_rank, row_bytes, "low_latency_dispatch");
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  const Inbox from = inbox(dev, g);
  const int R = g.size, L = shape.local_experts;
  const size_t smem = shared_bytes(dispatch_recv_kernel, (2 * size_t(R) * L + L + R + 1) * sizeof(int));
  dispatch_recv_kernel<<<low_latency_blocks(), kThreads, smem, stream>>>(
      from, shape, a.x_row_bytes, a.scale_row_bytes, int64_t(align16(a.x_row_bytes)), static_cast<char*>(a.recv_x),
      static_cast<char*>(a.recv_scales), a.recv_count, a.layout, a.src_token, timeout_ns(), dev.errors_device());
  check(cudaGetLastError(), "low_latency dispatch_recv_kernel");
  dev.timing_end(stream, "low_latency_dispatch receive");
}

namespace {
int64_t combine_row_bytes(const LowLatencyCombineArgs& a) { return int64_t(a.hidden) * (a.bf16 ? 2 : 4); }
void check_combine_row(const LowLatencyCombineArgs& a) {
  if (combine_row_bytes(a) % 16 != 0)
    throw std::invalid_argument("uccl_ep low_latency_combine: on GPUs rows must be a multiple of 16 bytes (hidden "
                                "a multiple of 8 for bfloat16, 4 for float32), got hidden " + std::to_string(a.hidden));
}
}  // namespace

void low_latency_combine_send(NvlDevice& dev, const Group& g, const LowLatencyCombineArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  check_combine_row(a);
  const int64_t row_bytes = combine_row_bytes(a);
  Shape shape = shape_of(dev, g, a.num_experts, a.max_tokens_per_rank, row_bytes, "low_latency_combine");
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  const Outbox to = outbox(dev, g);
  dev.timing_begin(stream);
  const size_t smem = shared_bytes(combine_send_kernel, (3 * size_t(g.size) * shape.local_experts + 2 * shape.local_experts + 1) * sizeof(int));
  combine_send_kernel<<<kSendBlocks, kSendThreads, smem, stream>>>(static_cast<const char*>(a.y), row_bytes, a.layout,
                                                               shape, to, dev.errors_device());
  check(cudaGetLastError(), "low_latency combine_send_kernel");
  dev.timing_end(stream, "low_latency_combine send");
  dev.timing_begin(stream);
}

void low_latency_combine_recv(NvlDevice& dev, const Group& g, const LowLatencyCombineArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  check_combine_row(a);
  const int64_t row_bytes = combine_row_bytes(a);
  Shape shape = shape_of(dev, g, a.num_experts, a.max_tokens_per_rank, row_bytes, "low_latency_combine");
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  const Inbox from = inbox(dev, g);
  const size_t smem_bytes = routing_shared_bytes(a.num_tokens * a.topk, a.num_experts, shape, kThreads);
  if (a.bf16) {
    const size_t smem = shared_bytes(combine_recv_kernel<__nv_bfloat16>, smem_bytes);
    combine_recv_kernel<__nv_bfloat16><<<low_latency_blocks(), kThreads, smem, stream>>>(
        from, shape, a.topk_idx, a.topk_weights, a.num_tokens, a.topk, a.num_experts, row_bytes,
        static_cast<char*>(a.out), timeout_ns(), dev.errors_device());
  } else {
    const size_t smem = shared_bytes(combine_recv_kernel<float>, smem_bytes);
    combine_recv_kernel<float><<<low_latency_blocks(), kThreads, smem, stream>>>(
        from, shape, a.topk_idx, a.topk_weights, a.num_tokens, a.topk, a.num_experts, row_bytes,
        static_cast<char*>(a.out), timeout_ns(), dev.errors_device());
  }
  check(cudaGetLastError(), "low_latency combine_recv_kernel");
  dev.timing_end(stream, "low_latency_combine receive");
}

void preload_low_latency_kernels() {
  load_kernels(dispatch_send_kernel, dispatch_recv_kernel, combine_send_kernel, combine_recv_kernel<float>,
               combine_recv_kernel<__nv_bfloat16>);
}

}  // namespace uccl_ep::nvl
