// What the CPU and CUDA handlers share: each op's attributes (one struct per op, decoded by XLA), its argument list
// (one line per argument, as in XLA's FFI examples; the platform puts its context in front) and the lookup of this
// device's EP group.
#pragma once
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../kernels/contract.hpp"
#include "../kernels/cpu/pairs.hpp"
#include "../proxy/errors.hpp"
#include "xla/ffi/api/ffi.h"

// The EP ops every platform handles: X(symbol stem, XLA target name, signature function below). Each handler file
// names its implementation <stem>Impl and its exported symbol UcclEp<stem><Platform>.
#define UCCL_EP_FFI_NORMAL_OPS(X)                                   \
  X(Dispatch, "uccl_ep_dispatch", dispatch_signature)               \
  X(CachedDispatch, "uccl_ep_cached_dispatch", handle_op_signature) \
  X(Combine, "uccl_ep_combine", handle_op_signature)
#define UCCL_EP_FFI_LOW_LATENCY_OPS(X)                                                                \
  X(LowLatencyDispatch, "uccl_ep_low_latency_dispatch", low_latency_dispatch_signature)               \
  X(LowLatencyCombine, "uccl_ep_low_latency_combine", low_latency_combine_signature)                  \
  X(LowLatencyDispatchSend, "uccl_ep_low_latency_dispatch_send", low_latency_dispatch_send_signature) \
  X(LowLatencyDispatchRecv, "uccl_ep_low_latency_dispatch_recv", low_latency_dispatch_recv_signature) \
  X(LowLatencyCombineSend, "uccl_ep_low_latency_combine_send", low_latency_combine_send_signature)    \
  X(LowLatencyCombineRecv, "uccl_ep_low_latency_combine_recv", low_latency_combine_recv_signature)
#define UCCL_EP_FFI_OPS(X) UCCL_EP_FFI_NORMAL_OPS(X) UCCL_EP_FFI_LOW_LATENCY_OPS(X)
// dispatch(layout="expert")'s ops whose receive writes the pair buffer: the host paths (CPU devices, host-staged
// GPUs); the GPU kernels' paths lay the pairs out in XLA after the rows arrive (jax_uccl_ep/_plan.py decides).
#define UCCL_EP_FFI_PAIR_OPS(X)                                                            \
  X(DispatchPairs, "uccl_ep_dispatch_pairs", dispatch_pairs_signature)                     \
  X(CachedDispatchPairs, "uccl_ep_cached_dispatch_pairs", cached_dispatch_pairs_signature) \
  X(CombinePairs, "uccl_ep_combine_pairs", combine_pairs_signature)

namespace uccl_ep::ffi_common {

namespace ffi = xla::ffi;

// The errors this process's ops returned to XLA since the last take: an op's error reaches the user only where its
// result is read, so the Python side reports at shutdown what nobody collected (jax_uccl_ep/_runtime.py).
// The log also counts the ops running now, so a shutdown can wait for one whose result nobody holds. One log per
// process, in the core library (common.cpp): the handlers write it, the extension reads it.
struct OpErrorLog {
  std::mutex mutex;
  std::vector<std::string> messages;
  std::atomic<int> running{0};
};
OpErrorLog& op_error_log();
inline ffi::Error op_error(ffi::ErrorCode code, const char* what) {
  auto& log = op_error_log();
  std::lock_guard<std::mutex> lock(log.mutex);
  log.messages.emplace_back(what);
  return ffi::Error(code, what);
}
inline std::vector<std::string> take_op_errors() {
  auto& log = op_error_log();
  std::lock_guard<std::mutex> lock(log.mutex);
  return std::exchange(log.messages, {});
}

// A type per op (DispatchOp, ...), which names it to the templates both handler files use (the host-staged path).
#define UCCL_EP_OP_TAG(stem, name, signature)  \
  struct stem##Op {                            \
    static constexpr const char* kName = name; \
  };
UCCL_EP_FFI_OPS(UCCL_EP_OP_TAG)
UCCL_EP_FFI_PAIR_OPS(UCCL_EP_OP_TAG)
#undef UCCL_EP_OP_TAG

// Runs `body` while holding the runtime alive (`lifetime` shared), mapping exceptions to XLA error codes.
template <class Body>
ffi::Error guarded(std::shared_mutex& lifetime, Body&& body) {
  struct Running {
    Running() { op_error_log().running.fetch_add(1); }
    ~Running() { op_error_log().running.fetch_sub(1); }
  } running;
  try {
    std::shared_lock<std::shared_mutex> lock(lifetime);
    body();
    return ffi::Error::Success();
  } catch (const TimeoutError& e) {
    return op_error(ffi::ErrorCode::kDeadlineExceeded, e.what());
  } catch (const InvalidArgument& e) {
    return op_error(ffi::ErrorCode::kInvalidArgument, e.what());
  } catch (const std::invalid_argument& e) {
    return op_error(ffi::ErrorCode::kInvalidArgument, e.what());
  } catch (const std::exception& e) {
    return op_error(ffi::ErrorCode::kInternal, e.what());
  }
}

// Each op's attributes, decoded by XLA from the call's whole attribute dictionary (`.Attrs<T>()`, registered at the
// end of this file): a struct lists exactly the attributes of the op's call, those the op passes and those the
// lowering adds (jax_uccl_ep/_ffi.py: group_table, group_size, path, node_size, op_index); XLA fails a call that
// carries more or fewer.
struct PairCapacityAttrs {  // dispatch(layout="expert")'s overflow="error" check: local, no group
  int64_t capacity;         // pair rows of the buffer
};

struct ExpandPairsAttrs {  // the expert layout's pair rows from token rows: local, no group
  int64_t zero_padding;    // 1: zeros in the slots outside the groups; 0: they are left unwritten
};

struct LayoutAttrs {  // get_dispatch_layout: local, no group
  int64_t num_experts;
  int64_t num_ranks;
};

struct DispatchAttrs {
  ffi::Span<const int32_t> group_table;  // every EP group of the mesh, [groups, group_size] runtime ranks
  int64_t group_size;
  int64_t op_index;  // position in the program, the same on every rank
  int64_t num_experts;
  Level two_level;    // the whole group, or a level of two-level routing
  Path path;          // decided at lowering; the CUDA handlers switch on it
  int64_t node_size;  // host paths: ranks per node of hierarchical rounds (0: flat)
  Overflow overflow;  // rows past the capacity fail the op or are dropped (checked by checked_overflow)
};

struct DispatchPairsAttrs {  // DispatchAttrs' and the pair buffer's alignment; overflow: of the pairs
  ffi::Span<const int32_t> group_table;
  int64_t group_size;
  int64_t op_index;
  int64_t num_experts;
  Level two_level;
  Path path;
  int64_t node_size;
  Overflow overflow;
  int64_t expert_alignment;  // rows: every expert's first pair row a multiple of it
  int64_t zero_padding;      // 1: the pair rows outside the groups are written as zeros; 0: left as they are
};

struct HandleOpAttrs {  // cached_dispatch and combine, which follow a dispatch's handle
  ffi::Span<const int32_t> group_table;
  int64_t group_size;
  int64_t op_index;
  Level two_level;
  Path path;
  int64_t node_size;
  Overflow overflow;  // the dispatch's
};

// Low-latency ops come in halves (*_send returns a token that its *_recv takes) and fused calls of both.
struct LowLatencyAttrs {  // combine, combine_recv
  ffi::Span<const int32_t> group_table;
  int64_t group_size;
  int64_t op_index;
  int64_t num_experts;
  int64_t max_tokens_per_rank;
  Path path;
};

struct LowLatencyDispatchAttrs {  // dispatch, dispatch_send
  ffi::Span<const int32_t> group_table;
  int64_t group_size;
  int64_t op_index;
  int64_t num_experts;
  int64_t max_tokens_per_rank;
  Path path;
  int64_t fp8_cast;  // Fp8Cast, an int the lowering passes as int64: checked by dispatch_rows
};

struct LowLatencyTopkAttrs {  // dispatch_recv, combine_send
  ffi::Span<const int32_t> group_table;
  int64_t group_size;
  int64_t op_index;
  int64_t num_experts;
  int64_t max_tokens_per_rank;
  Path path;
  int64_t topk;  // K of the dispatch (the size of the send half's row map, the slots rows go back to)
};

// The signatures put the attributes first: XLA decodes them by name wherever they sit, and the CUDA handler finds
// the path there (cuda_handlers.cpp).
template <class Binding>
auto dispatch_signature(Binding b) {
  return std::move(b)
      .template Attrs<DispatchAttrs>()
      .template Arg<ffi::AnyBuffer>()          // x
      .template Arg<ffi::AnyBuffer>()          // scales (zero width unless FP8)
      .template Arg<ffi::Buffer<ffi::S32>>()   // topk_idx
      .template Arg<ffi::Buffer<ffi::F32>>()   // topk_weights (zero width if absent)
      .template Arg<ffi::AnyBuffer>()          // order: ignored (see jax_uccl_ep/_ffi.py)
      .template Ret<ffi::AnyBuffer>()          // recv_x
      .template Ret<ffi::AnyBuffer>()          // recv_scales
      .template Ret<ffi::Buffer<ffi::S32>>()   // recv_topk_idx
      .template Ret<ffi::Buffer<ffi::F32>>()   // recv_topk_weights
      .template Ret<ffi::Buffer<ffi::S32>>()   // num_tokens
      .template Ret<ffi::Buffer<ffi::S32>>()   // num_tokens_per_expert
      .template Ret<ffi::Buffer<ffi::PRED>>()  // is_token_in_rank
      .template Ret<ffi::Buffer<ffi::S32>>();  // recv_counts
}

template <class Binding>
auto layout_signature(Binding b) {
  return std::move(b)
      .template Attrs<LayoutAttrs>()
      .template Arg<ffi::Buffer<ffi::S32>>()    // topk_idx
      .template Ret<ffi::Buffer<ffi::S32>>()    // num_tokens_per_rank
      .template Ret<ffi::Buffer<ffi::S32>>()    // num_tokens_per_expert
      .template Ret<ffi::Buffer<ffi::PRED>>();  // is_token_in_rank
}

// The expert layout's capacity check: the axis already agreed (a pmax) on the most pair rows a rank needs and on
// that rank, so every rank raises the same error in the same op and none waits on another.
template <class Binding>
auto pair_capacity_signature(Binding b) {
  return std::move(b)
      .template Attrs<PairCapacityAttrs>()
      .template Arg<ffi::Buffer<ffi::S32>>()   // needed: the most pair rows a rank of the axis needs
      .template Arg<ffi::Buffer<ffi::S32>>()   // rank: the rank that needs them
      .template Ret<ffi::Buffer<ffi::S32>>();  // 0, for the pair rows to wait on
}

inline void check_pair_capacity(int32_t needed, int32_t rank, int64_t capacity) {
  if (needed > capacity)
    throw InvalidArgument("uccl_ep dispatch(layout='expert'): " +
                          cpu::pair_overflow_message(std::to_string(rank) + " of the EP axis", needed, capacity));
}

// cached_dispatch (x -> recv_x) and combine (y -> combined) take the same arguments.
template <class Binding>
auto handle_op_signature(Binding b) {
  return std::move(b)
      .template Attrs<HandleOpAttrs>()
      .template Arg<ffi::AnyBuffer>()          // x or y
      .template Arg<ffi::Buffer<ffi::PRED>>()  // is_token_in_rank
      .template Arg<ffi::Buffer<ffi::S32>>()   // recv_counts
      .template Arg<ffi::AnyBuffer>()          // order: ignored
      .template Ret<ffi::AnyBuffer>();         // recv_x or combined
}

// The pair ops: the pair buffer's M slots come from the pair rows' shape, the C received rows from pair_of's.
template <class Binding>
auto dispatch_pairs_signature(Binding b) {
  return std::move(b)
      .template Attrs<DispatchPairsAttrs>()
      .template Arg<ffi::AnyBuffer>()          // x
      .template Arg<ffi::AnyBuffer>()          // scales (zero width unless FP8)
      .template Arg<ffi::Buffer<ffi::S32>>()   // topk_idx
      .template Arg<ffi::Buffer<ffi::F32>>()   // topk_weights (zero width if absent)
      .template Arg<ffi::AnyBuffer>()          // order: ignored
      .template Ret<ffi::AnyBuffer>()          // pair rows [M, H]
      .template Ret<ffi::AnyBuffer>()          // their scales [M, S]
      .template Ret<ffi::Buffer<ffi::F32>>()   // pair weights [M] ([0] without weights)
      .template Ret<ffi::Buffer<ffi::S32>>()   // expert_offsets [L]
      .template Ret<ffi::Buffer<ffi::S32>>()   // pairs per expert [L]
      .template Ret<ffi::Buffer<ffi::S32>>()   // pair_row [M]
      .template Ret<ffi::Buffer<ffi::S32>>()   // pair_of [C, K]
      .template Ret<ffi::Buffer<ffi::S32>>()   // stats [3]: rows kept, pairs dropped, pair rows needed
      .template Ret<ffi::Buffer<ffi::PRED>>()  // is_token_in_rank
      .template Ret<ffi::Buffer<ffi::S32>>();  // recv_counts
}

template <class Binding>
auto cached_dispatch_pairs_signature(Binding b) {
  return std::move(b)
      .template Attrs<HandleOpAttrs>()
      .template Arg<ffi::AnyBuffer>()          // x [T, H]
      .template Arg<ffi::Buffer<ffi::S32>>()   // pair_row [M]
      .template Arg<ffi::Buffer<ffi::S32>>()   // pair_of [C, K]
      .template Arg<ffi::Buffer<ffi::PRED>>()  // is_token_in_rank
      .template Arg<ffi::Buffer<ffi::S32>>()   // recv_counts
      .template Arg<ffi::AnyBuffer>()          // order: ignored
      .template Ret<ffi::AnyBuffer>();         // pair rows [M, H]
}

template <class Binding>
auto combine_pairs_signature(Binding b) {
  return std::move(b)
      .template Attrs<HandleOpAttrs>()
      .template Arg<ffi::AnyBuffer>()          // pair rows y [M, H]
      .template Arg<ffi::Buffer<ffi::S32>>()   // pair_of [C, K]
      .template Arg<ffi::Buffer<ffi::PRED>>()  // is_token_in_rank
      .template Arg<ffi::Buffer<ffi::S32>>()   // recv_counts
      .template Arg<ffi::AnyBuffer>()          // order: ignored
      .template Ret<ffi::AnyBuffer>();         // combined [T, H]
}

// Bytes of one row of a [rows, ...] buffer, and of a [L, rows, width] one (0 without rows).
inline int64_t row_bytes(const ffi::AnyBuffer& b) {
  return b.dimensions()[0] == 0 ? 0 : int64_t(b.size_bytes() / b.dimensions()[0]);
}
inline int64_t row_bytes_3d(const ffi::AnyBuffer& b) {
  const int64_t rows = b.dimensions()[0] * b.dimensions()[1];
  return rows == 0 ? 0 : int64_t(b.size_bytes()) / rows;
}

// How a low-latency dispatch's x goes on the wire: the bytes of a row as sent and of its scales, for x [T, H]
// cast to FP8 by the dispatch (`fp8_cast` an Fp8Cast) or sent as given (scales [T, S] beside it).
struct DispatchRows {
  Fp8Cast cast;
  bool x_bf16;  // with a cast: x is bfloat16, else float32
  int64_t row_bytes, scale_row_bytes;
};
inline DispatchRows dispatch_rows(const ffi::AnyBuffer& x, const ffi::AnyBuffer& scales, int64_t fp8_cast) {
  if (fp8_cast == int64_t(Fp8Cast::kNone)) return {Fp8Cast::kNone, false, row_bytes(x), row_bytes(scales)};
  const auto dims = x.dimensions();
  const int64_t h = dims.size() == 2 ? dims[1] : 0;
  if (fp8_cast != int64_t(Fp8Cast::kCast) && fp8_cast != int64_t(Fp8Cast::kCastPowerOfTwoScales))
    throw std::invalid_argument("uccl_ep low_latency_dispatch: fp8_cast must be 0, 1 or 2, got " +
                                std::to_string(fp8_cast));
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  if ((!bf16 && x.element_type() != ffi::DataType::F32) || dims.size() != 2 || h % kFp8Block != 0)
    throw std::invalid_argument(
        "uccl_ep low_latency_dispatch: an FP8 cast takes x [tokens, hidden] float32 or "
        "bfloat16 with hidden a multiple of 128");
  return {Fp8Cast(fp8_cast), bf16, h, h / kFp8Block * int64_t(sizeof(float))};
}

template <class Binding>
auto low_latency_dispatch_signature(Binding b) {  // both halves in one call
  return std::move(b)
      .template Attrs<LowLatencyDispatchAttrs>()
      .template Arg<ffi::AnyBuffer>()          // x [T, H] (FP8 rows when scales are given)
      .template Arg<ffi::AnyBuffer>()          // scales [T, H / 128] (zero width without FP8)
      .template Arg<ffi::Buffer<ffi::S32>>()   // topk_idx
      .template Arg<ffi::Buffer<ffi::F32>>()   // topk_weights [T, K], or [T, 0]: not sent
      .template Arg<ffi::AnyBuffer>()          // order: ignored
      .template Ret<ffi::AnyBuffer>()          // recv_x [L, R * N, H]
      .template Ret<ffi::AnyBuffer>()          // recv_scales [L, R * N, H / 128]
      .template Ret<ffi::Buffer<ffi::S32>>()   // recv_count [L]
      .template Ret<ffi::Buffer<ffi::S32>>()   // layout [L, R] (handle)
      .template Ret<ffi::Buffer<ffi::S32>>()   // src_slot [L, R * N] (handle)
      .template Ret<ffi::Buffer<ffi::F32>>();  // recv_weights [L, R * N] (handle)
}

template <class Binding>
auto low_latency_combine_signature(Binding b) {  // both halves in one call
  return std::move(b)
      .template Attrs<LowLatencyAttrs>()
      .template Arg<ffi::AnyBuffer>()         // y [L, R * N, H]
      .template Arg<ffi::Buffer<ffi::S32>>()  // layout (handle)
      .template Arg<ffi::Buffer<ffi::S32>>()  // src_slot (handle)
      .template Arg<ffi::Buffer<ffi::F32>>()  // row_weights (handle's recv_weights), or [0]: rows go back per slot
      .template Arg<ffi::Buffer<ffi::S32>>()  // topk_idx
      .template Arg<ffi::Buffer<ffi::F32>>()  // topk_weights
      .template Arg<ffi::AnyBuffer>()         // order: ignored
      .template Ret<ffi::AnyBuffer>();        // combined [T, H]
}

template <class Binding>
auto low_latency_dispatch_send_signature(Binding b) {
  return std::move(b)
      .template Attrs<LowLatencyDispatchAttrs>()
      .template Arg<ffi::AnyBuffer>()          // x [T, H] (FP8 rows when scales are given)
      .template Arg<ffi::AnyBuffer>()          // scales [T, H / 128] (zero width without FP8)
      .template Arg<ffi::Buffer<ffi::S32>>()   // topk_idx
      .template Arg<ffi::Buffer<ffi::F32>>()   // topk_weights [T, K], or [T, 0]: not sent
      .template Arg<ffi::AnyBuffer>()          // order: ignored
      .template Ret<ffi::Buffer<ffi::S32>>();  // token for the receive half
}

template <class Binding>
auto low_latency_dispatch_recv_signature(Binding b) {
  return std::move(b)
      .template Attrs<LowLatencyTopkAttrs>()
      .template Arg<ffi::AnyBuffer>()          // token of the send half
      .template Arg<ffi::AnyBuffer>()          // order: ignored
      .template Ret<ffi::AnyBuffer>()          // recv_x [L, R * N, H]
      .template Ret<ffi::AnyBuffer>()          // recv_scales [L, R * N, H / 128]
      .template Ret<ffi::Buffer<ffi::S32>>()   // recv_count [L]
      .template Ret<ffi::Buffer<ffi::S32>>()   // layout [L, R] (handle)
      .template Ret<ffi::Buffer<ffi::S32>>()   // src_slot [L, R * N] (handle)
      .template Ret<ffi::Buffer<ffi::F32>>();  // recv_weights [L, R * N] (handle)
}

template <class Binding>
auto low_latency_combine_send_signature(Binding b) {
  return std::move(b)
      .template Attrs<LowLatencyTopkAttrs>()
      .template Arg<ffi::AnyBuffer>()          // y [L, R * N, H]
      .template Arg<ffi::Buffer<ffi::S32>>()   // layout (handle)
      .template Arg<ffi::Buffer<ffi::S32>>()   // src_slot (handle)
      .template Arg<ffi::Buffer<ffi::F32>>()   // row_weights (handle's recv_weights), or [0]: rows go back per slot
      .template Arg<ffi::AnyBuffer>()          // order: ignored
      .template Ret<ffi::Buffer<ffi::S32>>();  // token for the receive half
}

template <class Binding>
auto low_latency_combine_recv_signature(Binding b) {
  return std::move(b)
      .template Attrs<LowLatencyAttrs>()
      .template Arg<ffi::AnyBuffer>()         // token of the send half
      .template Arg<ffi::Buffer<ffi::S32>>()  // topk_idx
      .template Arg<ffi::Buffer<ffi::F32>>()  // topk_weights
      .template Arg<ffi::AnyBuffer>()         // order: ignored
      .template Ret<ffi::AnyBuffer>();        // combined [T, H]
}

// The lowering passes every EP group of the mesh ([groups, size] runtime ranks). Returns the start of the row
// that holds `rank` and the rank's index in it, or {nullptr, -1}.
inline std::pair<const int32_t*, int> find_group(ffi::Span<const int32_t> table, int64_t size, int64_t rank) {
  for (size_t row = 0; size > 0 && row + size <= table.size(); row += size)
    for (int64_t i = 0; i < size; ++i)
      if (table[row + i] == rank) return {table.begin() + row, int(i)};
  return {nullptr, -1};
}

// An Overflow as decoded: XLA casts any integer to the enum, and only these two are policies.
inline Overflow checked_overflow(Overflow overflow) {
  if (overflow != Overflow::kError && overflow != Overflow::kDrop)
    throw std::invalid_argument("uccl_ep: overflow must be 0 (error) or 1 (drop), got " +
                                std::to_string(int64_t(overflow)));
  return overflow;
}

// The expert layout's pair rows from token rows (ExpandPairsArgs), where a path's receive writes token rows.
template <class Binding>
auto expand_pairs_signature(Binding b) {
  return std::move(b)
      .template Attrs<ExpandPairsAttrs>()
      .template Arg<ffi::AnyBuffer>()         // rows [C, ...]
      .template Arg<ffi::Buffer<ffi::S32>>()  // pair_row [M]: the row of each slot, C outside the groups
      .template Ret<ffi::AnyBuffer>();        // pairs [M, ...]
}

inline ExpandPairsArgs expand_pairs_args(const ExpandPairsAttrs& attrs, const ffi::AnyBuffer& rows,
                                         const ffi::Buffer<ffi::S32>& pair_row, ffi::Result<ffi::AnyBuffer>& pairs) {
  const auto from = rows.dimensions(), to = pairs->dimensions();
  const int64_t num_slots = pair_row.element_count();
  bool same = from.size() >= 1 && to.size() == from.size() && to[0] == num_slots &&
              pairs->element_type() == rows.element_type();
  for (size_t d = 1; same && d < from.size(); ++d) same = to[d] == from[d];
  if (!same)
    throw InvalidArgument(
        "uccl_ep expand_pairs: the pair rows must be [pair slots, ...] of the rows' row shape and "
        "dtype");
  ExpandPairsArgs a{};
  a.rows = rows.untyped_data();
  a.num_rows = from[0];
  a.row_bytes = num_slots ? int64_t(pairs->size_bytes()) / num_slots : 0;
  a.pair_row = pair_row.typed_data();
  a.num_slots = num_slots;
  a.pairs = pairs->untyped_data();
  a.zero_padding = attrs.zero_padding != 0;
  return a;
}

// The contract's element types from XLA's.
inline FloatType float_type(const ffi::AnyBuffer& b, const char* op) {
  if (b.element_type() == ffi::DataType::F32) return FloatType::kF32;
  if (b.element_type() == ffi::DataType::BF16) return FloatType::kBF16;
  throw InvalidArgument(std::string("uccl_ep ") + op + ": rows must be float32 or bfloat16");
}

// Each received row's sum of its pair rows (SumPairsArgs), where a path's receive wrote token rows.
template <class Binding>
auto sum_pairs_signature(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // pairs [M, H]
      .template Arg<ffi::Buffer<ffi::S32>>()  // pair_of [C, K]: the slot of each row's pairs, M where none
      .template Ret<ffi::AnyBuffer>();        // rows [C, H]
}

inline SumPairsArgs sum_pairs_args(const ffi::AnyBuffer& pairs, const ffi::Buffer<ffi::S32>& pair_of,
                                   ffi::AnyBuffer rows) {
  const auto in = pairs.dimensions(), of = pair_of.dimensions(), out = rows.dimensions();
  if (in.size() != 2 || of.size() != 2 || out.size() != 2 || out[0] != of[0] || out[1] != in[1])
    throw InvalidArgument(
        "uccl_ep sum_pairs: expected pairs [M, H], pair_of [C, K] and rows [C, H] (a row for each of pair_of's)");
  SumPairsArgs a{};
  a.pairs = pairs.untyped_data();
  a.pairs_dtype = float_type(pairs, "sum_pairs");
  a.num_slots = in[0];
  a.hidden = in[1];
  a.pair_of = pair_of.typed_data();
  a.num_rows = of[0];
  a.topk = int(of[1]);
  a.rows = rows.untyped_data();
  a.rows_dtype = float_type(rows, "sum_pairs");
  return a;
}

// The experts' step between their grouped matmuls (SwigluArgs): swiglu, and its gradient swiglu_grad.
template <class Binding>
auto swiglu_signature(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // gate_up [rows, 2 * features]
      .template Arg<ffi::Buffer<ffi::F32>>()  // weight [rows]
      .template Arg<ffi::Buffer<ffi::S32>>()  // num_rows []: the groups' rows
      .template Ret<ffi::AnyBuffer>();        // h [rows, features]
}
template <class Binding>
auto swiglu_grad_signature(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()          // gate_up [rows, 2 * features]
      .template Arg<ffi::Buffer<ffi::F32>>()   // weight [rows]
      .template Arg<ffi::AnyBuffer>()          // dh [rows, features]
      .template Arg<ffi::Buffer<ffi::S32>>()   // num_rows []
      .template Ret<ffi::AnyBuffer>()          // d_gate_up [rows, 2 * features]
      .template Ret<ffi::Buffer<ffi::F32>>();  // d_weight [rows]
}

// `dh` and `d_weight` only for the gradient.
inline SwigluArgs swiglu_args(const ffi::AnyBuffer& gate_up, const ffi::Buffer<ffi::F32>& weight,
                              const ffi::AnyBuffer* dh, const ffi::Buffer<ffi::S32>& num_rows, ffi::AnyBuffer out,
                              ffi::Buffer<ffi::F32>* d_weight) {
  const char* op = dh ? "swiglu_grad" : "swiglu";
  const auto in = gate_up.dimensions();
  const auto shaped = [&](const ffi::AnyBuffer& b, int64_t cols) {
    const auto d = b.dimensions();
    return d.size() == 2 && d[0] == in[0] && d[1] == cols && b.element_type() == gate_up.element_type();
  };
  if (in.size() != 2 || in[1] % 2 != 0 || weight.element_count() != size_t(in[0]) || num_rows.element_count() != 1 ||
      !shaped(out, dh ? in[1] : in[1] / 2) || (dh && !shaped(*dh, in[1] / 2)) ||
      (d_weight && d_weight->element_count() != size_t(in[0])))
    throw InvalidArgument(std::string("uccl_ep ") + op +
                          ": expected gate_up [rows, 2F], weight [rows], num_rows [] and rows of F (the gradient "
                          "of 2F) of gate_up's dtype");
  SwigluArgs a{};
  a.dtype = float_type(gate_up, op);
  a.gate_up = gate_up.untyped_data();
  a.weight = weight.typed_data();
  a.dh = dh ? dh->untyped_data() : nullptr;
  a.out = out.untyped_data();
  a.d_weight = d_weight ? d_weight->typed_data() : nullptr;
  a.rows = in[0];
  a.features = in[1] / 2;
  a.num_rows = num_rows.typed_data();
  return a;
}

// Each op's FFI buffers and attributes decoded into its contract arguments, for every backend.
inline LayoutArgs layout_args(const LayoutAttrs& attrs, const ffi::Buffer<ffi::S32>& topk_idx,
                              ffi::Result<ffi::Buffer<ffi::S32>>& num_tokens_per_rank,
                              ffi::Result<ffi::Buffer<ffi::S32>>& num_tokens_per_expert,
                              ffi::Result<ffi::Buffer<ffi::PRED>>& is_token_in_rank) {
  return LayoutArgs{topk_idx.typed_data(),
                    int(topk_idx.dimensions()[0]),
                    int(topk_idx.dimensions()[1]),
                    int(attrs.num_experts),
                    int(attrs.num_ranks),
                    num_tokens_per_rank->typed_data(),
                    num_tokens_per_expert->typed_data(),
                    is_token_in_rank->typed_data()};
}

// A dispatch's inputs, its handle's outputs and the attributes both dispatch ops share; the received rows unset.
template <class Attrs>
DispatchArgs dispatch_inputs(const Attrs& attrs, const ffi::AnyBuffer& x, const ffi::AnyBuffer& scales,
                             const ffi::Buffer<ffi::S32>& topk_idx, const ffi::Buffer<ffi::F32>& topk_weights,
                             ffi::Result<ffi::Buffer<ffi::PRED>>& is_token_in_rank,
                             ffi::Result<ffi::Buffer<ffi::S32>>& recv_counts) {
  DispatchArgs a{};
  a.x = x.untyped_data();
  a.x_row_bytes = row_bytes(x);
  a.scales = scales.untyped_data();
  a.scale_row_bytes = row_bytes(scales);
  a.topk_idx = topk_idx.typed_data();
  a.topk_weights = topk_weights.element_count() != 0 ? topk_weights.typed_data() : nullptr;
  a.num_tokens = int(topk_idx.dimensions()[0]);
  a.topk = int(topk_idx.dimensions()[1]);
  a.num_experts = int(attrs.num_experts);
  a.overflow = checked_overflow(attrs.overflow);
  a.overflow_status_over_job = attrs.two_level == Level::kNode;
  a.is_token_in_rank = is_token_in_rank->typed_data();
  a.recv_counts = recv_counts->typed_data();
  a.op_index = uint32_t(attrs.op_index);
  a.node_size = int(attrs.node_size);
  return a;
}

inline DispatchArgs dispatch_args(const DispatchAttrs& attrs, const ffi::AnyBuffer& x, const ffi::AnyBuffer& scales,
                                  const ffi::Buffer<ffi::S32>& topk_idx, const ffi::Buffer<ffi::F32>& topk_weights,
                                  ffi::Result<ffi::AnyBuffer>& recv_x, ffi::Result<ffi::AnyBuffer>& recv_scales,
                                  ffi::Result<ffi::Buffer<ffi::S32>>& recv_topk_idx,
                                  ffi::Result<ffi::Buffer<ffi::F32>>& recv_topk_weights,
                                  ffi::Result<ffi::Buffer<ffi::S32>>& recv_num_tokens,
                                  ffi::Result<ffi::Buffer<ffi::S32>>& num_tokens_per_expert,
                                  ffi::Result<ffi::Buffer<ffi::PRED>>& is_token_in_rank,
                                  ffi::Result<ffi::Buffer<ffi::S32>>& recv_counts) {
  DispatchArgs a = dispatch_inputs(attrs, x, scales, topk_idx, topk_weights, is_token_in_rank, recv_counts);
  const bool weights = a.topk_weights != nullptr;
  a.capacity = int(recv_x->dimensions()[0]);
  a.recv_x = recv_x->untyped_data();
  a.recv_scales = recv_scales->untyped_data();
  a.recv_topk_idx = recv_topk_idx->typed_data();
  a.recv_topk_weights = weights ? recv_topk_weights->typed_data() : nullptr;
  a.recv_num_tokens = recv_num_tokens->typed_data();
  a.num_tokens_per_expert = num_tokens_per_expert->typed_data();
  return a;
}

inline CachedDispatchArgs cached_dispatch_args(const HandleOpAttrs& attrs, const ffi::AnyBuffer& x,
                                               const ffi::Buffer<ffi::PRED>& is_token_in_rank,
                                               const ffi::Buffer<ffi::S32>& recv_counts,
                                               ffi::Result<ffi::AnyBuffer>& recv_x) {
  return CachedDispatchArgs{x.untyped_data(),
                            row_bytes(x),
                            int(x.dimensions()[0]),
                            int(recv_x->dimensions()[0]),
                            checked_overflow(attrs.overflow),
                            is_token_in_rank.typed_data(),
                            recv_counts.typed_data(),
                            recv_x->untyped_data(),
                            uint32_t(attrs.op_index),
                            int(attrs.node_size)};
}

// The pair buffer dispatch_pairs writes (the contract's PairBuffer).
inline PairBuffer pair_buffer(const DispatchPairsAttrs& attrs, ffi::Result<ffi::AnyBuffer>& x,
                              ffi::Result<ffi::AnyBuffer>& scales, ffi::Result<ffi::Buffer<ffi::F32>>& weights,
                              ffi::Result<ffi::Buffer<ffi::S32>>& expert_offsets,
                              ffi::Result<ffi::Buffer<ffi::S32>>& pairs_per_expert,
                              ffi::Result<ffi::Buffer<ffi::S32>>& pair_row, ffi::Result<ffi::Buffer<ffi::S32>>& pair_of,
                              ffi::Result<ffi::Buffer<ffi::S32>>& stats) {
  if (attrs.expert_alignment < 1)
    throw InvalidArgument("uccl_ep dispatch(layout='expert'): expert_alignment must be >= 1, got " +
                          std::to_string(attrs.expert_alignment));
  PairBuffer p{int(x->dimensions()[0]),
               int(attrs.expert_alignment),
               int(pair_of->dimensions()[0]),
               x->untyped_data(),
               scales->untyped_data(),
               weights->element_count() != 0 ? weights->typed_data() : nullptr,
               expert_offsets->typed_data(),
               pairs_per_expert->typed_data(),
               pair_row->typed_data(),
               pair_of->typed_data(),
               stats->typed_data()};
  p.zero_padding = attrs.zero_padding != 0;
  return p;
}

inline CombineArgs combine_args(const HandleOpAttrs& attrs, const ffi::AnyBuffer& y,
                                const ffi::Buffer<ffi::PRED>& is_token_in_rank,
                                const ffi::Buffer<ffi::S32>& recv_counts, ffi::Result<ffi::AnyBuffer>& out) {
  return CombineArgs{y.untyped_data(),
                     float_type(y, "combine"),
                     int(y.dimensions()[1]),
                     int(y.dimensions()[0]),
                     int(is_token_in_rank.dimensions()[0]),
                     checked_overflow(attrs.overflow),
                     is_token_in_rank.typed_data(),
                     recv_counts.typed_data(),
                     out->untyped_data(),
                     uint32_t(attrs.op_index),
                     int(attrs.node_size)};
}

// Low-latency ops come in halves; each half fills its part of the arguments.
inline void set_low_latency_dispatch_inputs(LowLatencyDispatchArgs& a, const LowLatencyDispatchAttrs& attrs,
                                            const ffi::AnyBuffer& x, const ffi::AnyBuffer& scales,
                                            const ffi::Buffer<ffi::S32>& topk_idx,
                                            const ffi::Buffer<ffi::F32>& topk_weights) {
  const DispatchRows rows = dispatch_rows(x, scales, attrs.fp8_cast);
  a.x = x.untyped_data();
  a.x_row_bytes = rows.row_bytes;
  a.scales = rows.cast == Fp8Cast::kNone ? scales.untyped_data() : nullptr;
  a.scale_row_bytes = rows.scale_row_bytes;
  a.cast = rows.cast;
  a.x_bf16 = rows.x_bf16;
  a.topk_idx = topk_idx.typed_data();
  a.num_tokens = int(topk_idx.dimensions()[0]);
  a.topk = int(topk_idx.dimensions()[1]);
  a.topk_weights = topk_weights.element_count() == 0 ? nullptr : topk_weights.typed_data();
  a.op_index = uint32_t(attrs.op_index);
}

inline void set_low_latency_dispatch_outputs(LowLatencyDispatchArgs& a, ffi::Result<ffi::AnyBuffer>& recv_x,
                                             ffi::Result<ffi::AnyBuffer>& recv_scales,
                                             ffi::Result<ffi::Buffer<ffi::S32>>& recv_count,
                                             ffi::Result<ffi::Buffer<ffi::S32>>& layout,
                                             ffi::Result<ffi::Buffer<ffi::S32>>& src_slot,
                                             ffi::Result<ffi::Buffer<ffi::F32>>& recv_weights) {
  a.x_row_bytes = row_bytes_3d(*recv_x);
  a.scale_row_bytes = row_bytes_3d(*recv_scales);
  a.recv_x = recv_x->untyped_data();
  a.recv_scales = recv_scales->untyped_data();
  a.recv_count = recv_count->typed_data();
  a.layout = layout->typed_data();
  a.src_slot = src_slot->typed_data();
  a.recv_weights = recv_weights->typed_data();
}

inline void set_low_latency_combine_send(LowLatencyCombineArgs& a, const ffi::AnyBuffer& y,
                                         const ffi::Buffer<ffi::S32>& layout, const ffi::Buffer<ffi::S32>& src_slot,
                                         const ffi::Buffer<ffi::F32>& row_weights, int64_t op_index) {
  a.y = y.untyped_data();
  a.dtype = float_type(y, "low_latency_combine");
  a.hidden = int(y.dimensions()[2]);
  a.layout = layout.typed_data();
  a.src_slot = src_slot.typed_data();
  a.row_weights = row_weights.element_count() == 0 ? nullptr : row_weights.typed_data();
  a.op_index = uint32_t(op_index);
}

inline void set_low_latency_combine_receive(LowLatencyCombineArgs& a, const ffi::Buffer<ffi::S32>& topk_idx,
                                            const ffi::Buffer<ffi::F32>& topk_weights,
                                            ffi::Result<ffi::AnyBuffer>& out) {
  a.dtype = float_type(*out, "low_latency_combine");
  a.hidden = int(out->dimensions()[1]);
  a.topk_idx = topk_idx.typed_data();
  a.topk_weights = topk_weights.typed_data();
  a.num_tokens = int(topk_idx.dimensions()[0]);
  a.topk = int(topk_idx.dimensions()[1]);
  a.out = out->untyped_data();
}

}  // namespace uccl_ep::ffi_common

// XLA's decoding of the attributes above (in namespace xla::ffi, hence out here). The enums travel as int64 scalars.
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(uccl_ep::Path);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(uccl_ep::Overflow);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(uccl_ep::Level);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(uccl_ep::ffi_common::PairCapacityAttrs, StructMember<int64_t>("capacity"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(uccl_ep::ffi_common::ExpandPairsAttrs, StructMember<int64_t>("zero_padding"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(uccl_ep::ffi_common::LayoutAttrs, StructMember<int64_t>("num_experts"),
                                      StructMember<int64_t>("num_ranks"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(uccl_ep::ffi_common::DispatchAttrs,
                                      StructMember<Span<const int32_t>>("group_table"),
                                      StructMember<int64_t>("group_size"), StructMember<int64_t>("op_index"),
                                      StructMember<int64_t>("num_experts"), StructMember<uccl_ep::Level>("two_level"),
                                      StructMember<uccl_ep::Path>("path"), StructMember<int64_t>("node_size"),
                                      StructMember<uccl_ep::Overflow>("overflow"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(uccl_ep::ffi_common::DispatchPairsAttrs,
                                      StructMember<Span<const int32_t>>("group_table"),
                                      StructMember<int64_t>("group_size"), StructMember<int64_t>("op_index"),
                                      StructMember<int64_t>("num_experts"), StructMember<uccl_ep::Level>("two_level"),
                                      StructMember<uccl_ep::Path>("path"), StructMember<int64_t>("node_size"),
                                      StructMember<uccl_ep::Overflow>("overflow"),
                                      StructMember<int64_t>("expert_alignment"), StructMember<int64_t>("zero_padding"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(uccl_ep::ffi_common::HandleOpAttrs,
                                      StructMember<Span<const int32_t>>("group_table"),
                                      StructMember<int64_t>("group_size"), StructMember<int64_t>("op_index"),
                                      StructMember<uccl_ep::Level>("two_level"), StructMember<uccl_ep::Path>("path"),
                                      StructMember<int64_t>("node_size"), StructMember<uccl_ep::Overflow>("overflow"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(uccl_ep::ffi_common::LowLatencyAttrs,
                                      StructMember<Span<const int32_t>>("group_table"),
                                      StructMember<int64_t>("group_size"), StructMember<int64_t>("op_index"),
                                      StructMember<int64_t>("num_experts"),
                                      StructMember<int64_t>("max_tokens_per_rank"),
                                      StructMember<uccl_ep::Path>("path"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(uccl_ep::ffi_common::LowLatencyDispatchAttrs,
                                      StructMember<Span<const int32_t>>("group_table"),
                                      StructMember<int64_t>("group_size"), StructMember<int64_t>("op_index"),
                                      StructMember<int64_t>("num_experts"),
                                      StructMember<int64_t>("max_tokens_per_rank"), StructMember<uccl_ep::Path>("path"),
                                      StructMember<int64_t>("fp8_cast"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(uccl_ep::ffi_common::LowLatencyTopkAttrs,
                                      StructMember<Span<const int32_t>>("group_table"),
                                      StructMember<int64_t>("group_size"), StructMember<int64_t>("op_index"),
                                      StructMember<int64_t>("num_experts"),
                                      StructMember<int64_t>("max_tokens_per_rank"), StructMember<uccl_ep::Path>("path"),
                                      StructMember<int64_t>("topk"));
