// XLA FFI handlers for CPU devices: decode buffers and attributes, find the device's runtime state by ordinal,
// call the CPU implementation in kernels/cpu. Nothing else happens here.
#include "cpu_handlers.hpp"

#include <cstring>
#include <exception>
#include <mutex>
#include <shared_mutex>
#include <string>

#include "../kernels/cpu/experts.hpp"
#include "../kernels/cpu/low_latency.hpp"
#include "../kernels/cpu/normal.hpp"
#include "../kernels/cpu/pairs.hpp"
#include "../kernels/settings.hpp"
#include "common.hpp"
#ifdef UCCL_EP_WITH_CUDA
#include "staged.hpp"
#endif

namespace ffi = xla::ffi;

namespace uccl_ep::ffi_cpu {
namespace {

namespace ffi_common = uccl_ep::ffi_common;

template <class Body>
ffi::Error guarded(Body&& body) {
  return ffi_common::guarded(Runtime::get().lifetime_mutex(), std::forward<Body>(body));
}

// An op that is one level of a two-level dispatch or combine (jax_uccl_ep/normal.py; attribute two_level != 0): the
// other level's ranks wait on this one's rows, so a failure (bad input included, which fails only this level's
// group) aborts every rank of the job, and all fail at once with this rank's reason instead of at their deadline.
// The runtime then needs shutdown() and initialize(), as after any abort.
template <class Op>
void aborting_the_job_on_failure(Device& dev, Level two_level, Op&& op) {
  try {
    op();
  } catch (const cpu::RaisedOnEveryRank&) {
    throw;  // every rank of the job raises it in this op: all stay in step
  } catch (const std::exception& e) {
    // A rank that failed on a peer's abort does not pass it on: the author told everyone.
    if (two_level != Level::kFlat && !dev.aborted_by_peer()) {
      std::vector<uint32_t> everyone(dev.num_ranks());
      for (uint32_t r = 0; r < dev.num_ranks(); ++r) everyone[r] = r;
      std::lock_guard<std::mutex> lock(dev.op_mutex());
      dev.abort(everyone, e.what());
    }
    throw;
  }
}

// Test mode (handler_test_modes().poison): outputs filled with 0xFF bytes before an op, so a row the op forgets to
// write shows as NaN or -1 in tests instead of looking like valid data.
template <class... Buffers>
void poison(Buffers&... buffers) {
  if (handler_test_modes().poison) (std::memset(buffers->untyped_data(), 0xFF, buffers->size_bytes()), ...);
}

// The lowering passes every EP group of the mesh ([groups, size], runtime ranks); this device's is the row
// that holds its rank.
Group group_of(Device& dev, ffi::Span<const int32_t> table, int64_t size, const char* op) {
  auto [row, index] = ffi_common::find_group(table, size, dev.rank());
  if (!row)
    throw InvalidArgument(std::string("uccl_ep ") + op + ": rank " + std::to_string(dev.rank()) +
                          " is in no EP group of the mesh");
  return cpu::make_group(dev, row, int(size), op);
}

using ffi_common::DispatchAttrs;
using ffi_common::HandleOpAttrs;
using ffi_common::LayoutAttrs;
using ffi_common::LowLatencyAttrs;
using ffi_common::LowLatencyDispatchAttrs;
using ffi_common::LowLatencyTopkAttrs;

ffi::Error LayoutImpl(const LayoutAttrs& attrs, ffi::Buffer<ffi::S32> topk_idx,
                      ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_rank,
                      ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_expert,
                      ffi::Result<ffi::Buffer<ffi::PRED>> is_token_in_rank) {
  return guarded([&] {
    const LayoutArgs a =
        ffi_common::layout_args(attrs, topk_idx, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank);
    cpu::get_dispatch_layout(a.topk_idx, a.num_tokens, a.topk, a.num_experts, a.num_ranks, a.num_tokens_per_rank,
                             a.num_tokens_per_expert, a.is_token_in_rank);
  });
}

ffi::Error PairCapacityImpl(const ffi_common::PairCapacityAttrs& attrs, ffi::Buffer<ffi::S32> needed,
                            ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::Buffer<ffi::S32>> zero) {
  return guarded([&] {
    *zero->typed_data() = 0;
    ffi_common::check_pair_capacity(*needed.typed_data(), *rank.typed_data(), attrs.capacity);
  });
}

ffi::Error ExpandPairsImpl(const ffi_common::ExpandPairsAttrs& attrs, ffi::AnyBuffer rows,
                           ffi::Buffer<ffi::S32> pair_row, ffi::Result<ffi::AnyBuffer> pairs) {
  return guarded([&] {
    if (!attrs.zero_padding) poison(pairs);  // the slots outside the groups are left as they are
    cpu::expand_pairs(ffi_common::expand_pairs_args(attrs, rows, pair_row, pairs));
  });
}

ffi::Error SumPairsImpl(ffi::AnyBuffer pairs, ffi::Buffer<ffi::S32> pair_of, ffi::Result<ffi::AnyBuffer> rows) {
  return guarded([&] { cpu::sum_pairs(ffi_common::sum_pairs_args(pairs, pair_of, *rows)); });
}

// The rows past the groups keep whatever the output held: poisoned in test mode.
ffi::Error SwigluImpl(ffi::AnyBuffer gate_up, ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::S32> num_rows,
                      ffi::Result<ffi::AnyBuffer> h) {
  return guarded([&] {
    poison(h);
    cpu::swiglu(ffi_common::swiglu_args(gate_up, weight, nullptr, num_rows, *h, nullptr));
  });
}
ffi::Error SwigluGradImpl(ffi::AnyBuffer gate_up, ffi::Buffer<ffi::F32> weight, ffi::AnyBuffer dh,
                          ffi::Buffer<ffi::S32> num_rows, ffi::Result<ffi::AnyBuffer> d_gate_up,
                          ffi::Result<ffi::Buffer<ffi::F32>> d_weight) {
  return guarded([&] {
    poison(d_gate_up, d_weight);
    cpu::swiglu(ffi_common::swiglu_args(gate_up, weight, &dh, num_rows, *d_gate_up, &*d_weight));
  });
}

ffi::Error DispatchImpl(int32_t ordinal, const DispatchAttrs& attrs, ffi::AnyBuffer x, ffi::AnyBuffer scales,
                        ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/,
                        ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_scales,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_topk_idx,
                        ffi::Result<ffi::Buffer<ffi::F32>> recv_topk_weights,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_num_tokens,
                        ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_expert,
                        ffi::Result<ffi::Buffer<ffi::PRED>> is_token_in_rank,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_counts) {
  return guarded([&] {
    poison(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_num_tokens, num_tokens_per_expert,
           is_token_in_rank, recv_counts);
    Device& dev = Runtime::get().device_by_ordinal(ordinal);
    const Group g = group_of(dev, attrs.group_table, attrs.group_size, "dispatch");
    const DispatchArgs a = ffi_common::dispatch_args(attrs, x, scales, topk_idx, topk_weights, recv_x, recv_scales,
                                                     recv_topk_idx, recv_topk_weights, recv_num_tokens,
                                                     num_tokens_per_expert, is_token_in_rank, recv_counts);
    aborting_the_job_on_failure(dev, attrs.two_level, [&] { cpu::dispatch(dev, g, a); });
  });
}

ffi::Error CachedDispatchImpl(int32_t ordinal, const HandleOpAttrs& attrs, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::PRED> is_token_in_rank, ffi::Buffer<ffi::S32> recv_counts,
                              ffi::AnyBuffer /*order*/, ffi::Result<ffi::AnyBuffer> recv_x) {
  return guarded([&] {
    poison(recv_x);
    Device& dev = Runtime::get().device_by_ordinal(ordinal);
    const Group g = group_of(dev, attrs.group_table, attrs.group_size, "cached_dispatch");
    const CachedDispatchArgs a = ffi_common::cached_dispatch_args(attrs, x, is_token_in_rank, recv_counts, recv_x);
    aborting_the_job_on_failure(dev, attrs.two_level, [&] { cpu::cached_dispatch(dev, g, a); });
  });
}

ffi::Error CombineImpl(int32_t ordinal, const HandleOpAttrs& attrs, ffi::AnyBuffer y,
                       ffi::Buffer<ffi::PRED> is_token_in_rank, ffi::Buffer<ffi::S32> recv_counts,
                       ffi::AnyBuffer /*order*/, ffi::Result<ffi::AnyBuffer> out) {
  return guarded([&] {
    poison(out);
    Device& dev = Runtime::get().device_by_ordinal(ordinal);
    const Group g = group_of(dev, attrs.group_table, attrs.group_size, "combine");
    const CombineArgs a = ffi_common::combine_args(attrs, y, is_token_in_rank, recv_counts, out);
    aborting_the_job_on_failure(dev, attrs.two_level, [&] { cpu::combine(dev, g, a); });
  });
}

ffi::Error DispatchPairsImpl(int32_t ordinal, const ffi_common::DispatchPairsAttrs& attrs, ffi::AnyBuffer x,
                             ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                             ffi::AnyBuffer /*order*/, ffi::Result<ffi::AnyBuffer> pair_x,
                             ffi::Result<ffi::AnyBuffer> pair_scales, ffi::Result<ffi::Buffer<ffi::F32>> pair_weights,
                             ffi::Result<ffi::Buffer<ffi::S32>> expert_offsets,
                             ffi::Result<ffi::Buffer<ffi::S32>> pairs_per_expert,
                             ffi::Result<ffi::Buffer<ffi::S32>> pair_row, ffi::Result<ffi::Buffer<ffi::S32>> pair_of,
                             ffi::Result<ffi::Buffer<ffi::S32>> stats,
                             ffi::Result<ffi::Buffer<ffi::PRED>> is_token_in_rank,
                             ffi::Result<ffi::Buffer<ffi::S32>> recv_counts) {
  return guarded([&] {
    poison(pair_x, pair_scales, pair_weights, expert_offsets, pairs_per_expert, pair_row, pair_of, stats,
           is_token_in_rank, recv_counts);
    Device& dev = Runtime::get().device_by_ordinal(ordinal);
    const Group g = group_of(dev, attrs.group_table, attrs.group_size, "dispatch");
    DispatchArgs a =
        ffi_common::dispatch_inputs(attrs, x, scales, topk_idx, topk_weights, is_token_in_rank, recv_counts);
    const PairBuffer p = ffi_common::pair_buffer(attrs, pair_x, pair_scales, pair_weights, expert_offsets,
                                                 pairs_per_expert, pair_row, pair_of, stats);
    a.capacity = p.rows;
    aborting_the_job_on_failure(dev, attrs.two_level, [&] { cpu::dispatch_pairs(dev, g, a, p); });
  });
}

ffi::Error CachedDispatchPairsImpl(int32_t ordinal, const HandleOpAttrs& attrs, ffi::AnyBuffer x,
                                   ffi::Buffer<ffi::S32> pair_row, ffi::Buffer<ffi::S32> pair_of,
                                   ffi::Buffer<ffi::PRED> is_token_in_rank, ffi::Buffer<ffi::S32> recv_counts,
                                   ffi::AnyBuffer /*order*/, ffi::Result<ffi::AnyBuffer> out) {
  return guarded([&] {
    poison(out);
    Device& dev = Runtime::get().device_by_ordinal(ordinal);
    const Group g = group_of(dev, attrs.group_table, attrs.group_size, "cached_dispatch");
    CachedDispatchArgs a = ffi_common::cached_dispatch_args(attrs, x, is_token_in_rank, recv_counts, out);
    a.capacity = int(pair_of.dimensions()[0]);
    aborting_the_job_on_failure(dev, attrs.two_level, [&] {
      cpu::cached_dispatch_pairs(dev, g, a, pair_row.typed_data(), int(pair_row.element_count()), out->untyped_data());
    });
  });
}

ffi::Error CombinePairsImpl(int32_t ordinal, const HandleOpAttrs& attrs, ffi::AnyBuffer y,
                            ffi::Buffer<ffi::S32> pair_of, ffi::Buffer<ffi::PRED> is_token_in_rank,
                            ffi::Buffer<ffi::S32> recv_counts, ffi::AnyBuffer /*order*/,
                            ffi::Result<ffi::AnyBuffer> out) {
  return guarded([&] {
    poison(out);
    Device& dev = Runtime::get().device_by_ordinal(ordinal);
    const Group g = group_of(dev, attrs.group_table, attrs.group_size, "combine");
    CombineArgs a = ffi_common::combine_args(attrs, y, is_token_in_rank, recv_counts, out);
    a.capacity = int(pair_of.dimensions()[0]);
    a.y = nullptr;
    aborting_the_job_on_failure(dev, attrs.two_level, [&] {
      cpu::combine_pairs(dev, g, a, y.untyped_data(), int(y.dimensions()[0]), pair_of.typed_data(),
                         int(pair_of.dimensions()[1]));
    });
  });
}

// What every low-latency handler does first: find the device and its group, set the static sizes.
template <class Args, class Attrs, class Body>
ffi::Error low_latency_op(int32_t ordinal, const Attrs& attrs, const char* op, Body&& body) {
  return guarded([&] {
    Device& dev = Runtime::get().device_by_ordinal(ordinal);
    const Group g = group_of(dev, attrs.group_table, attrs.group_size, op);
    Args a{};
    a.num_experts = int(attrs.num_experts);
    a.max_tokens_per_rank = int(attrs.max_tokens_per_rank);
    body(dev, g, a);
  });
}

ffi::Error LowLatencyDispatchImpl(int32_t ordinal, const LowLatencyDispatchAttrs& attrs, ffi::AnyBuffer x,
                                  ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> topk_idx,
                                  ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/,
                                  ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_scales,
                                  ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                                  ffi::Result<ffi::Buffer<ffi::S32>> layout,
                                  ffi::Result<ffi::Buffer<ffi::S32>> src_slot,
                                  ffi::Result<ffi::Buffer<ffi::F32>> recv_weights) {
  return low_latency_op<LowLatencyDispatchArgs>(
      ordinal, attrs, "low_latency_dispatch", [&](Device& dev, const Group& g, LowLatencyDispatchArgs& a) {
        poison(recv_x, recv_scales, recv_count, layout, src_slot, recv_weights);
        ffi_common::set_low_latency_dispatch_outputs(a, recv_x, recv_scales, recv_count, layout, src_slot,
                                                     recv_weights);
        ffi_common::set_low_latency_dispatch_inputs(a, attrs, x, scales, topk_idx, topk_weights);
        cpu::low_latency_dispatch(dev, g, a);
      });
}

ffi::Error LowLatencyDispatchSendImpl(int32_t ordinal, const LowLatencyDispatchAttrs& attrs, ffi::AnyBuffer x,
                                      ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> topk_idx,
                                      ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/,
                                      ffi::Result<ffi::Buffer<ffi::S32>> token) {
  return low_latency_op<LowLatencyDispatchArgs>(
      ordinal, attrs, "low_latency_dispatch", [&](Device& dev, const Group& g, LowLatencyDispatchArgs& a) {
        ffi_common::set_low_latency_dispatch_inputs(a, attrs, x, scales, topk_idx, topk_weights);
        cpu::low_latency_dispatch_send(dev, g, a);
        *token->typed_data() = int32_t(attrs.op_index);
      });
}

ffi::Error LowLatencyDispatchRecvImpl(int32_t ordinal, const LowLatencyTopkAttrs& attrs, ffi::AnyBuffer /*token*/,
                                      ffi::AnyBuffer /*order*/, ffi::Result<ffi::AnyBuffer> recv_x,
                                      ffi::Result<ffi::AnyBuffer> recv_scales,
                                      ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                                      ffi::Result<ffi::Buffer<ffi::S32>> layout,
                                      ffi::Result<ffi::Buffer<ffi::S32>> src_slot,
                                      ffi::Result<ffi::Buffer<ffi::F32>> recv_weights) {
  return low_latency_op<LowLatencyDispatchArgs>(
      ordinal, attrs, "low_latency_dispatch", [&](Device& dev, const Group& g, LowLatencyDispatchArgs& a) {
        poison(recv_x, recv_scales, recv_count, layout, src_slot, recv_weights);
        ffi_common::set_low_latency_dispatch_outputs(a, recv_x, recv_scales, recv_count, layout, src_slot,
                                                     recv_weights);
        cpu::low_latency_dispatch_receive(dev, g, a);
      });
}

// (src_slot is for the GPU kernels; the CPU exchange returns rows in the layout's order.)
ffi::Error LowLatencyCombineImpl(int32_t ordinal, const LowLatencyAttrs& attrs, ffi::AnyBuffer y,
                                 ffi::Buffer<ffi::S32> layout, ffi::Buffer<ffi::S32> src_slot,
                                 ffi::Buffer<ffi::F32> row_weights, ffi::Buffer<ffi::S32> topk_idx,
                                 ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/,
                                 ffi::Result<ffi::AnyBuffer> out) {
  return low_latency_op<LowLatencyCombineArgs>(
      ordinal, attrs, "low_latency_combine", [&](Device& dev, const Group& g, LowLatencyCombineArgs& a) {
        poison(out);
        ffi_common::set_low_latency_combine_receive(a, topk_idx, topk_weights, out);
        ffi_common::set_low_latency_combine_send(a, y, layout, src_slot, row_weights, attrs.op_index);
        cpu::low_latency_combine(dev, g, a);
      });
}

ffi::Error LowLatencyCombineSendImpl(int32_t ordinal, const LowLatencyTopkAttrs& attrs, ffi::AnyBuffer y,
                                     ffi::Buffer<ffi::S32> layout, ffi::Buffer<ffi::S32> src_slot,
                                     ffi::Buffer<ffi::F32> row_weights, ffi::AnyBuffer /*order*/,
                                     ffi::Result<ffi::Buffer<ffi::S32>> token) {
  return low_latency_op<LowLatencyCombineArgs>(
      ordinal, attrs, "low_latency_combine", [&](Device& dev, const Group& g, LowLatencyCombineArgs& a) {
        ffi_common::set_low_latency_combine_send(a, y, layout, src_slot, row_weights, attrs.op_index);
        a.topk = int(attrs.topk);
        cpu::low_latency_combine_send(dev, g, a);
        *token->typed_data() = int32_t(attrs.op_index);
      });
}

ffi::Error LowLatencyCombineRecvImpl(int32_t ordinal, const LowLatencyAttrs& attrs, ffi::AnyBuffer /*token*/,
                                     ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                                     ffi::AnyBuffer /*order*/, ffi::Result<ffi::AnyBuffer> out) {
  return low_latency_op<LowLatencyCombineArgs>(
      ordinal, attrs, "low_latency_combine", [&](Device& dev, const Group& g, LowLatencyCombineArgs& a) {
        poison(out);
        ffi_common::set_low_latency_combine_receive(a, topk_idx, topk_weights, out);
        cpu::low_latency_combine_receive(dev, g, a);
      });
}

}  // namespace
}  // namespace uccl_ep::ffi_cpu

using namespace uccl_ep::ffi_cpu;

XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpLayoutCpu, LayoutImpl, ffi_common::layout_signature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpPairCapacityCpu, PairCapacityImpl,
                              ffi_common::pair_capacity_signature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpExpandPairsCpu, ExpandPairsImpl,
                              ffi_common::expand_pairs_signature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpSumPairsCpu, SumPairsImpl, ffi_common::sum_pairs_signature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpSwigluCpu, SwigluImpl, ffi_common::swiglu_signature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpSwigluGradCpu, SwigluGradImpl, ffi_common::swiglu_grad_signature(ffi::Ffi::Bind()));

#define UCCL_EP_CPU_HANDLER(stem, name, signature)             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEp##stem##Cpu, stem##Impl, \
                                ffi_common::signature(ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>()));
UCCL_EP_FFI_OPS(UCCL_EP_CPU_HANDLER)
UCCL_EP_FFI_PAIR_OPS(UCCL_EP_CPU_HANDLER)

#ifdef UCCL_EP_WITH_CUDA
// The host-staged path of the ops on platform CUDA (cpu_handlers.hpp): the implementations above, on host copies.
namespace uccl_ep::ffi_cpu {
namespace {
#define UCCL_EP_IMPL_OF(stem, name, signature) \
  constexpr auto impl_of(ffi_common::stem##Op) { return &stem##Impl; }
UCCL_EP_FFI_OPS(UCCL_EP_IMPL_OF)
UCCL_EP_FFI_PAIR_OPS(UCCL_EP_IMPL_OF)
#undef UCCL_EP_IMPL_OF
}  // namespace

template <class Op, class... Args>
ffi::Error StagedOp<Op, ffi::Error(int32_t, Args...)>::call(cudaStream_t stream, int32_t ordinal, Args... args) {
  return Staged<impl_of(Op{})>::call(stream, ordinal, args...);
}

#define UCCL_EP_STAGED(stem, name, signature) template struct StagedOp<ffi_common::stem##Op, decltype(stem##Impl)>;
UCCL_EP_FFI_OPS(UCCL_EP_STAGED)
UCCL_EP_FFI_PAIR_OPS(UCCL_EP_STAGED)
#undef UCCL_EP_STAGED
}  // namespace uccl_ep::ffi_cpu
#endif
