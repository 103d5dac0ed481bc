// Low-latency (decode) mode on CPU devices: each token goes to every selected expert (one copy per expert
// slot) into static expert-major buffers [local experts, R * N, ...]; combine weights the returned rows by the
// router weights on the token's own rank. Same exchange protocol as normal mode.
#pragma once
#include <cstdint>

#include "exchange.hpp"
#include "normal.hpp"

namespace uccl_ep::cpu {

// The largest message (header included) a rank can send in a low-latency dispatch or combine of these shapes,
// whatever the routing: what a region of the proxy's buffer must hold. combine_row_bytes: hidden x its element bytes.
uint64_t largest_low_latency_message_bytes(int num_ranks, int num_experts, int max_tokens_per_rank, int topk,
                                           uint64_t x_row_bytes, uint64_t scale_row_bytes, uint64_t combine_row_bytes);

// One call, both halves under one lock: nothing can run in between.
void low_latency_dispatch(Device& dev, const Group& group, const LowLatencyDispatchArgs& args);
// The two halves: send reads the inputs, receive (later, on the same device) writes the outputs. Between them
// the caller may compute, but run no other EP op on the device.
void low_latency_dispatch_send(Device& dev, const Group& group, const LowLatencyDispatchArgs& args);
void low_latency_dispatch_receive(Device& dev, const Group& group, const LowLatencyDispatchArgs& args);

void low_latency_combine(Device& dev, const Group& group, const LowLatencyCombineArgs& args);
void low_latency_combine_send(Device& dev, const Group& group, const LowLatencyCombineArgs& args);     // y, layout
void low_latency_combine_receive(Device& dev, const Group& group, const LowLatencyCombineArgs& args);  // topk, out

}  // namespace uccl_ep::cpu
