// Normal (high-throughput) mode on CPU devices: the same semantics as the GPU kernels, moving rows through the
// proxy runtime. Framework-free: plain pointers in, plain pointers out. Every output element is written.
#pragma once
#include <cstdint>

#include "exchange.hpp"

namespace uccl_ep::cpu {

// Counts and masks for routing `num_tokens` tokens by `topk_idx` [num_tokens, topk] (-1 = no expert) to `num_ranks`
// ranks owning contiguous blocks of num_experts / num_ranks experts. Throws InvalidArgument on a bad index.
void get_dispatch_layout(const int32_t* topk_idx, int num_tokens, int topk, int num_experts, int num_ranks,
                         int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert, bool* is_token_in_rank);

// Normal mode's shapes in a job, for sizing the proxy's buffer.
struct NormalShapes {
  int num_ranks = 1;   // the group's
  int node_size = 0;   // ranks a node of hierarchical rounds (0 or 1: flat)
  int num_tokens = 0;  // per rank
  uint64_t x_row_bytes = 0, scale_row_bytes = 0;
  int topk = 0;
  bool weights = false;
  uint64_t combine_row_bytes = 0;  // a row combine returns: hidden x its element bytes
};
// The largest message (header included) a rank can send in a round of dispatch, cached_dispatch or combine of these
// shapes, whatever the routing: what a region of the proxy's buffer must hold.
uint64_t largest_message_bytes(const NormalShapes& shapes);

// The ops of kernels/contract.hpp; every output element is written.
void dispatch(Device& dev, const Group& group, const DispatchArgs& args);
void cached_dispatch(Device& dev, const Group& group, const CachedDispatchArgs& args);
void combine(Device& dev, const Group& group, const CombineArgs& args);

}  // namespace uccl_ep::cpu
