// Normal (high-throughput) mode on CPU devices: the same semantics as the GPU kernels, moving rows through the
// proxy runtime. Framework-free: plain pointers in, plain pointers out. Every output element is written.
#pragma once
#include <cstdint>

#include "exchange.hpp"

namespace uccl_ep::cpu {

enum class FloatType { kF32, kBF16 };

// Counts and masks for routing `num_tokens` tokens by `topk_idx` [num_tokens, topk] (-1 = no expert) to `num_ranks`
// ranks owning contiguous blocks of num_experts / num_ranks experts. Throws InvalidArgument on a bad index.
void get_dispatch_layout(const int32_t* topk_idx, int num_tokens, int topk, int num_experts, int num_ranks,
                         int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert, bool* is_token_in_rank);

struct DispatchArgs {
  // Inputs, [num_tokens, ...] row-major.
  const uint8_t* x;
  uint64_t x_row_bytes;
  const uint8_t* scales;  // FP8 scales or nullptr
  uint64_t scale_row_bytes;
  const int32_t* topk_idx;
  const float* topk_weights;  // or nullptr
  int num_tokens, topk, num_experts;
  int capacity;  // output rows
  // Outputs.
  uint8_t* recv_x;                 // [capacity, x_row_bytes]
  uint8_t* recv_scales;            // [capacity, scale_row_bytes] when scales
  int32_t* recv_topk_idx;          // [capacity, topk], local expert or -1
  float* recv_topk_weights;        // [capacity, topk] when topk_weights
  int32_t* recv_num_tokens;        // scalar
  int32_t* num_tokens_per_expert;  // [num_experts / group size]
  bool* is_token_in_rank;          // [num_tokens, group size] (handle)
  int32_t* recv_counts;            // [group size] rows from each member (handle)
  uint32_t op_index;               // position in the program, checked against the peers'
};
void dispatch(Device& dev, const Group& group, const DispatchArgs& args);

// Sends x rows by a dispatch's routing (its handle), as the backward pass of combine needs.
struct CachedDispatchArgs {
  const uint8_t* x;
  uint64_t row_bytes;
  int num_tokens;
  const bool* is_token_in_rank;  // [num_tokens, group size]
  const int32_t* recv_counts;    // [group size]
  int capacity;
  uint8_t* recv_x;  // [capacity, row_bytes]
  uint32_t op_index;
};
void cached_dispatch(Device& dev, const Group& group, const CachedDispatchArgs& args);

// Returns each received row to its source and sums the copies of each token (float32 accumulation).
struct CombineArgs {
  const uint8_t* y;  // [capacity, hidden]
  FloatType dtype;
  int hidden, capacity, num_tokens;
  const bool* is_token_in_rank;  // [num_tokens, group size]
  const int32_t* recv_counts;    // [group size]
  uint8_t* out;                  // [num_tokens, hidden]
  uint32_t op_index;
};
void combine(Device& dev, const Group& group, const CombineArgs& args);

}  // namespace uccl_ep::cpu
