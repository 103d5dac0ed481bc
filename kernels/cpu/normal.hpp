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

// The ops of kernels/contract.hpp; every output element is written.
void dispatch(Device& dev, const Group& group, const DispatchArgs& args);
void cached_dispatch(Device& dev, const Group& group, const CachedDispatchArgs& args);
void combine(Device& dev, const Group& group, const CombineArgs& args);

}  // namespace uccl_ep::cpu
