// The byte layouts of the GPU paths' messages and low-latency regions: the kernels place rows by them, and the host
// sizes buffers by them (a GPU's NVLink buffer and low-latency area, a region of the proxy runtime's buffer on the
// GPU-initiated path). Plain C++, so that a build without CUDA sizes buffers for GPUs too.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../contract.hpp"

namespace uccl_ep::nvl {

constexpr size_t kFlagBytes = 4096;     // the flags at the front of a GPU's NVLink buffer
constexpr int64_t kMapEntryBytes = 16;  // a low-latency row-map entry (low_latency.cu's MapEntry)

inline size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// Normal mode. A dispatch's message to a member: its rows, their scales, then the sender's whole routing (and
// weights), each part 16-byte aligned. The proxy path sends only the rows a member gets; NVLink's region and the
// proxy's region must hold every token's.
struct DispatchLayoutBytes {
  size_t x, scales, idx, weights, total;
};
inline DispatchLayoutBytes dispatch_layout(int num_tokens, int64_t x_row_bytes, int64_t scale_row_bytes, int topk,
                                           bool weights) {
  DispatchLayoutBytes l;
  l.x = 0;
  l.scales = l.x + align16(size_t(num_tokens) * x_row_bytes);
  l.idx = l.scales + align16(size_t(num_tokens) * scale_row_bytes);
  l.weights = l.idx + align16(size_t(num_tokens) * topk * 4);
  l.total = l.weights + (weights ? align16(size_t(num_tokens) * topk * 4) : 0);
  return l;
}
inline size_t dispatch_message_bytes(int num_tokens, int64_t x_row_bytes, int64_t scale_row_bytes, int topk,
                                     bool weights) {
  return dispatch_layout(num_tokens, x_row_bytes, scale_row_bytes, topk, weights).total;
}
// A cached dispatch's message: the rows, then the token-in-rank mask [T, R].
inline size_t cached_mask_offset(int num_tokens, int64_t row_bytes) { return align16(size_t(num_tokens) * row_bytes); }
inline size_t cached_message_bytes(int num_tokens, int64_t row_bytes, int num_ranks) {
  return cached_mask_offset(num_tokens, row_bytes) + align16(size_t(num_tokens) * num_ranks);
}
// A combine's message to a source: a row per token it sent (float16 rows travel as float32).
inline size_t combine_message_bytes(int num_tokens, int hidden, FloatType dtype) {
  return align16(size_t(num_tokens) * hidden * size_t(float_bytes(dtype)));
}
// The largest message normal mode sends a member: a dispatch's, a combine's, or a cached dispatch's (combine's
// backward: combine's rows with the token-in-rank mask).
inline size_t normal_message_bytes(int num_ranks, int num_tokens, int64_t x_row_bytes, int64_t scale_row_bytes,
                                   int topk, bool weights, int hidden, FloatType combine_dtype) {
  return std::max({dispatch_message_bytes(num_tokens, x_row_bytes, scale_row_bytes, topk, weights),
                   combine_message_bytes(num_tokens, hidden, combine_dtype),
                   cached_message_bytes(num_tokens, hidden * float_bytes(combine_dtype), num_ranks)});
}
// The NVLink buffer a GPU needs for messages of `message_bytes`: the flags, then a whole-page region per peer.
inline size_t nvl_buffer_bytes_for(int num_ranks, size_t message_bytes) {
  const size_t region = (message_bytes + 4095) / 4096 * 4096;
  return kFlagBytes + size_t(num_ranks) * region;
}

// Low-latency mode: a region per sender holds an op's rows from it. Counts first (a word per local expert).
inline int64_t counts_bytes(int local_experts) { return (int64_t(local_experts) * 4 + 255) / 256 * 256; }
inline int64_t token_row_bytes(int64_t x_row_bytes, int64_t scale_row_bytes) {
  return int64_t(align16(size_t(x_row_bytes)) + align16(size_t(scale_row_bytes)));
}
// A dispatch region: counts, the row map (an entry per slot), a row per token.
inline int64_t row_map_bytes(int max_tokens, int topk) {
  return int64_t(align16(size_t(int64_t(max_tokens) * topk * kMapEntryBytes)));
}
inline int64_t dispatch_region_bytes(int local_experts, int max_tokens, int topk, int64_t token_row) {
  return counts_bytes(local_experts) + row_map_bytes(max_tokens, topk) + int64_t(max_tokens) * token_row;
}
// A combine region: counts, then a row per slot (rows go back to slot t * K + k of their source).
inline int64_t combine_region_bytes(int local_experts, int max_tokens, int topk, int64_t combine_row) {
  return counts_bytes(local_experts) + int64_t(max_tokens) * topk * combine_row;
}
// The larger of a dispatch's and a combine's region for these shapes (combine_row: hidden x its element bytes).
inline int64_t low_latency_region_bytes(int num_ranks, int num_experts, int max_tokens_per_rank, int topk,
                                        int64_t x_row_bytes, int64_t scale_row_bytes, int64_t combine_row) {
  const int local = num_experts / std::max(1, num_ranks);
  return std::max(
      dispatch_region_bytes(local, max_tokens_per_rank, topk, token_row_bytes(x_row_bytes, scale_row_bytes)),
      combine_region_bytes(local, max_tokens_per_rank, topk, int64_t(align16(size_t(combine_row)))));
}
// The low-latency area a GPU needs: two halves (consecutive ops alternate), each a 256-byte-aligned region per sender.
inline size_t low_latency_bytes_for(int num_ranks, int num_experts, int max_tokens_per_rank, int topk,
                                    int64_t x_row_bytes, int64_t scale_row_bytes, int64_t combine_row) {
  const int64_t region = low_latency_region_bytes(num_ranks, num_experts, max_tokens_per_rank, topk, x_row_bytes,
                                                  scale_row_bytes, combine_row);
  const size_t half = size_t(num_ranks) * size_t((region + 255) / 256 * 256);
  return 2 * ((half + 4095) / 4096 * 4096);
}

}  // namespace uccl_ep::nvl
