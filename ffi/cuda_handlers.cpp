// XLA FFI handlers for platform "CUDA": decode, find the GPU's state by device ordinal, call kernels/nvl on XLA's
// stream. Built only with CUDA. Each op's handler runs the path its `path` attribute names (jax_uccl_ep/_plan.py):
// the NVLink runtime (a node's GPUs), a node's NVLink runtime under two-level routing, the proxy runtime's
// GPU-initiated kernels, or the host-staged CPU implementation (cpu_handlers.cpp).
#include "cuda_handlers.hpp"

#include <cuda_runtime.h>

#include <array>
#include <exception>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <string_view>

#include "../kernels/nvl/api.hpp"
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

template <class Link>
ffi::Error DispatchImpl(
    cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> topk_idx,
    ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/, ffi::Span<const int32_t> group_table,
    int64_t group_size, int64_t op_index, int64_t num_experts, int64_t two_level, int64_t /*path*/, int64_t node_size,
    int64_t overflow, ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_scales,
    ffi::Result<ffi::Buffer<ffi::S32>> recv_topk_idx, ffi::Result<ffi::Buffer<ffi::F32>> recv_topk_weights,
    ffi::Result<ffi::Buffer<ffi::S32>> recv_num_tokens, ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_expert,
    ffi::Result<ffi::Buffer<ffi::PRED>> is_token_in_rank, ffi::Result<ffi::Buffer<ffi::S32>> recv_counts) {
  return uccl_ep::ffi_common::guarded(Link::lifetime(), [&] {
    auto& dev = Link::device(ordinal);
    const auto group = group_of<Link>(dev, group_table, group_size, "dispatch");
    const auto& g = group.get();
    const auto a = uccl_ep::ffi_common::dispatch_args(
        x, scales, topk_idx, topk_weights, op_index, num_experts, node_size, two_level, overflow, recv_x, recv_scales,
        recv_topk_idx, recv_topk_weights, recv_num_tokens, num_tokens_per_expert, is_token_in_rank, recv_counts);
    uccl_ep::nvl::dispatch(dev, g, a, stream);
  });
}

template <class Link>
ffi::Error CachedDispatchImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::PRED> is_token_in_rank, ffi::Buffer<ffi::S32> recv_counts,
                              ffi::AnyBuffer /*order*/, ffi::Span<const int32_t> group_table, int64_t group_size,
                              int64_t op_index, int64_t /*two_level*/, int64_t /*path*/, int64_t node_size,
                              int64_t overflow, ffi::Result<ffi::AnyBuffer> recv_x) {
  return uccl_ep::ffi_common::guarded(Link::lifetime(), [&] {
    auto& dev = Link::device(ordinal);
    const auto group = group_of<Link>(dev, group_table, group_size, "cached_dispatch");
    const auto& g = group.get();
    const auto a = uccl_ep::ffi_common::cached_dispatch_args(x, is_token_in_rank, recv_counts, op_index, node_size,
                                                             overflow, recv_x);
    uccl_ep::nvl::cached_dispatch(dev, g, a, stream);
  });
}

template <class Link>
ffi::Error CombineImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y, ffi::Buffer<ffi::PRED> is_token_in_rank,
                       ffi::Buffer<ffi::S32> recv_counts, ffi::AnyBuffer /*order*/,
                       ffi::Span<const int32_t> group_table, int64_t group_size, int64_t op_index,
                       int64_t /*two_level*/, int64_t /*path*/, int64_t node_size, int64_t overflow,
                       ffi::Result<ffi::AnyBuffer> out) {
  return uccl_ep::ffi_common::guarded(Link::lifetime(), [&] {
    auto& dev = Link::device(ordinal);
    const auto group = group_of<Link>(dev, group_table, group_size, "combine");
    const auto& g = group.get();
    const auto a =
        uccl_ep::ffi_common::combine_args(y, is_token_in_rank, recv_counts, op_index, node_size, overflow, out);
    uccl_ep::nvl::combine(dev, g, a, stream);
  });
}

// Low-latency halves. The fused calls run both halves back to back on XLA's stream.
template <class Link, class Args, class Body>
ffi::Error low_latency_op(int32_t ordinal, ffi::Span<const int32_t> group_table, int64_t group_size, const char* op,
                          int64_t num_experts, int64_t max_tokens_per_rank, Body&& body) {
  return uccl_ep::ffi_common::guarded(Link::lifetime(), [&] {
    auto& dev = Link::device(ordinal);
    const auto group = group_of<Link>(dev, group_table, group_size, op);
    const auto& g = group.get();
    Args a{};
    a.num_experts = int(num_experts);
    a.max_tokens_per_rank = int(max_tokens_per_rank);
    body(dev, g, a);
  });
}

using LLDispatch = uccl_ep::nvl::LowLatencyDispatchArgs;
using LLCombine = uccl_ep::nvl::LowLatencyCombineArgs;

template <class Link>
ffi::Error LowLatencyDispatchImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer scales,
                                  ffi::Buffer<ffi::S32> topk_idx, ffi::AnyBuffer /*order*/,
                                  ffi::Span<const int32_t> group_table, int64_t group_size, int64_t op_index,
                                  int64_t num_experts, int64_t max_tokens_per_rank, int64_t /*path*/, int64_t fp8_cast,
                                  ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_scales,
                                  ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                                  ffi::Result<ffi::Buffer<ffi::S32>> layout,
                                  ffi::Result<ffi::Buffer<ffi::S32>> src_slot) {
  return low_latency_op<Link, LLDispatch>(
      ordinal, group_table, group_size, "low_latency_dispatch", num_experts, max_tokens_per_rank,
      [&](auto& dev, const uccl_ep::nvl::Group& g, LLDispatch& a) {
        uccl_ep::ffi_common::set_low_latency_dispatch_inputs(a, x, scales, topk_idx, op_index, fp8_cast);
        uccl_ep::ffi_common::set_low_latency_dispatch_outputs(a, recv_x, recv_scales, recv_count, layout, src_slot);
        uccl_ep::nvl::low_latency_dispatch(dev, g, a, stream);
      });
}

template <class Link>
ffi::Error LowLatencyDispatchSendImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer scales,
                                      ffi::Buffer<ffi::S32> topk_idx, ffi::AnyBuffer /*order*/,
                                      ffi::Span<const int32_t> group_table, int64_t group_size, int64_t op_index,
                                      int64_t num_experts, int64_t max_tokens_per_rank, int64_t /*path*/,
                                      int64_t fp8_cast, ffi::Result<ffi::Buffer<ffi::S32>> /*token*/) {
  return low_latency_op<Link, LLDispatch>(
      ordinal, group_table, group_size, "low_latency_dispatch", num_experts, max_tokens_per_rank,
      [&](auto& dev, const uccl_ep::nvl::Group& g, LLDispatch& a) {
        uccl_ep::ffi_common::set_low_latency_dispatch_inputs(a, x, scales, topk_idx, op_index, fp8_cast);
        uccl_ep::nvl::low_latency_dispatch_send(dev, g, a, stream);
      });
}

template <class Link>
ffi::Error LowLatencyDispatchRecvImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer /*token*/,
                                      ffi::AnyBuffer /*order*/, ffi::Span<const int32_t> group_table,
                                      int64_t group_size, int64_t /*op_index*/, int64_t num_experts,
                                      int64_t max_tokens_per_rank, int64_t /*path*/, int64_t topk,
                                      ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_scales,
                                      ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                                      ffi::Result<ffi::Buffer<ffi::S32>> layout,
                                      ffi::Result<ffi::Buffer<ffi::S32>> src_slot) {
  return low_latency_op<Link, LLDispatch>(
      ordinal, group_table, group_size, "low_latency_dispatch", num_experts, max_tokens_per_rank,
      [&](auto& dev, const uccl_ep::nvl::Group& g, LLDispatch& a) {
        uccl_ep::ffi_common::set_low_latency_dispatch_outputs(a, recv_x, recv_scales, recv_count, layout, src_slot);
        a.topk = int(topk);
        uccl_ep::nvl::low_latency_dispatch_recv(dev, g, a, stream);
      });
}

template <class Link>
ffi::Error LowLatencyCombineImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> layout,
                                 ffi::Buffer<ffi::S32> src_slot, ffi::Buffer<ffi::S32> topk_idx,
                                 ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/,
                                 ffi::Span<const int32_t> group_table, int64_t group_size, int64_t op_index,
                                 int64_t num_experts, int64_t max_tokens_per_rank, int64_t /*path*/,
                                 ffi::Result<ffi::AnyBuffer> out) {
  return low_latency_op<Link, LLCombine>(
      ordinal, group_table, group_size, "low_latency_combine", num_experts, max_tokens_per_rank,
      [&](auto& dev, const uccl_ep::nvl::Group& g, LLCombine& a) {
        uccl_ep::ffi_common::set_low_latency_combine_send(a, y, layout, src_slot, op_index);
        uccl_ep::ffi_common::set_low_latency_combine_receive(a, topk_idx, topk_weights, out);
        uccl_ep::nvl::low_latency_combine(dev, g, a, stream);
      });
}

template <class Link>
ffi::Error LowLatencyCombineSendImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y,
                                     ffi::Buffer<ffi::S32> layout, ffi::Buffer<ffi::S32> src_slot,
                                     ffi::AnyBuffer /*order*/, ffi::Span<const int32_t> group_table, int64_t group_size,
                                     int64_t op_index, int64_t num_experts, int64_t max_tokens_per_rank,
                                     int64_t /*path*/, int64_t topk, ffi::Result<ffi::Buffer<ffi::S32>> /*token*/) {
  return low_latency_op<Link, LLCombine>(
      ordinal, group_table, group_size, "low_latency_combine", num_experts, max_tokens_per_rank,
      [&](auto& dev, const uccl_ep::nvl::Group& g, LLCombine& a) {
        uccl_ep::ffi_common::set_low_latency_combine_send(a, y, layout, src_slot, op_index);
        a.topk = int(topk);
        uccl_ep::nvl::low_latency_combine_send(dev, g, a, stream);
      });
}

template <class Link>
ffi::Error LowLatencyCombineRecvImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer /*token*/,
                                     ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                                     ffi::AnyBuffer /*order*/, ffi::Span<const int32_t> group_table, int64_t group_size,
                                     int64_t /*op_index*/, int64_t num_experts, int64_t max_tokens_per_rank,
                                     int64_t /*path*/, ffi::Result<ffi::AnyBuffer> out) {
  return low_latency_op<Link, LLCombine>(
      ordinal, group_table, group_size, "low_latency_combine", num_experts, max_tokens_per_rank,
      [&](auto& dev, const uccl_ep::nvl::Group& g, LLCombine& a) {
        uccl_ep::ffi_common::set_low_latency_combine_receive(a, topk_idx, topk_weights, out);
        uccl_ep::nvl::low_latency_combine_recv(dev, g, a, stream);
      });
}

}  // namespace

// get_dispatch_layout: no communication; a bad index goes to the error word of whichever runtime holds the GPU,
// for check_errors() (the NVLink runtime's under two-level routing).
ffi::Error LayoutImpl(cudaStream_t stream, int32_t ordinal, ffi::Buffer<ffi::S32> topk_idx, int64_t num_experts,
                      int64_t num_ranks, ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_rank,
                      ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_expert,
                      ffi::Result<ffi::Buffer<ffi::PRED>> is_token_in_rank) {
  const bool nvlink = NvlRuntime::get().initialized();
  return uccl_ep::ffi_common::guarded(nvlink ? OverNvlink::lifetime() : OverProxy::lifetime(), [&] {
    const auto a = uccl_ep::ffi_common::layout_args(topk_idx, num_experts, num_ranks, num_tokens_per_rank,
                                                    num_tokens_per_expert, is_token_in_rank);
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

// CUDA handlers take XLA's stream, then the same arguments as the CPU ones.
#define UCCL_EP_CUDA_BIND() ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()

namespace {
// The `path` attribute of a call, decoded as XLA decodes attributes; on failure, what the call carries instead.
std::optional<int64_t> path_attribute(XLA_FFI_CallFrame* frame, std::string* problem) {
  const ffi::Dictionary attrs(&frame->attrs);
  auto path = attrs.get<int64_t>("path");
  if (!path.has_error()) return *path;
  *problem = path.error().message() + " (attributes:";
  for (int64_t i = 0; i < frame->attrs.size; ++i) {
    const XLA_FFI_ByteSpan* n = frame->attrs.names[i];
    *problem += " " + std::string(n->ptr, n->len) + ":" + std::to_string(int(frame->attrs.types[i]));
    if (frame->attrs.types[i] == XLA_FFI_AttrType_SCALAR)
      *problem += "/" + std::to_string(int(static_cast<const XLA_FFI_Scalar*>(frame->attrs.attrs[i])->dtype));
  }
  *problem += ")";
  return std::nullopt;
}

XLA_FFI_Error* invalid_argument(const XLA_FFI_CallFrame* frame, const std::string& message) {
  XLA_FFI_Error_Create_Args args{};
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.message = message.c_str();
  args.errc = XLA_FFI_Error_Code_INVALID_ARGUMENT;
  return frame->api->XLA_FFI_Error_Create(&args);
}

// The handlers of one op, one per GPU path.
struct PathHandlers {
  XLA_FFI_Handler* nvlink;
  XLA_FFI_Handler* node_nvlink;
  XLA_FFI_Handler* proxy_gpu;
  XLA_FFI_Handler* staged;
};

XLA_FFI_Error* run_path(XLA_FFI_CallFrame* frame, const PathHandlers& h, const char* op) {
  // XLA asks a handler for its metadata (API version, traits) with a frame that carries no attributes, and calls
  // it at other stages than execution: every path's handler answers those alike.
  const bool metadata = frame->extension_start != nullptr && frame->extension_start->type == XLA_FFI_Extension_Metadata;
  if (metadata || frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return h.nvlink(frame);
  std::string problem;
  const std::optional<int64_t> path = path_attribute(frame, &problem);
  if (!path) return invalid_argument(frame, std::string("uccl_ep ") + op + ": no path attribute: " + problem);
  switch (uccl_ep::Path(*path)) {
    case uccl_ep::Path::kNvlink:
      return h.nvlink(frame);
    case uccl_ep::Path::kNodeNvlink:
      return h.node_nvlink(frame);
    case uccl_ep::Path::kProxyGpu:
      return h.proxy_gpu(frame);
    case uccl_ep::Path::kStaged:
      return h.staged(frame);
    default:
      return invalid_argument(frame, std::string("uccl_ep ") + op + ": no GPU path " + std::to_string(*path) +
                                         " (lowered by another version of jax_uccl_ep?)");
  }
}
}  // namespace

#define UCCL_EP_CUDA_HANDLER(stem, name, signature)                                                                   \
  namespace {                                                                                                         \
  XLA_FFI_DEFINE_HANDLER(k##stem##Nvlink, stem##Impl<OverNvlink>,                                                     \
                         uccl_ep::ffi_common::signature(UCCL_EP_CUDA_BIND()));                                        \
  XLA_FFI_DEFINE_HANDLER(k##stem##NodeNvlink, stem##Impl<OverNodeNvlink>,                                             \
                         uccl_ep::ffi_common::signature(UCCL_EP_CUDA_BIND()));                                        \
  XLA_FFI_DEFINE_HANDLER(k##stem##ProxyGpu, stem##Impl<OverProxy>,                                                    \
                         uccl_ep::ffi_common::signature(UCCL_EP_CUDA_BIND()));                                        \
  }                                                                                                                   \
  extern "C" XLA_FFI_Error* UcclEp##stem##Cuda(XLA_FFI_CallFrame* frame) {                                            \
    return run_path(frame, {k##stem##Nvlink, k##stem##NodeNvlink, k##stem##ProxyGpu, uccl_ep::ffi_cpu::Staged##stem}, \
                    name);                                                                                            \
  }
UCCL_EP_FFI_OPS(UCCL_EP_CUDA_HANDLER)
#undef UCCL_EP_CUDA_HANDLER

XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpLayoutCuda, LayoutImpl, uccl_ep::ffi_common::layout_signature(UCCL_EP_CUDA_BIND()));
