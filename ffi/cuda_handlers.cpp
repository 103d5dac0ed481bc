// XLA FFI handlers for platform "CUDA": decode, find the GPU's state by device ordinal, call kernels/nvl on XLA's
// stream. Built only with CUDA. Each op's handler runs the path its `path` attribute names (jax_uccl_ep/_plan.py;
// OnPath below): the NVLink runtime (a node's GPUs), a node's NVLink runtime under two-level routing, the proxy
// runtime's GPU-initiated kernels, or the host-staged CPU implementation (cpu_handlers.cpp).
#include "cuda_handlers.hpp"

#include <cuda_runtime.h>

#include <array>
#include <exception>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "../kernels/nvl/api.hpp"
#include "../kernels/settings.hpp"
#include "../proxy/runtime.hpp"
#include "common.hpp"
#include "cpu_handlers.hpp"

namespace ffi = xla::ffi;
using uccl_ep::ffi_common::row_bytes;
using uccl_ep::ffi_common::row_bytes_3d;
using uccl_ep::nvl::NvlDevice;
using uccl_ep::nvl::NvlRuntime;

namespace {

// Where an op's GPU state lives: the NVLink runtime (GPUs of one node), the proxy runtime (GPUs on several nodes,
// GPU-initiated), or a node's NVLink runtime beside the proxy runtime (the node level of two-level routing, see
// jax_uccl_ep/normal.py). kernels/nvl overloads each op on the device type.
struct OverNvlink {
  using Device = NvlDevice;
  static constexpr bool kNodeLevel = false;
  static std::shared_mutex& lifetime() { return NvlRuntime::get().lifetime_mutex(); }
  static Device& device(int32_t ordinal) { return NvlRuntime::get().device_by_ordinal(ordinal); }
};
struct OverNodeNvlink : OverNvlink {
  static constexpr bool kNodeLevel = true;  // the lowering's tables hold runtime-wide ranks; NVLink numbers the node
};
struct OverProxy {
  using Device = uccl_ep::Device;
  static constexpr bool kNodeLevel = false;
  static std::shared_mutex& lifetime() { return uccl_ep::Runtime::get().lifetime_mutex(); }
  static Device& device(int32_t ordinal) { return uccl_ep::Runtime::get().device_by_ordinal(ordinal); }
};

// An op's group in the ranks its link uses: the lowering's row, or at the node level that row renumbered.
class LinkGroup {
 public:
  LinkGroup(const int32_t* row, int size, int self) : group_{row, size, self} {}
  void renumber(const NvlDevice& dev) {
    for (int s = 0; s < group_.size; ++s) {
      const int local = dev.local_of(group_.ranks[s]);
      if (local < 0)
        throw std::invalid_argument("uccl_ep: rank " + std::to_string(group_.ranks[s]) +
                                    " of a node-level group is "
                                    "not on the node of rank " +
                                    std::to_string(dev.global_rank()));
      local_[size_t(s)] = local;
    }
    renumbered_ = true;
  }
  uccl_ep::nvl::Group get() const {
    uccl_ep::nvl::Group g = group_;
    if (renumbered_) g.ranks = local_.data();
    return g;
  }

 private:
  uccl_ep::nvl::Group group_;
  bool renumbered_ = false;
  std::array<int32_t, uccl_ep::nvl::kMaxRanks> local_{};
};

// The row of the lowering's group table that holds this GPU's rank (see jax_uccl_ep/_ffi.py).
template <class Link, class Dev>
LinkGroup group_of(const Dev& dev, ffi::Span<const int32_t> table, int64_t size, const char* op) {
  int rank = dev.rank();
  if constexpr (Link::kNodeLevel) {
    rank = dev.global_rank();
    if (size > dev.num_ranks())
      throw std::invalid_argument(std::string("uccl_ep ") + op + ": a node-level group of " + std::to_string(size) +
                                  " ranks on a node of " + std::to_string(dev.num_ranks()) + " GPUs");
  }
  auto [row, index] = uccl_ep::ffi_common::find_group(table, size, rank);
  if (!row)
    throw std::invalid_argument(std::string("uccl_ep ") + op + ": rank " + std::to_string(rank) +
                                " is in no EP group of the mesh");
  LinkGroup g(row, int(size), index);
  if constexpr (Link::kNodeLevel) g.renumber(dev);
  return g;
}

using uccl_ep::ffi_common::DispatchAttrs;
using uccl_ep::ffi_common::HandleOpAttrs;
using uccl_ep::ffi_common::LayoutAttrs;
using uccl_ep::ffi_common::LowLatencyAttrs;
using uccl_ep::ffi_common::LowLatencyDispatchAttrs;
using uccl_ep::ffi_common::LowLatencyTopkAttrs;

template <class Link>
ffi::Error DispatchImpl(cudaStream_t stream, int32_t ordinal, const DispatchAttrs& attrs, ffi::AnyBuffer x,
                        ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                        ffi::AnyBuffer /*order*/, ffi::Result<ffi::AnyBuffer> recv_x,
                        ffi::Result<ffi::AnyBuffer> recv_scales, ffi::Result<ffi::Buffer<ffi::S32>> recv_topk_idx,
                        ffi::Result<ffi::Buffer<ffi::F32>> recv_topk_weights,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_num_tokens,
                        ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_expert,
                        ffi::Result<ffi::Buffer<ffi::PRED>> is_token_in_rank,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_counts) {
  return uccl_ep::ffi_common::guarded(Link::lifetime(), [&] {
    auto& dev = Link::device(ordinal);
    const auto group = group_of<Link>(dev, attrs.group_table, attrs.group_size, "dispatch");
    const auto& g = group.get();
    const auto a = uccl_ep::ffi_common::dispatch_args(attrs, x, scales, topk_idx, topk_weights, recv_x, recv_scales,
                                                      recv_topk_idx, recv_topk_weights, recv_num_tokens,
                                                      num_tokens_per_expert, is_token_in_rank, recv_counts);
    uccl_ep::nvl::dispatch(dev, g, a, stream);
  });
}

template <class Link>
ffi::Error CachedDispatchImpl(cudaStream_t stream, int32_t ordinal, const HandleOpAttrs& attrs, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::PRED> is_token_in_rank, ffi::Buffer<ffi::S32> recv_counts,
                              ffi::AnyBuffer /*order*/, ffi::Result<ffi::AnyBuffer> recv_x) {
  return uccl_ep::ffi_common::guarded(Link::lifetime(), [&] {
    auto& dev = Link::device(ordinal);
    const auto group = group_of<Link>(dev, attrs.group_table, attrs.group_size, "cached_dispatch");
    const auto& g = group.get();
    const auto a = uccl_ep::ffi_common::cached_dispatch_args(attrs, x, is_token_in_rank, recv_counts, recv_x);
    uccl_ep::nvl::cached_dispatch(dev, g, a, stream);
  });
}

template <class Link>
ffi::Error CombineImpl(cudaStream_t stream, int32_t ordinal, const HandleOpAttrs& attrs, ffi::AnyBuffer y,
                       ffi::Buffer<ffi::PRED> is_token_in_rank, ffi::Buffer<ffi::S32> recv_counts,
                       ffi::AnyBuffer /*order*/, ffi::Result<ffi::AnyBuffer> out) {
  return uccl_ep::ffi_common::guarded(Link::lifetime(), [&] {
    auto& dev = Link::device(ordinal);
    const auto group = group_of<Link>(dev, attrs.group_table, attrs.group_size, "combine");
    const auto& g = group.get();
    const auto a = uccl_ep::ffi_common::combine_args(attrs, y, is_token_in_rank, recv_counts, out);
    uccl_ep::nvl::combine(dev, g, a, stream);
  });
}

// Low-latency halves. The fused calls run both halves back to back on XLA's stream.
template <class Link, class Args, class Attrs, class Body>
ffi::Error low_latency_op(int32_t ordinal, const Attrs& attrs, const char* op, Body&& body) {
  return uccl_ep::ffi_common::guarded(Link::lifetime(), [&] {
    auto& dev = Link::device(ordinal);
    const auto group = group_of<Link>(dev, attrs.group_table, attrs.group_size, op);
    const auto& g = group.get();
    Args a{};
    a.num_experts = int(attrs.num_experts);
    a.max_tokens_per_rank = int(attrs.max_tokens_per_rank);
    body(dev, g, a);
  });
}

using LLDispatch = uccl_ep::nvl::LowLatencyDispatchArgs;
using LLCombine = uccl_ep::nvl::LowLatencyCombineArgs;

template <class Link>
ffi::Error LowLatencyDispatchImpl(cudaStream_t stream, int32_t ordinal, const LowLatencyDispatchAttrs& attrs,
                                  ffi::AnyBuffer x, ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> topk_idx,
                                  ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/,
                                  ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_scales,
                                  ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                                  ffi::Result<ffi::Buffer<ffi::S32>> layout,
                                  ffi::Result<ffi::Buffer<ffi::S32>> src_slot,
                                  ffi::Result<ffi::Buffer<ffi::F32>> recv_weights) {
  return low_latency_op<Link, LLDispatch>(
      ordinal, attrs, "low_latency_dispatch", [&](auto& dev, const uccl_ep::nvl::Group& g, LLDispatch& a) {
        uccl_ep::ffi_common::set_low_latency_dispatch_inputs(a, attrs, x, scales, topk_idx, topk_weights);
        uccl_ep::ffi_common::set_low_latency_dispatch_outputs(a, recv_x, recv_scales, recv_count, layout, src_slot,
                                                              recv_weights);
        uccl_ep::nvl::low_latency_dispatch(dev, g, a, stream);
      });
}

template <class Link>
ffi::Error LowLatencyDispatchSendImpl(cudaStream_t stream, int32_t ordinal, const LowLatencyDispatchAttrs& attrs,
                                      ffi::AnyBuffer x, ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> topk_idx,
                                      ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/,
                                      ffi::Result<ffi::Buffer<ffi::S32>> /*token*/) {
  return low_latency_op<Link, LLDispatch>(
      ordinal, attrs, "low_latency_dispatch", [&](auto& dev, const uccl_ep::nvl::Group& g, LLDispatch& a) {
        uccl_ep::ffi_common::set_low_latency_dispatch_inputs(a, attrs, x, scales, topk_idx, topk_weights);
        uccl_ep::nvl::low_latency_dispatch_send(dev, g, a, stream);
      });
}

template <class Link>
ffi::Error LowLatencyDispatchRecvImpl(cudaStream_t stream, int32_t ordinal, const LowLatencyTopkAttrs& attrs,
                                      ffi::AnyBuffer /*token*/, ffi::AnyBuffer /*order*/,
                                      ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_scales,
                                      ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                                      ffi::Result<ffi::Buffer<ffi::S32>> layout,
                                      ffi::Result<ffi::Buffer<ffi::S32>> src_slot,
                                      ffi::Result<ffi::Buffer<ffi::F32>> recv_weights) {
  return low_latency_op<Link, LLDispatch>(ordinal, attrs, "low_latency_dispatch",
                                          [&](auto& dev, const uccl_ep::nvl::Group& g, LLDispatch& a) {
                                            uccl_ep::ffi_common::set_low_latency_dispatch_outputs(
                                                a, recv_x, recv_scales, recv_count, layout, src_slot, recv_weights);
                                            a.topk = int(attrs.topk);
                                            uccl_ep::nvl::low_latency_dispatch_recv(dev, g, a, stream);
                                          });
}

template <class Link>
ffi::Error LowLatencyCombineImpl(cudaStream_t stream, int32_t ordinal, const LowLatencyAttrs& attrs, ffi::AnyBuffer y,
                                 ffi::Buffer<ffi::S32> layout, ffi::Buffer<ffi::S32> src_slot,
                                 ffi::Buffer<ffi::F32> row_weights, ffi::Buffer<ffi::S32> topk_idx,
                                 ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/,
                                 ffi::Result<ffi::AnyBuffer> out) {
  return low_latency_op<Link, LLCombine>(
      ordinal, attrs, "low_latency_combine", [&](auto& dev, const uccl_ep::nvl::Group& g, LLCombine& a) {
        uccl_ep::ffi_common::set_low_latency_combine_send(a, y, layout, src_slot, row_weights, attrs.op_index);
        uccl_ep::ffi_common::set_low_latency_combine_receive(a, topk_idx, topk_weights, out);
        uccl_ep::nvl::low_latency_combine(dev, g, a, stream);
      });
}

template <class Link>
ffi::Error LowLatencyCombineSendImpl(cudaStream_t stream, int32_t ordinal, const LowLatencyTopkAttrs& attrs,
                                     ffi::AnyBuffer y, ffi::Buffer<ffi::S32> layout, ffi::Buffer<ffi::S32> src_slot,
                                     ffi::Buffer<ffi::F32> row_weights, ffi::AnyBuffer /*order*/,
                                     ffi::Result<ffi::Buffer<ffi::S32>> /*token*/) {
  return low_latency_op<Link, LLCombine>(
      ordinal, attrs, "low_latency_combine", [&](auto& dev, const uccl_ep::nvl::Group& g, LLCombine& a) {
        uccl_ep::ffi_common::set_low_latency_combine_send(a, y, layout, src_slot, row_weights, attrs.op_index);
        a.topk = int(attrs.topk);
        uccl_ep::nvl::low_latency_combine_send(dev, g, a, stream);
      });
}

template <class Link>
ffi::Error LowLatencyCombineRecvImpl(cudaStream_t stream, int32_t ordinal, const LowLatencyAttrs& attrs,
                                     ffi::AnyBuffer /*token*/, ffi::Buffer<ffi::S32> topk_idx,
                                     ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/,
                                     ffi::Result<ffi::AnyBuffer> out) {
  return low_latency_op<Link, LLCombine>(
      ordinal, attrs, "low_latency_combine", [&](auto& dev, const uccl_ep::nvl::Group& g, LLCombine& a) {
        uccl_ep::ffi_common::set_low_latency_combine_receive(a, topk_idx, topk_weights, out);
        uccl_ep::nvl::low_latency_combine_recv(dev, g, a, stream);
      });
}

// Each op's implementation on a GPU path, by the op's tag.
#define UCCL_EP_ON_LINK(stem, name, signature)                        \
  template <class Link, class... Args>                                \
  ffi::Error on_link(uccl_ep::ffi_common::stem##Op, Args&&... args) { \
    return stem##Impl<Link>(std::forward<Args>(args)...);             \
  }
UCCL_EP_FFI_OPS(UCCL_EP_ON_LINK)
#undef UCCL_EP_ON_LINK

// One op's CUDA handler: the path the lowering chose (jax_uccl_ep/_plan.py) picks where the op runs, here only.
template <class Op>
struct OnPath {
  template <class Attrs, class... Args>
  ffi::Error operator()(cudaStream_t stream, int32_t ordinal, const Attrs& attrs, Args... args) const {
    // The CPU implementation, which takes these arguments, on host copies (cpu_handlers.hpp).
    using Staged = uccl_ep::ffi_cpu::StagedOp<Op, ffi::Error(int32_t, const Attrs&, Args...)>;
    switch (attrs.path) {
      case uccl_ep::Path::kNvlink:
        return on_link<OverNvlink>(Op{}, stream, ordinal, attrs, args...);
      case uccl_ep::Path::kNodeNvlink:
        return on_link<OverNodeNvlink>(Op{}, stream, ordinal, attrs, args...);
      case uccl_ep::Path::kProxyGpu:
        return on_link<OverProxy>(Op{}, stream, ordinal, attrs, args...);
      case uccl_ep::Path::kStaged:
        return Staged::call(stream, ordinal, attrs, args...);
      default:
        break;
    }
    const std::string path = std::to_string(int64_t(attrs.path));
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string("uccl_ep ") + Op::kName + ": no GPU path " + path +
                                                            " (lowered by another version of jax_uccl_ep?)");
  }
};

// dispatch(layout="expert") where the receive writes the pair buffer (jax_uccl_ep/_plan.py: gpu_writes_pairs): over
// NVLink where the dispatch pulls, and over the proxy, GPU-initiated.
template <class Link>
ffi::Error DispatchPairsOver(
    cudaStream_t stream, int32_t ordinal, const uccl_ep::ffi_common::DispatchPairsAttrs& attrs, ffi::AnyBuffer x,
    ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/,
    ffi::Result<ffi::AnyBuffer> pair_x, ffi::Result<ffi::AnyBuffer> pair_scales,
    ffi::Result<ffi::Buffer<ffi::F32>> pair_weights, ffi::Result<ffi::Buffer<ffi::S32>> expert_offsets,
    ffi::Result<ffi::Buffer<ffi::S32>> pairs_per_expert, ffi::Result<ffi::Buffer<ffi::S32>> pair_row,
    ffi::Result<ffi::Buffer<ffi::S32>> pair_of, ffi::Result<ffi::Buffer<ffi::S32>> stats,
    ffi::Result<ffi::Buffer<ffi::PRED>> is_token_in_rank, ffi::Result<ffi::Buffer<ffi::S32>> recv_counts) {
  return uccl_ep::ffi_common::guarded(Link::lifetime(), [&] {
    auto& dev = Link::device(ordinal);
    const auto group = group_of<Link>(dev, attrs.group_table, attrs.group_size, "dispatch");
    const auto a =
        uccl_ep::ffi_common::dispatch_inputs(attrs, x, scales, topk_idx, topk_weights, is_token_in_rank, recv_counts);
    const auto p = uccl_ep::ffi_common::pair_buffer(attrs, pair_x, pair_scales, pair_weights, expert_offsets,
                                                    pairs_per_expert, pair_row, pair_of, stats);
    uccl_ep::nvl::dispatch_pairs(dev, group.get(), a, p, stream);
  });
}

// A pair op's CUDA handler: its receive writes the pair buffer on the host paths (the host-staged one here) and,
// for dispatch, over NVLink where the dispatch pulls and over the GPU-initiated proxy; elsewhere the lowering never
// places it (jax_uccl_ep/_plan.py).
template <class Op>
struct OnHostPath {
  template <class Attrs, class... Args>
  ffi::Error operator()(cudaStream_t stream, int32_t ordinal, const Attrs& attrs, Args... args) const {
    using Staged = uccl_ep::ffi_cpu::StagedOp<Op, ffi::Error(int32_t, const Attrs&, Args...)>;
    if (attrs.path == uccl_ep::Path::kStaged) return Staged::call(stream, ordinal, attrs, args...);
    if constexpr (std::is_same_v<Op, uccl_ep::ffi_common::DispatchPairsOp>) {
      if (attrs.path == uccl_ep::Path::kNvlink) return DispatchPairsOver<OverNvlink>(stream, ordinal, attrs, args...);
      if (attrs.path == uccl_ep::Path::kProxyGpu) return DispatchPairsOver<OverProxy>(stream, ordinal, attrs, args...);
    }
    const std::string path = std::to_string(int64_t(attrs.path));
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string("uccl_ep ") + Op::kName +
                          ": the pair buffer is written on the host paths, over NVLink and over the GPU-initiated "
                          "proxy (dispatch), not on GPU path " +
                          path + " (lowered by another version of jax_uccl_ep?)");
  }
};

}  // namespace

// get_dispatch_layout: no communication; a bad index goes to the error word of whichever runtime holds the GPU,
// for check_errors() (the NVLink runtime's under two-level routing).
ffi::Error LayoutImpl(cudaStream_t stream, int32_t ordinal, const LayoutAttrs& attrs, ffi::Buffer<ffi::S32> topk_idx,
                      ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_rank,
                      ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_expert,
                      ffi::Result<ffi::Buffer<ffi::PRED>> is_token_in_rank) {
  const bool nvlink = NvlRuntime::get().initialized();
  return uccl_ep::ffi_common::guarded(nvlink ? OverNvlink::lifetime() : OverProxy::lifetime(), [&] {
    const auto a =
        uccl_ep::ffi_common::layout_args(attrs, topk_idx, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank);
    if (nvlink) {
      NvlDevice& dev = OverNvlink::device(ordinal);
      uccl_ep::nvl::get_dispatch_layout(a, dev.errors_device(), dev.rank(),
                                        stream);  // NVLink ranks, as its kernels record
    } else {
      uccl_ep::Device& dev = OverProxy::device(ordinal);
      uccl_ep::nvl::get_dispatch_layout(a, uccl_ep::nvl::proxy_error_word(dev.ordinal()), int(dev.rank()), stream);
    }
  });
}

// The expert layout's capacity check: the two agreed numbers come to the host (a wait for the stream, taken only
// under overflow="error" with a capacity below the never-dropping one).
ffi::Error PairCapacityImpl(cudaStream_t stream, int32_t /*ordinal*/,
                            const uccl_ep::ffi_common::PairCapacityAttrs& attrs, ffi::Buffer<ffi::S32> needed,
                            ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::Buffer<ffi::S32>> zero) {
  static std::shared_mutex no_runtime;  // the check reads no runtime state
  return uccl_ep::ffi_common::guarded(no_runtime, [&] {
    int32_t host[2] = {0, 0};
    auto check = [](cudaError_t e, const char* what) {
      if (e != cudaSuccess)
        throw std::runtime_error(std::string("uccl_ep pair capacity check: ") + what + ": " + cudaGetErrorString(e));
    };
    check(cudaMemcpyAsync(&host[0], needed.typed_data(), 4, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
    check(cudaMemcpyAsync(&host[1], rank.typed_data(), 4, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
    check(cudaMemsetAsync(zero->typed_data(), 0, 4, stream), "cudaMemsetAsync");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    uccl_ep::ffi_common::check_pair_capacity(host[0], host[1], attrs.capacity);
  });
}

// Test mode (handler_test_modes().poison), as the CPU handlers have it: an output the op writes only in part is
// filled with 0xFF bytes first, so a reader of a row it leaves (past the groups) finds NaN there.
template <class... Buffers>
void poison(cudaStream_t stream, Buffers&... buffers) {
  if (!uccl_ep::handler_test_modes().poison) return;
  for (const auto& [data, bytes] : {std::pair{buffers->untyped_data(), buffers->size_bytes()}...}) {
    const cudaError_t e = cudaMemsetAsync(data, 0xFF, bytes, stream);
    if (e != cudaSuccess) throw std::runtime_error(std::string("uccl_ep poison: ") + cudaGetErrorString(e));
  }
}

ffi::Error ExpandPairsImpl(cudaStream_t stream, int32_t /*ordinal*/, const uccl_ep::ffi_common::ExpandPairsAttrs& attrs,
                           ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> pair_row, ffi::Result<ffi::AnyBuffer> pairs) {
  static std::shared_mutex no_runtime;  // a local copy: no runtime state
  return uccl_ep::ffi_common::guarded(no_runtime, [&] {
    if (!attrs.zero_padding) poison(stream, pairs);  // the slots outside the groups are left as they are
    uccl_ep::nvl::expand_pairs(uccl_ep::ffi_common::expand_pairs_args(attrs, rows, pair_row, pairs), stream);
  });
}

ffi::Error SumPairsImpl(cudaStream_t stream, int32_t /*ordinal*/, ffi::AnyBuffer pairs, ffi::Buffer<ffi::S32> pair_of,
                        ffi::Result<ffi::AnyBuffer> rows) {
  static std::shared_mutex no_runtime;  // local sums: no runtime state
  return uccl_ep::ffi_common::guarded(
      no_runtime, [&] { uccl_ep::nvl::sum_pairs(uccl_ep::ffi_common::sum_pairs_args(pairs, pair_of, *rows), stream); });
}

ffi::Error SwigluImpl(cudaStream_t stream, int32_t /*ordinal*/, ffi::AnyBuffer gate_up, ffi::Buffer<ffi::F32> weight,
                      ffi::Buffer<ffi::S32> num_rows, ffi::Result<ffi::AnyBuffer> h) {
  static std::shared_mutex no_runtime;  // local: no runtime state
  return uccl_ep::ffi_common::guarded(no_runtime, [&] {
    poison(stream, h);
    uccl_ep::nvl::swiglu(uccl_ep::ffi_common::swiglu_args(gate_up, weight, nullptr, num_rows, *h, nullptr), stream);
  });
}
ffi::Error SwigluGradImpl(cudaStream_t stream, int32_t /*ordinal*/, ffi::AnyBuffer gate_up,
                          ffi::Buffer<ffi::F32> weight, ffi::AnyBuffer dh, ffi::Buffer<ffi::S32> num_rows,
                          ffi::Result<ffi::AnyBuffer> d_gate_up, ffi::Result<ffi::Buffer<ffi::F32>> d_weight) {
  static std::shared_mutex no_runtime;  // local: no runtime state
  return uccl_ep::ffi_common::guarded(no_runtime, [&] {
    poison(stream, d_gate_up, d_weight);
    uccl_ep::nvl::swiglu(uccl_ep::ffi_common::swiglu_args(gate_up, weight, &dh, num_rows, *d_gate_up, &*d_weight),
                         stream);
  });
}

// CUDA handlers take XLA's stream, then the same arguments as the CPU ones.
#define UCCL_EP_CUDA_BIND() ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()

#define UCCL_EP_CUDA_HANDLER(stem, name, signature)                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEp##stem##Cuda, OnPath<uccl_ep::ffi_common::stem##Op>{}, \
                                uccl_ep::ffi_common::signature(UCCL_EP_CUDA_BIND()));
UCCL_EP_FFI_OPS(UCCL_EP_CUDA_HANDLER)
#undef UCCL_EP_CUDA_HANDLER
#define UCCL_EP_CUDA_PAIR_HANDLER(stem, name, signature)                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEp##stem##Cuda, OnHostPath<uccl_ep::ffi_common::stem##Op>{}, \
                                uccl_ep::ffi_common::signature(UCCL_EP_CUDA_BIND()));
UCCL_EP_FFI_PAIR_OPS(UCCL_EP_CUDA_PAIR_HANDLER)
#undef UCCL_EP_CUDA_PAIR_HANDLER

XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpLayoutCuda, LayoutImpl, uccl_ep::ffi_common::layout_signature(UCCL_EP_CUDA_BIND()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpPairCapacityCuda, PairCapacityImpl,
                              uccl_ep::ffi_common::pair_capacity_signature(UCCL_EP_CUDA_BIND()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpExpandPairsCuda, ExpandPairsImpl,
                              uccl_ep::ffi_common::expand_pairs_signature(UCCL_EP_CUDA_BIND()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpSumPairsCuda, SumPairsImpl,
                              uccl_ep::ffi_common::sum_pairs_signature(UCCL_EP_CUDA_BIND()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpSwigluCuda, SwigluImpl, uccl_ep::ffi_common::swiglu_signature(UCCL_EP_CUDA_BIND()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpSwigluGradCuda, SwigluGradImpl,
                              uccl_ep::ffi_common::swiglu_grad_signature(UCCL_EP_CUDA_BIND()));
