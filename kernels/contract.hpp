// The contract between the ops' callers (ffi/) and their implementations (kernels/cpu on the host, kernels/nvl on
// GPUs): the path an op takes, its EP group, its arguments as plain pointers and sizes, and the errors kernels
// record. Framework-free (no XLA, CUDA or Python), so both backends and the FFI share one definition. Shapes:
// T tokens of this rank, K top-k slots, R group members, E experts, L = E / R local experts, N max tokens per rank.
#pragma once
#include <cstdint>
#include <string>

#include "fp8.hpp"

namespace uccl_ep {

// Where an op runs; decided once at lowering (jax_uccl_ep/_plan.py, the same numbers) and handed to the handler.
enum class Path : int64_t {
  kCpu = 0,         // CPU devices: kernels/cpu on the proxy runtime
  kNvlink = 1,      // GPUs of one node: the NVLink runtime's kernels
  kNodeNvlink = 2,  // GPUs across nodes, a group within one node: that node's NVLink runtime
  kProxyGpu = 3,    // GPUs across nodes: kernels push the proxies' commands (GPU-initiated)
  kStaged = 4,      // GPUs across nodes: copied to host memory and run by kernels/cpu
};

// What a dispatch does with rows past its capacity (the receiver keeps its first `capacity` rows in row order,
// by source member then token, either way):
//   kError: the op fails. On the host paths every rank of the group raises it in the op (the runtime stays usable);
//           GPU kernels cannot fail their call: every member counts every member's rows and records the overflow
//           for check_errors(), and the rows past the capacity are dropped.
//   kDrop:  the rest are dropped on purpose; their combine returns zeros to their sources.
// Its cached dispatch and combine take the dispatch's policy: under kDrop a handle may record more rows than y has.
enum class Overflow : int64_t { kError = 0, kDrop = 1 };

// Which level of two-level routing an op is (jax_uccl_ep/normal.py's two_level attribute).
enum class Level : int64_t { kFlat = 0, kNode = 1, kAcross = 2 };

enum class FloatType { kF32, kBF16 };
inline int64_t float_bytes(FloatType t) { return t == FloatType::kF32 ? 4 : 2; }

// An op's EP group: its members' ranks (the runtime's numbering), in axis order, and this rank's index among them.
struct Group {
  const int32_t* ranks;
  int size;
  int self;
};

// Routing counts of this rank's tokens (no communication): tokens per rank, top-k slots per expert, and which
// ranks each token goes to. A slot outside [-1, E) is an error.
struct LayoutArgs {
  const int32_t* topk_idx;  // [T, K]
  int num_tokens, topk, num_experts, num_ranks;
  int32_t* num_tokens_per_rank;    // [R]
  int32_t* num_tokens_per_expert;  // [E]
  bool* is_token_in_rank;          // [T, R]
};

// Normal mode. Rows are opaque bytes except where a dtype is given.
struct DispatchArgs {
  const void* x;  // [T, x_row_bytes]
  int64_t x_row_bytes;
  const void* scales;  // [T, scale_row_bytes] (FP8 scales) or zero-width
  int64_t scale_row_bytes;
  const int32_t* topk_idx;    // [T, K] global expert, -1 for none
  const float* topk_weights;  // [T, K] or null
  int num_tokens, topk, num_experts;
  int capacity;                    // output rows
  Overflow overflow;               // rows past the capacity
  bool overflow_status_over_job;   // host paths: a capacity error reaches every rank of the runtime (the node level
                                   // of two-level routing, whose other nodes wait on this one), not only the group
  void* recv_x;                    // [capacity, x_row_bytes]
  void* recv_scales;               // [capacity, scale_row_bytes]
  int32_t* recv_topk_idx;          // [capacity, K] local expert or -1
  float* recv_topk_weights;        // [capacity, K] when topk_weights
  int32_t* recv_num_tokens;        // scalar
  int32_t* num_tokens_per_expert;  // [L]
  bool* is_token_in_rank;          // [T, R] (handle)
  int32_t* recv_counts;            // [R] rows from each member (handle)
  uint32_t op_index;               // position in the program, the same on every rank (host paths check it)
  int node_size;                   // host paths: ranks per node of the hierarchical rounds (0: flat)
};

// dispatch(layout="expert")'s pair buffer: one row per received (row, slot) pair that names a local expert, local
// expert e's at [expert_offsets[e], expert_offsets[e] + pairs_per_expert[e]) (offsets multiples of `alignment`,
// increasing with e), in received row order within each expert. The pairs of a prefix of the received rows are kept
// while every expert's pairs, rounded up to the alignment, fit in the M slots; the later rows lose all theirs.
// jax_uccl_ep/_pairs.py lays out the same pairs in XLA (the GPU paths): the two must agree slot for slot.
struct PairBuffer {
  int capacity;               // M pair slots
  int alignment;              // rows
  int rows;                   // C: the received rows the pairs index (rows of pair_of)
  void* x;                    // [M, x_row_bytes]: zeros outside the groups (with zero_padding, else unwritten)
  void* scales;               // [M, scale_row_bytes]
  float* weights;             // [M] router weight of each pair, 0 outside the groups; null without weights
  int32_t* expert_offsets;    // [L]
  int32_t* pairs_per_expert;  // [L]
  int32_t* pair_row;          // [M] received row of each slot, C outside the groups
  int32_t* pair_of;           // [C, K] slot of each received row's top-k slot, M where none or dropped
  int32_t* stats;             // [3]: rows kept, pairs dropped, aligned pair slots every received pair would need
  bool zero_padding = true;   // x's and scales' rows outside the groups written as zeros, or left as they are
};

// The pair rows from received token rows, where a path's receive writes token rows and the pairs are laid out after
// it (jax_uccl_ep/_pairs.py): slot s gets received row pair_row[s]; a slot whose pair_row names no row (outside the
// groups) gets zeros, or nothing without zero_padding (most of a worst-case buffer lies outside the groups).
struct ExpandPairsArgs {
  const void* rows;  // [num_rows, row_bytes]
  int64_t num_rows, row_bytes;
  const int32_t* pair_row;  // [num_slots]
  int64_t num_slots;
  void* pairs;  // [num_slots, row_bytes]
  bool zero_padding;
};

// The reverse of ExpandPairsArgs, combine's first step on the paths that lay the pairs out after token rows: row r
// gets the float32 sum of the pair rows pair_of[r, 0..topk) names (a slot outside [0, num_slots) names none),
// rounded once to rows_dtype; a row that names none gets zeros. Every row is written.
struct SumPairsArgs {
  const void* pairs;  // [num_slots, hidden] of pairs_dtype
  FloatType pairs_dtype;
  int64_t num_slots, hidden;
  const int32_t* pair_of;  // [num_rows, topk]
  int64_t num_rows;
  int topk;
  void* rows;  // [num_rows, hidden] of rows_dtype
  FloatType rows_dtype;
};

// The experts' step between their two grouped matmuls, weighted: h = silu(gate) * up * weight of each pair row of
// gate_up [rows, 2 * features] (gate: its first `features` columns, up: the rest) and weight [rows], in float32, h
// rounded to the rows' type once; with dh, its gradient: d_gate_up [rows, 2 * features] in the rows' type and
// d_weight [rows] float32. Only rows [0, *num_rows) (the groups') are read or written: the rest of a pair buffer,
// most of a worst-case one, is left as it is. num_rows is where the op runs (device memory on GPUs).
struct SwigluArgs {
  FloatType dtype;      // of gate_up, dh, h and d_gate_up
  const void* gate_up;  // [rows, 2 * features]
  const float* weight;  // [rows]
  const void* dh;       // [rows, features]: the backward; null for the forward
  void* out;            // forward: h [rows, features]; backward: d_gate_up [rows, 2 * features]
  float* d_weight;      // backward: [rows]
  int64_t rows, features;
  const int32_t* num_rows;  // rows [0, *num_rows) are computed (clamped to [0, rows])
};

// Sends x rows by a dispatch's routing (its handle): the backward pass of combine.
struct CachedDispatchArgs {
  const void* x;  // [T, row_bytes]
  int64_t row_bytes;
  int num_tokens, capacity;
  Overflow overflow;             // the dispatch's
  const bool* is_token_in_rank;  // [T, R]
  const int32_t* recv_counts;    // [R] (checked against what arrives)
  void* recv_x;                  // [capacity, row_bytes]
  uint32_t op_index;
  int node_size;
};

// Returns each received row to its source and sums the copies of each token (float32 accumulation).
struct CombineArgs {
  const void* y;    // [capacity, hidden]
  FloatType dtype;  // of y and out
  int hidden, capacity, num_tokens;
  Overflow overflow;             // the dispatch's: under kDrop rows past y's end go back as zeros
  const bool* is_token_in_rank;  // [T, R]
  const int32_t* recv_counts;    // [R] rows each member sent (all of them, dropped ones included)
  void* out;                     // [T, hidden]
  uint32_t op_index;
  int node_size;
};

// Low-latency mode: each token goes to every selected expert (one copy per slot) into static expert-major buffers
// [L, R * N, ...]; rows of local expert l: [0, recv_count[l]) valid, grouped by source (group order), then token.
struct LowLatencyDispatchArgs {
  const void* x;              // [T, x_row_bytes], or with `cast` [T, hidden] float32 / bfloat16 (x_bf16)
  int64_t x_row_bytes;        // bytes of a row as sent and received (hidden with `cast`)
  const void* scales;         // [T, scale_row_bytes] or null (with `cast` the dispatch makes them)
  int64_t scale_row_bytes;    // hidden / 128 floats with `cast`
  Fp8Cast cast;               // send x as given or cast to FP8 on the way (kernels/fp8.hpp)
  bool x_bf16;                // with `cast`: x is bfloat16, else float32
  const int32_t* topk_idx;    // [T, K]
  const float* topk_weights;  // [T, K] router weights sent with the rows, or null (combine weights on the source)
  int num_tokens, topk, num_experts, max_tokens_per_rank;
  uint32_t op_index;
  void* recv_x;         // [L, R * N, x_row_bytes]
  void* recv_scales;    // [L, R * N, scale_row_bytes]
  int32_t* recv_count;  // [L]
  int32_t* layout;      // [L, R] rows from each source (handle)
  int32_t* src_slot;    // [L, R * N] the row's slot on its source (token * K + k), -1 on padding (handle)
  float* recv_weights;  // [L, R * N] the row's router weight, 0 on padding or without topk_weights (handle)
};

struct LowLatencyCombineArgs {
  const void* y;    // [L, R * N, hidden]
  FloatType dtype;  // of y and out
  int hidden, num_experts, max_tokens_per_rank;
  const int32_t* layout;    // [L, R] from the dispatch
  const int32_t* src_slot;  // [L, R * N] from the dispatch: where each row goes back to (token * K + k)
  // [L, R * N] the dispatch's recv_weights where it carried them, else null. Given, the send side weights and sums
  // each token's rows and sends one row per (token, source): to the source's first slot t * K + k naming one of
  // this rank's experts, which the receive side then takes at weight 1 (its topk_idx holds only those slots).
  const float* row_weights;
  const int32_t* topk_idx;    // [T, K] this rank's routing (as dispatched)
  const float* topk_weights;  // [T, K]
  int num_tokens, topk;       // topk: in every call (the send half gets it from the handle)
  uint32_t op_index;
  void* out;  // [T, hidden]
};

// Errors GPU kernels find land in host-mapped memory (nvl::DeviceErrors) and are raised later by check_errors():
// a kernel cannot fail the call that launched it. Each code's message, with its details a, b, c, is in
// nvl::raise_device_error (kernels/nvl/device.cu).
enum DeviceErrorCode : int32_t {
  kNoError = 0,
  kBadExpertIndex = 1,        // (token, slot, index)
  kOverCapacity = 2,          // (received, capacity): Overflow::kError only
  kRowsDifferFromHandle = 3,  // (member, rows, rows the handle records)
  kHandleDisagreesWithY = 4,  // (rows the handle records, rows of y)
  kPeerLate = 5,              // (peer, its message or minus ours it did not acknowledge, seconds)
  kLowLatencyRowCount = 6,    // (rows, local expert, source rank)
  kUnknownRowSource = 7,      // (source rank, token row, slot)
  kExpertRowsPastN = 8,       // (expert | N << 32, rows, a token naming it twice): low-latency dispatch's send side
  kNoSourceSlot = 9,          // (local expert, row, slot)
  kRingFull = 10,             // (peer or -1, -, seconds)
  kBlocksNotResident = 11,    // (blocks of the launch, -, seconds): an NVLink op's blocks never all ran at once
};

// Low-latency dispatch sends a row per top-k slot and an expert holds N = max_tokens_per_rank rows from each rank, so
// only a token naming an expert in several slots can send it more: what the host kernels (which refuse the call) and
// the GPU kernels (which report it) both say, after "rank r sends " / "sent ".
inline std::string expert_rows_past_n(int expert, int64_t rows, int max_tokens, int token) {
  return "expert " + std::to_string(expert) + " " + std::to_string(rows) +
         " rows, more than max_tokens_per_rank=" + std::to_string(max_tokens) + " (a row per top-k slot; token " +
         std::to_string(token) +
         " names it in more than one slot): give each token distinct experts, or use normal mode's dispatch, which "
         "takes repeats";
}

}  // namespace uccl_ep
