// Low-latency (decode) mode on CPU devices: each token goes to every selected expert (one copy per expert
// slot) into static expert-major buffers [local experts, R * N, ...]; combine weights the returned rows by the
// router weights on the token's own rank. Same exchange protocol as normal mode.
#pragma once
#include <cstdint>

#include "../fp8.hpp"
#include "exchange.hpp"
#include "normal.hpp"

namespace uccl_ep::cpu {

struct LowLatencyDispatchArgs {
  const uint8_t* x;  // [T, x_row_bytes], or with `cast` [T, hidden] float32 / bfloat16 (x_bf16)
  uint64_t x_row_bytes;      // bytes of a row as sent and received (hidden with `cast`)
  const uint8_t* scales;     // [T, scale_row_bytes] or nullptr (with `cast` the dispatch makes them)
  uint64_t scale_row_bytes;  // hidden / 128 floats with `cast`
  Fp8Cast cast;              // send x as given or cast to FP8 on the way (kernels/fp8.hpp)
  bool x_bf16;               // with `cast`: x is bfloat16, else float32
  const int32_t* topk_idx;  // [T, K]
  int num_tokens, topk, num_experts, max_tokens_per_rank;
  uint32_t op_index;
  // Outputs; rows of local expert l: [0, recv_count[l]) valid, grouped by source rank ascending, then token.
  uint8_t* recv_x;          // [L, R * N, x_row_bytes]
  uint8_t* recv_scales;     // [L, R * N, scale_row_bytes]
  int32_t* recv_count;      // [L]
  int32_t* layout;          // [L, R]: rows from each source rank (handle)
  int32_t* src_slot;        // [L, R * N]: the row's slot on its source rank (token * K + k), -1 on padding (handle)
};
// One call, both halves under one lock: nothing can run in between.
void low_latency_dispatch(Device& dev, const Group& group, const LowLatencyDispatchArgs& args);
// The two halves: send reads the inputs, receive (later, on the same device) writes the outputs. Between them
// the caller may compute, but run no other EP op on the device.
void low_latency_dispatch_send(Device& dev, const Group& group, const LowLatencyDispatchArgs& args);
void low_latency_dispatch_receive(Device& dev, const Group& group, const LowLatencyDispatchArgs& args);

struct LowLatencyCombineArgs {
  const uint8_t* y;  // [L, R * N, hidden]
  FloatType dtype;
  int hidden, max_tokens_per_rank, num_experts;
  const int32_t* topk_idx;      // [T, K] of this rank's tokens
  const float* topk_weights;    // [T, K]
  int num_tokens, topk;
  const int32_t* layout;        // [L, R] from the dispatch
  uint32_t op_index;
  uint8_t* out;                 // [T, hidden]
};
void low_latency_combine(Device& dev, const Group& group, const LowLatencyCombineArgs& args);
void low_latency_combine_send(Device& dev, const Group& group, const LowLatencyCombineArgs& args);     // y, layout
void low_latency_combine_receive(Device& dev, const Group& group, const LowLatencyCombineArgs& args);  // topk, out

}  // namespace uccl_ep::cpu
