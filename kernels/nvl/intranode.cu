// Intranode normal mode: routing scans, gathers and the combine reduction, and the host code that orders
// them with the copy-engine transfers and stream flags (see api.hpp for the scheme).
#include <algorithm>
#include <stdexcept>
#include <string>

#include <cuda_bf16.h>

#include "api.hpp"
#include "device_common.cuh"

namespace uccl_ep::nvl {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kMaxScanExperts = 12 * 1024 - 64;  // the scan's dynamic shared ints (see dispatch())

struct Regions {
  char* p[kMaxRanks];  // by group position; unused for this rank
};

// Where each source's routing lives (group position s -> pointer valid on this GPU).
struct Sources {
  const int32_t* topk_idx[kMaxRanks];  // topk mode
  const bool* mask[kMaxRanks];         // mask mode: [T, R] of the source
  const char* x[kMaxRanks];
  const char* scales[kMaxRanks];
  const float* weights[kMaxRanks];
};


// Exclusive scan of one value per thread over the block; returns the prefix and sets *total.
__device__ int block_exclusive_scan(int value, int* total) {
  __shared__ int warp_sums[kScanThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  int inclusive = value;
  for (int d = 1; d < kWarp; d <<= 1) {
    int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == kWarp - 1) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int w = lane < blockDim.x / kWarp ? warp_sums[lane] : 0;
    for (int d = 1; d < kWarp; d <<= 1) {
      int v = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += v;
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  int warp_prefix = warp == 0 ? 0 : warp_sums[warp - 1];
  *total = warp_sums[blockDim.x / kWarp - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return warp_prefix + inclusive - value;
}

// The routing scan: which rows this rank receives, from which (source, token), and where they go. Rows are
// ordered by source (group order), then token. Two passes over a grid of (token block, source) blocks:
// count each block's rows, then place them after the counts of every earlier block. (Measured on 2xH200, FP8
// dispatch at 4096 tokens: 4.7 + 5.6 us. One block walking every source took 35 us, on the dispatch's critical
// path; before that 63 us with a run of tokens per thread and global atomics; runs of 32 tokens per thread with
// int4 loads, 58 us.)
struct ScanArgs {
  Sources src;
  bool topk_mode;  // topk_idx per source, else the token-in-rank mask (cached dispatch)
  int num_tokens, topk, num_experts, num_ranks, self, rank, capacity;
  const int32_t* own_topk_idx;      // topk mode: this rank's routing, for its layout and index checks
  int2* row_map;                    // [capacity]: (source, token) of each output row
  int32_t* recv_counts;             // [R] rows from each source
  int32_t* recv_num_tokens;         // rows kept (<= capacity)
  int32_t* num_tokens_per_expert;   // topk mode: [local experts]
  bool* is_token_in_rank;           // topk mode: [T, R] this rank's layout
  const int32_t* expected_counts;   // cached mode: the handle's counts to check against, else null
  int32_t* block_counts;            // scratch [R, blocks]
  DeviceErrors* err;
};

__device__ __forceinline__ bool scan_takes(const ScanArgs& a, int s, int t, int first, int local_experts) {
  if (!a.topk_mode) return a.src.mask[s][t * a.num_ranks + a.self];
  bool take = false;
  for (int k = 0; k < a.topk; ++k) {
    const int e = a.src.topk_idx[s][t * a.topk + k];
    take |= e >= first && e < first + local_experts;
  }
  return take;
}

// Pass 1: a block per (kScanThreads tokens, source) counts its rows. Source self's blocks also write this rank's
// own layout (the handle) and check its expert indices.
__global__ void __launch_bounds__(kScanThreads) dispatch_count_kernel(ScanArgs a) {
  const int s = blockIdx.y, t = blockIdx.x * kScanThreads + threadIdx.x;
  const int local_experts = a.topk_mode ? a.num_experts / a.num_ranks : 0;
  const bool take = t < a.num_tokens && scan_takes(a, s, t, a.self * local_experts, local_experts);
  const int rows = __syncthreads_count(take);
  if (threadIdx.x == 0) a.block_counts[s * gridDim.x + blockIdx.x] = rows;
  if (blockIdx.x == 0 && s == 0)
    for (int e = threadIdx.x; e < local_experts; e += blockDim.x) a.num_tokens_per_expert[e] = 0;
  if (a.topk_mode && s == a.self && t < a.num_tokens) {
    bool row[kMaxRanks] = {};
    for (int k = 0; k < a.topk; ++k) {
      const int e = a.own_topk_idx[t * a.topk + k];
      if (e < -1 || e >= a.num_experts) {
        report(a.err, 1, a.rank, t, k, e);
      } else if (e >= 0) {
        row[e / local_experts] = true;
      }
    }
    for (int r = 0; r < a.num_ranks; ++r) a.is_token_in_rank[t * a.num_ranks + r] = row[r];
  }
}

// Pass 2: each block places its rows after those of every earlier block and counts them per local expert
// (shared-memory counters, then one global add per expert and block).
__global__ void __launch_bounds__(kScanThreads) dispatch_place_kernel(ScanArgs a) {
  extern __shared__ int expert_rows[];  // [local_experts]
  const int blocks = gridDim.x, s = blockIdx.y, t = blockIdx.x * kScanThreads + threadIdx.x;
  const int local_experts = a.topk_mode ? a.num_experts / a.num_ranks : 0;
  const int first = a.self * local_experts;
  for (int e = threadIdx.x; e < local_experts; e += blockDim.x) expert_rows[e] = 0;
  int earlier = 0;
  for (int i = threadIdx.x; i < s * blocks + int(blockIdx.x); i += blockDim.x) earlier += a.block_counts[i];
  int base;
  block_exclusive_scan(earlier, &base);  // (syncs the block: expert_rows is zeroed)
  const bool take = t < a.num_tokens && scan_takes(a, s, t, first, local_experts);
  int rows;
  const int o = base + block_exclusive_scan(take, &rows);
  if (take && o < a.capacity) {
    a.row_map[o] = make_int2(s, t);
    for (int k = 0; a.topk_mode && k < a.topk; ++k) {
      const int e = a.src.topk_idx[s][t * a.topk + k];
      if (e >= first && e < first + local_experts) atomicAdd(&expert_rows[e - first], 1);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < local_experts; e += blockDim.x)
    if (expert_rows[e]) atomicAdd(&a.num_tokens_per_expert[e], expert_rows[e]);
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int from_source = 0;
  for (int b = 0; b < blocks; ++b) from_source += a.block_counts[s * blocks + b];
  a.recv_counts[s] = from_source;
  if (a.expected_counts && a.expected_counts[s] != from_source)
    report(a.err, 3, a.rank, s, from_source, a.expected_counts[s]);
  if (s != 0) return;
  int total = 0;
  for (int i = 0; i < a.num_ranks * blocks; ++i) total += a.block_counts[i];
  if (total > a.capacity) report(a.err, 2, a.rank, total, a.capacity, 0);
  *a.recv_num_tokens = min(total, a.capacity);
}

int scan_blocks(int num_tokens) { return std::max(1, (num_tokens + kScanThreads - 1) / kScanThreads); }

// The scan's device scratch: row_map [capacity] | counts [kMaxRanks] and rows kept (cached dispatch, which checks
// them against the handle's) | block_counts [R, blocks]. Grows the device's scratch to fit.
struct ScanScratch {
  int2* row_map;
  int32_t* counts;
  int32_t* num_rows;
  int32_t* block_counts;
};
ScanScratch scan_scratch(NvlDevice& dev, int capacity, int num_tokens) {
  const size_t counts_at = size_t(capacity) * sizeof(int2), blocks_at = counts_at + 256;
  dev.ensure_scratch(blocks_at + size_t(kMaxRanks) * scan_blocks(num_tokens) * 4);
  char* base = static_cast<char*>(dev.scratch());
  int32_t* counts = reinterpret_cast<int32_t*>(base + counts_at);
  return {reinterpret_cast<int2*>(base), counts, counts + kMaxRanks, reinterpret_cast<int32_t*>(base + blocks_at)};
}

void run_scan(ScanArgs a, int local_experts, cudaStream_t stream) {
  const dim3 grid(scan_blocks(a.num_tokens), a.num_ranks);
  dispatch_count_kernel<<<grid, kScanThreads, 0, stream>>>(a);
  check(cudaGetLastError(), "dispatch_count_kernel");
  dispatch_place_kernel<<<grid, kScanThreads, local_experts * sizeof(int), stream>>>(a);
  check(cudaGetLastError(), "dispatch_place_kernel");
}


// One warp per output row: copy the row from its source, localize its expert indices; padding gets zeros.
// One warp per output row. Only rows from group member `only_src` whose source token is in [t_begin, t_end)
// are copied (the part that has arrived); with `pad`, rows past the received count are filled too.
// (Measured on 2xH200: splitting rows into 2 KiB work items made dispatch slower, 339 -> 609 us, with spills.)
__global__ void __launch_bounds__(1024) dispatch_gather_kernel(Sources src, bool topk_mode, int topk, int num_experts, int num_ranks,
                                       int self, int capacity, const int2* row_map, const int32_t* recv_num_tokens,
                                       int64_t x_row_bytes, int64_t scale_row_bytes, char* recv_x,
                                       char* recv_scales, int32_t* recv_topk_idx, float* recv_topk_weights,
                                       int only_src, int t_begin, int t_end, bool pad) {
  const int lane = threadIdx.x % kWarp;
  const int warps = gridDim.x * blockDim.x / kWarp;
  const int n = *recv_num_tokens;
  const int local_experts = topk_mode ? num_experts / num_ranks : 0;
  const int first = self * local_experts;
  for (int o = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp; o < capacity; o += warps) {
    char* out_x = recv_x + int64_t(o) * x_row_bytes;
    if (o < n) {
      const int2 st = row_map[o];
      if (st.x != only_src || st.y < t_begin || st.y >= t_end) continue;
      warp_copy(out_x, src.x[st.x] + int64_t(st.y) * x_row_bytes, x_row_bytes, lane);
      if (scale_row_bytes)
        warp_copy(recv_scales + int64_t(o) * scale_row_bytes, src.scales[st.x] + int64_t(st.y) * scale_row_bytes,
                  scale_row_bytes, lane);
      if (topk_mode)
        for (int k = lane; k < topk; k += kWarp) {
          int e = src.topk_idx[st.x][st.y * topk + k];
          bool mine = e >= first && e < first + local_experts;
          recv_topk_idx[o * topk + k] = mine ? e - first : -1;
          if (recv_topk_weights) recv_topk_weights[o * topk + k] = mine ? src.weights[st.x][st.y * topk + k] : 0.f;
        }
    } else if (pad) {
      warp_zero(out_x, x_row_bytes, lane);
      if (scale_row_bytes) warp_zero(recv_scales + int64_t(o) * scale_row_bytes, scale_row_bytes, lane);
      if (topk_mode)
        for (int k = lane; k < topk; k += kWarp) {
          recv_topk_idx[o * topk + k] = -1;
          if (recv_topk_weights) recv_topk_weights[o * topk + k] = 0.f;
        }
    }
  }
}

// Combine work is spread as (row, 2 KiB segment) items, so a chunk of a few hundred rows keeps every warp busy.
constexpr int64_t kSegmentBytes = 2048;

// Combine routing: offsets of each source's rows in y, and each own token's position in each member's rows.
__global__ void __launch_bounds__(kScanThreads) combine_scan_kernel(const bool* mask, const int32_t* recv_counts,
                                                                    int num_tokens, int num_ranks, int capacity,
                                                                    int rank, int32_t* offsets, int32_t* positions,
                                                                    DeviceErrors* err) {
  if (threadIdx.x == 0) {
    int o = 0;
    for (int s = 0; s < num_ranks; ++s) {
      offsets[s] = o;
      o += recv_counts[s];
    }
    offsets[num_ranks] = o;
    if (o > capacity) report(err, 4, rank, o, capacity, 0);
  }
  const int per_thread = (num_tokens + blockDim.x - 1) / blockDim.x;
  const int t0 = min(num_tokens, threadIdx.x * per_thread), t1 = min(num_tokens, t0 + per_thread);
  for (int d = 0; d < num_ranks; ++d) {
    int mine = 0;
    for (int t = t0; t < t1; ++t) mine += mask[t * num_ranks + d];
    int total;
    int p = block_exclusive_scan(mine, &total);
    for (int t = t0; t < t1; ++t) positions[t * num_ranks + d] = mask[t * num_ranks + d] ? p++ : -1;
  }
}

// Rows received from each remote member go back to it: stage them at the start of its out-region.
// (Rows [j_begin, j_end) of each remote member's message only: one chunk; (row, segment) work items.)
// Rows past y's `capacity` were dropped by the dispatch (an error check_errors() reports): they return zeros, and
// y is never read past its end.
__global__ void __launch_bounds__(1024) combine_stage_kernel(const char* y, int64_t row_bytes, int num_ranks, int self,
                                     int capacity, const int32_t* offsets, Regions out_regions, int j_begin,
                                     int j_end) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarp;
  const int64_t segments = max(int64_t(1), (row_bytes + kSegmentBytes - 1) / kSegmentBytes);
  for (int s = 0; s < num_ranks; ++s) {
    if (s == self) continue;
    const int begin = offsets[s], end = min(offsets[s + 1] - offsets[s], j_end);
    for (int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; w < int64_t(end - j_begin) * segments;
         w += warps) {
      const int j = j_begin + int(w / segments);
      const int64_t b0 = (w % segments) * kSegmentBytes, b1 = min(row_bytes, b0 + kSegmentBytes);
      if (begin + j < capacity)
        warp_copy(out_regions.p[s] + int64_t(j) * row_bytes + b0, y + int64_t(begin + j) * row_bytes + b0, b1 - b0,
                  lane);
      else
        warp_zero(out_regions.p[s] + int64_t(j) * row_bytes + b0, b1 - b0, lane);
    }
  }
}


// One warp per own token: sum the copies returned by every member that received it, in float32.

// Tokens [t_begin, t_end) only: one chunk, once the rows it needs have arrived. (Token, segment) work items;
// each lane sums up to four 16-byte vectors with their loads issued together.
template <typename T>
__global__ void __launch_bounds__(1024) combine_reduce_kernel(const char* y, int64_t row_bytes, int capacity, int t_begin, int t_end, int num_ranks,
                                      int self, const int32_t* offsets, const int32_t* positions, Regions in_regions,
                                      char* __restrict__ out) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarp;
  const bool vector = row_bytes % 16 == 0;
  const int64_t segments = max(int64_t(1), (row_bytes + kSegmentBytes - 1) / kSegmentBytes);
  for (int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; w < int64_t(t_end - t_begin) * segments;
       w += warps) {
    const int t = t_begin + int(w / segments);
    const int64_t b0 = (w % segments) * kSegmentBytes, b1 = min(row_bytes, b0 + kSegmentBytes);
    const char* rows[kMaxRanks];
    int n = 0;
    for (int d = 0; d < num_ranks; ++d) {
      int p = positions[t * num_ranks + d];
      if (p < 0) continue;
      if (d == self && offsets[self] + p >= capacity) continue;  // dropped by the dispatch
      rows[n++] = d == self ? y + int64_t(offsets[self] + p) * row_bytes : in_regions.p[d] + int64_t(p) * row_bytes;
    }
    if (!vector) {  // rows of a few elements (a weight gradient, say): one element per lane
      T* dst = reinterpret_cast<T*>(out + int64_t(t) * row_bytes);
      for (int64_t i = b0 / int64_t(sizeof(T)) + lane; i < b1 / int64_t(sizeof(T)); i += kWarp) {
        float acc = 0.f;
        for (int j = 0; j < n; ++j) acc += to_float(reinterpret_cast<const T*>(rows[j])[i]);
        dst[i] = from_float<T>(acc);
      }
      continue;
    }
    int4* dst = reinterpret_cast<int4*>(out + int64_t(t) * row_bytes);
    const int64_t v0 = b0 / 16, v1 = b1 / 16;
    for (int64_t i = v0 + lane; i < v1; i += kUnroll * kWarp) {
      float acc[kUnroll][Vec<T>::kN] = {};
      for (int j = 0; j < n; ++j) {
        const int4* r = reinterpret_cast<const int4*>(rows[j]);
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (i + u * kWarp < v1) v[u] = __ldg(r + i + u * kWarp);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (i + u * kWarp < v1) Vec<T>::add(acc[u], v[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i + u * kWarp < v1) dst[i + u * kWarp] = Vec<T>::pack(acc[u]);
    }
  }
}

// SM budget: at most num_sms() blocks run at any time. Combine's staging (its own stream) finishes before its
// reduction (XLA's stream) starts, so the two never share the GPU.
int blocks() { return num_sms(); }

void check_fits(const NvlDevice& dev, size_t message, const char* op) {
  if (message > dev.region_bytes())
    throw std::invalid_argument(std::string("uccl_ep ") + op + ": a message of this shape needs " +
                                std::to_string(message) + " bytes per peer but the NVLink buffer holds " +
                                std::to_string(dev.region_bytes()) + "; initialize with buffer_bytes >= " +
                                std::to_string(NvlDevice::buffer_bytes_for(dev.num_ranks(), message)) +
                                " (jax_uccl_ep.nvl_buffer_bytes gives it for your shapes)");
}

// Token (or message row) range of chunk c out of `chunks` over n.
int chunk_begin(int n, int chunks, int c) { return int(int64_t(n) * c / chunks); }

// A message: small leading pieces (routing: announced by the meta flag), then bulk rows in chunks (each
// announced by the data flag). Copied by the copy engine on the send stream.
struct Piece {
  const void* src;
  size_t offset, bytes;
};
struct Message {
  Piece meta[4];
  int num_meta = 0;
  const char* rows = nullptr;  // bulk rows, chunk c = rows [chunk_begin(c), chunk_begin(c + 1)) of `num_rows`
  size_t rows_offset = 0;
  int64_t row_bytes = 0;
  int num_rows = 0;
};

// A GPU-side wait for a peer's flag with a deadline (the default): one thread polls, so a dead peer is reported by
// check_errors() after UCCL_EP_TIMEOUT_S instead of holding the stream forever. It costs a kernel launch per wait
// (within noise on 2xH200, bench/RESULTS.md); UCCL_EP_NVL_DEADLINE=0 uses stream memory waits, which cost no
// launch but never give up.
__global__ void wait_flag_kernel(const uint64_t* flag, uint64_t value, uint64_t timeout_ns, DeviceErrors* err,
                                 int rank, int peer) {
  if (threadIdx.x == 0) wait_flag(flag, value, int64_t(value), timeout_ns, err, rank, peer);
}

void wait_value(NvlDevice& dev, cudaStream_t stream, uint64_t* flag, uint64_t value, int peer) {
  if (!waits_have_deadline()) {
    stream_wait_value(stream, flag, value);
    return;
  }
  wait_flag_kernel<<<1, kWarp, 0, stream>>>(flag, value, timeout_ns(), dev.errors_device(), dev.rank(), peer);
  check(cudaGetLastError(), "wait_flag_kernel");
}

// Forks the send stream off XLA's stream, waits for each peer to have read our previous message, and sends the
// meta pieces. `msg_for(s)` gives the message for group member s (its rows may differ per member).
template <class MessageFor>
void send_meta(NvlDevice& dev, const Group& g, cudaStream_t stream, const MessageFor& msg_for) {
  cudaStream_t side = dev.send_stream();
  check(cudaEventRecord(dev.fork_event(), stream), "cudaEventRecord");
  check(cudaStreamWaitEvent(side, dev.fork_event(), 0), "cudaStreamWaitEvent");
  for (int s = 0; s < g.size; ++s) {
    if (s == g.self) continue;
    int p = peer_of(dev, g, s);
    wait_value(dev, side, dev.ack_flag(p), dev.sent(p), p);  // p has read our previous message
    const Message m = msg_for(s);
    for (int i = 0; i < m.num_meta; ++i)
      if (m.meta[i].bytes)
        check(cudaMemcpyAsync(dev.peer_in_region(p) + m.meta[i].offset, m.meta[i].src, m.meta[i].bytes,
                              cudaMemcpyDeviceToDevice, side),
              "cudaMemcpyAsync to peer");
    stream_write_value(side, dev.peer_meta_flag(p), ++dev.sent(p));
  }
}

// Sends chunk c of every member's rows and announces it.
template <class MessageFor>
void send_chunk(NvlDevice& dev, const Group& g, int c, const MessageFor& msg_for) {
  cudaStream_t side = dev.send_stream();
  const uint64_t chunks = uint64_t(dev.chunks());
  for (int s = 0; s < g.size; ++s) {
    if (s == g.self) continue;
    int p = peer_of(dev, g, s);
    const Message m = msg_for(s);
    int r0 = chunk_begin(m.num_rows, int(chunks), c), r1 = chunk_begin(m.num_rows, int(chunks), c + 1);
    if (r1 > r0)
      check(cudaMemcpyAsync(dev.peer_in_region(p) + m.rows_offset + size_t(r0) * m.row_bytes,
                            m.rows + size_t(r0) * m.row_bytes, size_t(r1 - r0) * m.row_bytes,
                            cudaMemcpyDeviceToDevice, side),
            "cudaMemcpyAsync to peer");
    stream_write_value(side, dev.peer_data_flag(p), (dev.sent(p) - 1) * chunks + c + 1);
  }
}

// The whole message, meta then every chunk, when nothing has to happen between the chunks.
void send_message(NvlDevice& dev, const Group& g, cudaStream_t stream, const Message& m) {
  auto msg_for = [&](int) { return m; };
  send_meta(dev, g, stream, msg_for);
  for (int c = 0; c < dev.chunks(); ++c) send_chunk(dev, g, c, msg_for);
}

void join_send(NvlDevice& dev, cudaStream_t stream) {
  check(cudaEventRecord(dev.join_event(), dev.send_stream()), "cudaEventRecord");
  check(cudaStreamWaitEvent(stream, dev.join_event(), 0), "cudaStreamWaitEvent");
}

// Receive side, on XLA's stream.
void wait_meta(NvlDevice& dev, const Group& g, cudaStream_t stream) {
  for (int s = 0; s < g.size; ++s)
    if (s != g.self) {
      int p = peer_of(dev, g, s);
      wait_value(dev, stream, dev.meta_flag(p), ++dev.received(p), p);
    }
}
void wait_chunk(NvlDevice& dev, const Group& g, int s, int c, cudaStream_t stream) {
  int p = peer_of(dev, g, s);
  wait_value(dev, stream, dev.data_flag(p), (dev.received(p) - 1) * uint64_t(dev.chunks()) + c + 1, p);
}
void ack_messages(NvlDevice& dev, const Group& g, cudaStream_t stream) {
  for (int s = 0; s < g.size; ++s)
    if (s != g.self) {
      int p = peer_of(dev, g, s);
      stream_write_value(stream, dev.peer_ack_flag(p), dev.received(p));
    }
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

// Rows gathered as they arrive: own rows (and padding) first, then each member's chunks.
void gather_all(NvlDevice& dev, const Group& g, const Sources& src, bool topk_mode, int topk, int num_experts,
                int num_tokens, int capacity, const int2* row_map, const int32_t* num_rows, int64_t x_row_bytes,
                int64_t scale_row_bytes, void* recv_x, void* recv_scales, int32_t* recv_topk_idx,
                float* recv_topk_weights, cudaStream_t stream) {
  auto launch = [&](int only_src, int t0, int t1, bool pad) {
    dispatch_gather_kernel<<<blocks(), 1024, 0, stream>>>(
        src, topk_mode, topk, num_experts, g.size, g.self, capacity, row_map, num_rows, x_row_bytes,
        scale_row_bytes, static_cast<char*>(recv_x), static_cast<char*>(recv_scales), recv_topk_idx,
        recv_topk_weights, only_src, t0, t1, pad);
    check(cudaGetLastError(), "dispatch_gather_kernel");
  };
  launch(g.self, 0, num_tokens, true);
  for (int c = 0; c < dev.chunks(); ++c)
    for (int s = 0; s < g.size; ++s) {
      if (s == g.self) continue;
      wait_chunk(dev, g, s, c, stream);
      int t0 = chunk_begin(num_tokens, dev.chunks(), c), t1 = chunk_begin(num_tokens, dev.chunks(), c + 1);
      if (t1 > t0) launch(s, t0, t1, false);
    }
}

}  // namespace

size_t dispatch_message_bytes(int num_tokens, int64_t x_row_bytes, int64_t scale_row_bytes, int topk, bool weights) {
  return dispatch_layout(num_tokens, x_row_bytes, scale_row_bytes, topk, weights).total;
}

size_t combine_message_bytes(int num_tokens, int hidden, bool bf16) {
  return align16(size_t(num_tokens) * hidden * (bf16 ? 2 : 4));
}

void dispatch(NvlDevice& dev, const Group& g, const DispatchArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  check_group(dev, g, "dispatch");
  // The routing scan counts rows per local expert in shared memory (the default 48 KiB, less the scan's own):
  // refuse before anything is sent.
  const int local_experts = a.num_experts / g.size;
  if (local_experts > kMaxScanExperts)
    throw std::invalid_argument("uccl_ep dispatch: at most " + std::to_string(kMaxScanExperts) +
                                " experts per GPU, got " + std::to_string(local_experts));
  const bool has_w = a.topk_weights != nullptr;
  const auto l = dispatch_layout(a.num_tokens, a.x_row_bytes, a.scale_row_bytes, a.topk, has_w);
  check_fits(dev, l.total, "dispatch");
  const ScanScratch scratch = scan_scratch(dev, a.capacity, a.num_tokens);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  dev.timing_begin(stream);

  // Routing first (small), then the rows in chunks.
  Message m;
  m.meta[0] = {a.topk_idx, l.idx, size_t(a.num_tokens) * a.topk * 4};
  m.meta[1] = {a.topk_weights, l.weights, has_w ? size_t(a.num_tokens) * a.topk * 4 : 0};
  m.meta[2] = {a.scales, l.scales, size_t(a.num_tokens) * a.scale_row_bytes};
  m.num_meta = 3;
  m.rows = static_cast<const char*>(a.x);
  m.rows_offset = l.x;
  m.row_bytes = a.x_row_bytes;
  m.num_rows = a.num_tokens;
  send_message(dev, g, stream, m);

  wait_meta(dev, g, stream);
  Sources src{};
  for (int s = 0; s < g.size; ++s) {
    const char* base = s == g.self ? nullptr : dev.in_region(peer_of(dev, g, s));
    src.topk_idx[s] = s == g.self ? a.topk_idx : reinterpret_cast<const int32_t*>(base + l.idx);
    src.x[s] = s == g.self ? static_cast<const char*>(a.x) : base + l.x;
    src.scales[s] = s == g.self ? static_cast<const char*>(a.scales) : base + l.scales;
    src.weights[s] = s == g.self ? a.topk_weights : reinterpret_cast<const float*>(base + l.weights);
  }
  run_scan({src, true, a.num_tokens, a.topk, a.num_experts, g.size, g.self, dev.rank(), a.capacity, a.topk_idx,
            scratch.row_map, a.recv_counts, a.recv_num_tokens, a.num_tokens_per_expert, a.is_token_in_rank, nullptr,
            scratch.block_counts, dev.errors_device()},
           local_experts, stream);
  gather_all(dev, g, src, true, a.topk, a.num_experts, a.num_tokens, a.capacity, scratch.row_map, a.recv_num_tokens,
             a.x_row_bytes, a.scale_row_bytes, a.recv_x, a.recv_scales, a.recv_topk_idx, a.recv_topk_weights, stream);
  join_send(dev, stream);  // x may be freed only after the copy engine has read it
  ack_messages(dev, g, stream);
  dev.timing_end(stream, "dispatch");
}

void cached_dispatch(NvlDevice& dev, const Group& g, const CachedDispatchArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  check_group(dev, g, "cached_dispatch");
  const size_t x_bytes = align16(size_t(a.num_tokens) * a.row_bytes);
  const size_t total = x_bytes + align16(size_t(a.num_tokens) * g.size);
  check_fits(dev, total, "cached_dispatch");
  const ScanScratch scratch = scan_scratch(dev, a.capacity, a.num_tokens);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");

  Message m;
  m.meta[0] = {a.is_token_in_rank, x_bytes, size_t(a.num_tokens) * g.size};
  m.num_meta = 1;
  m.rows = static_cast<const char*>(a.x);
  m.rows_offset = 0;
  m.row_bytes = a.row_bytes;
  m.num_rows = a.num_tokens;
  send_message(dev, g, stream, m);

  wait_meta(dev, g, stream);
  Sources src{};
  for (int s = 0; s < g.size; ++s) {
    const char* base = s == g.self ? nullptr : dev.in_region(peer_of(dev, g, s));
    src.mask[s] = s == g.self ? a.is_token_in_rank : reinterpret_cast<const bool*>(base + x_bytes);
    src.x[s] = s == g.self ? static_cast<const char*>(a.x) : base;
  }
  // The counts land in scratch: the scan checks them against the handle's.
  run_scan({src, false, a.num_tokens, 0, 0, g.size, g.self, dev.rank(), a.capacity, nullptr, scratch.row_map,
            scratch.counts, scratch.num_rows, nullptr, nullptr, a.recv_counts, scratch.block_counts,
            dev.errors_device()},
           0, stream);
  gather_all(dev, g, src, false, 0, 0, a.num_tokens, a.capacity, scratch.row_map, scratch.num_rows, a.row_bytes, 0,
             a.recv_x, nullptr, nullptr, nullptr, stream);
  join_send(dev, stream);
  ack_messages(dev, g, stream);
}

void combine(NvlDevice& dev, const Group& g, const CombineArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  check_group(dev, g, "combine");
  const int64_t row_bytes = int64_t(a.hidden) * (a.bf16 ? 2 : 4);
  const size_t message = combine_message_bytes(a.num_tokens, a.hidden, a.bf16);
  check_fits(dev, message, "combine");
  // Scratch: offsets [R + 1], then positions [T, R].
  const size_t positions_at = 64;
  dev.ensure_scratch(positions_at + size_t(a.num_tokens) * g.size * 4);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  dev.timing_begin(stream);
  char* scratch = static_cast<char*>(dev.scratch());
  int32_t* offsets = reinterpret_cast<int32_t*>(scratch);
  int32_t* positions = reinterpret_cast<int32_t*>(scratch + positions_at);
  Regions out_regions{}, in_regions{};
  for (int s = 0; s < g.size; ++s)
    if (s != g.self) {
      out_regions.p[s] = dev.out_region(peer_of(dev, g, s));
      in_regions.p[s] = dev.in_region(peer_of(dev, g, s));
    }

  combine_scan_kernel<<<1, kScanThreads, 0, stream>>>(a.is_token_in_rank, a.recv_counts, a.num_tokens, g.size,
                                                      a.capacity, dev.rank(), offsets, positions, dev.errors_device());
  check(cudaGetLastError(), "combine_scan_kernel");

  // Send side: the stage stream copies chunk c of the rows going back to each member into its out-region; the
  // send stream copies each staged chunk out as soon as it is ready.
  auto msg_for = [&](int s) {
    Message m;
    m.rows = out_regions.p[s];
    m.row_bytes = row_bytes;
    m.num_rows = a.num_tokens;  // at most T rows go back to a member; the copy engine moves the whole chunk
    return m;
  };
  send_meta(dev, g, stream, msg_for);  // forks after the scan: offsets are ready for the staging kernels
  cudaStream_t stage = dev.stage_stream();
  check(cudaStreamWaitEvent(stage, dev.fork_event(), 0), "cudaStreamWaitEvent");
  for (int c = 0; c < dev.chunks(); ++c) {
    int j0 = chunk_begin(a.num_tokens, dev.chunks(), c), j1 = chunk_begin(a.num_tokens, dev.chunks(), c + 1);
    combine_stage_kernel<<<blocks(), 1024, 0, stage>>>(static_cast<const char*>(a.y), row_bytes, g.size, g.self, a.capacity,
                                                       offsets, out_regions, j0, j1);
    check(cudaGetLastError(), "combine_stage_kernel");
    check(cudaEventRecord(dev.chunk_event(c), stage), "cudaEventRecord");
    check(cudaStreamWaitEvent(dev.send_stream(), dev.chunk_event(c), 0), "cudaStreamWaitEvent");
    send_chunk(dev, g, c, msg_for);
  }
  check(cudaEventRecord(dev.stage_done_event(), stage), "cudaEventRecord");

  // Receive side: a token's rows from a member sit at positions <= the token's index, so tokens of chunk c
  // need that member's chunks up to c only.
  wait_meta(dev, g, stream);
  check(cudaStreamWaitEvent(stream, dev.stage_done_event(), 0), "cudaStreamWaitEvent");
  for (int c = 0; c < dev.chunks(); ++c) {
    for (int s = 0; s < g.size; ++s)
      if (s != g.self) wait_chunk(dev, g, s, c, stream);
    int t0 = chunk_begin(a.num_tokens, dev.chunks(), c), t1 = chunk_begin(a.num_tokens, dev.chunks(), c + 1);
    if (t1 == t0) continue;
    if (a.bf16)
      combine_reduce_kernel<__nv_bfloat16><<<blocks(), 1024, 0, stream>>>(
          static_cast<const char*>(a.y), row_bytes, a.capacity, t0, t1, g.size, g.self, offsets, positions, in_regions,
          static_cast<char*>(a.out));
    else
      combine_reduce_kernel<float><<<blocks(), 1024, 0, stream>>>(
          static_cast<const char*>(a.y), row_bytes, a.capacity, t0, t1, g.size, g.self, offsets, positions, in_regions,
          static_cast<char*>(a.out));
    check(cudaGetLastError(), "combine_reduce_kernel");
  }
  join_send(dev, stream);
  ack_messages(dev, g, stream);
  dev.timing_end(stream, "combine");
}

void preload_intranode_kernels() {
  load_kernels(dispatch_count_kernel, dispatch_place_kernel, dispatch_gather_kernel, combine_scan_kernel, combine_stage_kernel,
               combine_reduce_kernel<float>, combine_reduce_kernel<__nv_bfloat16>, wait_flag_kernel);
}

}  // namespace uccl_ep::nvl
