// XLA FFI handlers for platform "CUDA": decode, find the GPU's state by device ordinal, call kernels/nvl on XLA's
// stream. Built only with CUDA. The exported symbols route each call: GPUs of one node to the NVLink handlers here;
// GPUs on several nodes (the proxy runtime) to the GPU-initiated handlers here, or to the host-staged ones in
// cpu_handlers.cpp (where GPU-initiated ops are off, or the job has more ranks than they take).
#include "cuda_handlers.hpp"

#include <cuda_runtime.h>

#include <array>
#include <exception>
#include <shared_mutex>
#include <stdexcept>
#include <string>

#include "../kernels/nvl/api.hpp"
#include "../proxy/runtime.hpp"
#include "common.hpp"

namespace ffi = xla::ffi;
using uccl_ep::nvl::NvlDevice;
using uccl_ep::nvl::NvlRuntime;
using uccl_ep::ffi_common::row_bytes;
using uccl_ep::ffi_common::row_bytes_3d;

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
        throw std::invalid_argument("uccl_ep: rank " + std::to_string(group_.ranks[s]) + " of a node-level group is "
                                    "not on the node of rank " + std::to_string(dev.global_rank()));
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
ffi::Error DispatchImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer scales,
                        ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/,
                        ffi::Span<const int32_t> group_table, int64_t group_size, int64_t /*op_index*/,
                        int64_t num_experts, int64_t /*two_level: the targets name the level*/,
                        ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_scales,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_topk_idx,
                        ffi::Result<ffi::Buffer<ffi::F32>> recv_topk_weights,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_num_tokens,
                        ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_expert,
                        ffi::Result<ffi::Buffer<ffi::PRED>> is_token_in_rank,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_counts) {
  return uccl_ep::ffi_common::guarded(Link::lifetime(), [&] {
    auto& dev = Link::device(ordinal);
    const auto group = group_of<Link>(dev, group_table, group_size, "dispatch");
    const auto& g = group.get();
    const bool has_w = topk_weights.element_count() != 0;
    uccl_ep::nvl::DispatchArgs a{};
    a.x = x.untyped_data();
    a.x_row_bytes = row_bytes(x);
    a.scales = scales.untyped_data();
    a.scale_row_bytes = row_bytes(scales);
    a.topk_idx = topk_idx.typed_data();
    a.topk_weights = has_w ? topk_weights.typed_data() : nullptr;
    a.num_tokens = int(topk_idx.dimensions()[0]);
    a.topk = int(topk_idx.dimensions()[1]);
    a.num_experts = int(num_experts);
    a.capacity = int(recv_x->dimensions()[0]);
    a.recv_x = recv_x->untyped_data();
    a.recv_scales = recv_scales->untyped_data();
    a.recv_topk_idx = recv_topk_idx->typed_data();
    a.recv_topk_weights = has_w ? recv_topk_weights->typed_data() : nullptr;
    a.recv_num_tokens = recv_num_tokens->typed_data();
    a.num_tokens_per_expert = num_tokens_per_expert->typed_data();
    a.is_token_in_rank = is_token_in_rank->typed_data();
    a.recv_counts = recv_counts->typed_data();
    uccl_ep::nvl::dispatch(dev, g, a, stream);
  });
}

template <class Link>
ffi::Error CachedDispatchImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::PRED> is_token_in_rank, ffi::Buffer<ffi::S32> recv_counts,
                              ffi::AnyBuffer /*order*/, ffi::Span<const int32_t> group_table, int64_t group_size,
                              int64_t /*op_index*/, int64_t /*two_level*/, ffi::Result<ffi::AnyBuffer> recv_x) {
  return uccl_ep::ffi_common::guarded(Link::lifetime(), [&] {
    auto& dev = Link::device(ordinal);
    const auto group = group_of<Link>(dev, group_table, group_size, "cached_dispatch");
    const auto& g = group.get();
    uccl_ep::nvl::CachedDispatchArgs a{x.untyped_data(),
                                       row_bytes(x),
                                       int(x.dimensions()[0]),
                                       int(recv_x->dimensions()[0]),
                                       is_token_in_rank.typed_data(),
                                       recv_counts.typed_data(),
                                       recv_x->untyped_data()};
    uccl_ep::nvl::cached_dispatch(dev, g, a, stream);
  });
}

template <class Link>
ffi::Error CombineImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y, ffi::Buffer<ffi::PRED> is_token_in_rank,
                       ffi::Buffer<ffi::S32> recv_counts, ffi::AnyBuffer /*order*/,
                       ffi::Span<const int32_t> group_table, int64_t group_size, int64_t /*op_index*/,
                       int64_t /*two_level*/, ffi::Result<ffi::AnyBuffer> out) {
  return uccl_ep::ffi_common::guarded(Link::lifetime(), [&] {
    auto& dev = Link::device(ordinal);
    const auto group = group_of<Link>(dev, group_table, group_size, "combine");
    const auto& g = group.get();
    bool bf16;
    if (y.element_type() == ffi::DataType::BF16)
      bf16 = true;
    else if (y.element_type() == ffi::DataType::F32)
      bf16 = false;
    else
      throw std::invalid_argument("uccl_ep combine: y must be float32 or bfloat16");
    uccl_ep::nvl::CombineArgs a{y.untyped_data(),
                                bf16,
                                int(y.dimensions()[1]),
                                int(y.dimensions()[0]),
                                int(is_token_in_rank.dimensions()[0]),
                                is_token_in_rank.typed_data(),
                                recv_counts.typed_data(),
                                out->untyped_data()};
    uccl_ep::nvl::combine(dev, g, a, stream);
  });
}

// Low-latency halves. The fused calls run both halves back to back on XLA's stream.
bool is_bf16(const ffi::AnyBuffer& b, const char* op) {
  if (b.element_type() == ffi::DataType::BF16) return true;
  if (b.element_type() == ffi::DataType::F32) return false;
  throw std::invalid_argument(std::string("uccl_ep ") + op + ": rows must be float32 or bfloat16");
}

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

void set_dispatch_inputs(uccl_ep::nvl::LowLatencyDispatchArgs& a, const ffi::AnyBuffer& x,
                         const ffi::AnyBuffer& scales, const ffi::Buffer<ffi::S32>& topk_idx, int64_t fp8_cast) {
  const auto rows = uccl_ep::ffi_common::dispatch_rows(x, scales, fp8_cast);
  a.x = x.untyped_data();
  a.x_row_bytes = rows.row_bytes;
  a.scales = rows.cast == uccl_ep::Fp8Cast::kNone ? scales.untyped_data() : nullptr;
  a.scale_row_bytes = rows.scale_row_bytes;
  a.cast = rows.cast;
  a.x_bf16 = rows.x_bf16;
  a.topk_idx = topk_idx.typed_data();
  a.num_tokens = int(topk_idx.dimensions()[0]);
  a.topk = int(topk_idx.dimensions()[1]);
}

void set_dispatch_outputs(uccl_ep::nvl::LowLatencyDispatchArgs& a, ffi::Result<ffi::AnyBuffer>& recv_x,
                          ffi::Result<ffi::AnyBuffer>& recv_scales, ffi::Result<ffi::Buffer<ffi::S32>>& recv_count,
                          ffi::Result<ffi::Buffer<ffi::S32>>& layout, ffi::Result<ffi::Buffer<ffi::S32>>& src_slot) {
  a.x_row_bytes = row_bytes_3d(*recv_x);
  a.scale_row_bytes = row_bytes_3d(*recv_scales);
  a.recv_x = recv_x->untyped_data();
  a.recv_scales = recv_scales->untyped_data();
  a.recv_count = recv_count->typed_data();
  a.layout = layout->typed_data();
  a.src_slot = src_slot->typed_data();
}

void set_combine_send(uccl_ep::nvl::LowLatencyCombineArgs& a, const ffi::AnyBuffer& y,
                      const ffi::Buffer<ffi::S32>& layout, const ffi::Buffer<ffi::S32>& src_slot) {
  a.y = y.untyped_data();
  a.bf16 = is_bf16(y, "low_latency_combine");
  a.hidden = int(y.dimensions()[2]);
  a.layout = layout.typed_data();
  a.src_slot = src_slot.typed_data();
}

void set_combine_recv(uccl_ep::nvl::LowLatencyCombineArgs& a, const ffi::Buffer<ffi::S32>& topk_idx,
                      const ffi::Buffer<ffi::F32>& topk_weights, ffi::Result<ffi::AnyBuffer>& out) {
  a.bf16 = is_bf16(*out, "low_latency_combine");
  a.hidden = int(out->dimensions()[1]);
  a.topk_idx = topk_idx.typed_data();
  a.topk_weights = topk_weights.typed_data();
  a.num_tokens = int(topk_idx.dimensions()[0]);
  a.topk = int(topk_idx.dimensions()[1]);
  a.out = out->untyped_data();
}

using LLDispatch = uccl_ep::nvl::LowLatencyDispatchArgs;
using LLCombine = uccl_ep::nvl::LowLatencyCombineArgs;

template <class Link>
ffi::Error LowLatencyDispatchImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer scales,
                                  ffi::Buffer<ffi::S32> topk_idx, ffi::AnyBuffer /*order*/,
                                  ffi::Span<const int32_t> group_table, int64_t group_size, int64_t /*op_index*/,
                                  int64_t num_experts, int64_t max_tokens_per_rank, int64_t fp8_cast,
                                  ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_scales,
                                  ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                                  ffi::Result<ffi::Buffer<ffi::S32>> layout,
                                  ffi::Result<ffi::Buffer<ffi::S32>> src_slot) {
  return low_latency_op<Link, LLDispatch>(ordinal, group_table, group_size, "low_latency_dispatch", num_experts,
                                    max_tokens_per_rank, [&](auto& dev, const uccl_ep::nvl::Group& g, LLDispatch& a) {
    set_dispatch_inputs(a, x, scales, topk_idx, fp8_cast);
    set_dispatch_outputs(a, recv_x, recv_scales, recv_count, layout, src_slot);
    uccl_ep::nvl::low_latency_dispatch(dev, g, a, stream);
  });
}

template <class Link>
ffi::Error LowLatencyDispatchSendImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer scales,
                                      ffi::Buffer<ffi::S32> topk_idx, ffi::AnyBuffer /*order*/,
                                      ffi::Span<const int32_t> group_table, int64_t group_size,
                                      int64_t /*op_index*/, int64_t num_experts, int64_t max_tokens_per_rank,
                                      int64_t fp8_cast, ffi::Result<ffi::Buffer<ffi::S32>> /*token*/) {
  return low_latency_op<Link, LLDispatch>(ordinal, group_table, group_size, "low_latency_dispatch", num_experts,
                                    max_tokens_per_rank, [&](auto& dev, const uccl_ep::nvl::Group& g, LLDispatch& a) {
    set_dispatch_inputs(a, x, scales, topk_idx, fp8_cast);
    uccl_ep::nvl::low_latency_dispatch_send(dev, g, a, stream);
  });
}

template <class Link>
ffi::Error LowLatencyDispatchRecvImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer /*token*/,
                                      ffi::AnyBuffer /*order*/, ffi::Span<const int32_t> group_table,
                                      int64_t group_size, int64_t /*op_index*/, int64_t num_experts,
                                      int64_t max_tokens_per_rank, int64_t topk, ffi::Result<ffi::AnyBuffer> recv_x,
                                      ffi::Result<ffi::AnyBuffer> recv_scales,
                                      ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                                      ffi::Result<ffi::Buffer<ffi::S32>> layout,
                                      ffi::Result<ffi::Buffer<ffi::S32>> src_slot) {
  return low_latency_op<Link, LLDispatch>(ordinal, group_table, group_size, "low_latency_dispatch", num_experts,
                                    max_tokens_per_rank, [&](auto& dev, const uccl_ep::nvl::Group& g, LLDispatch& a) {
    set_dispatch_outputs(a, recv_x, recv_scales, recv_count, layout, src_slot);
    a.topk = int(topk);
    uccl_ep::nvl::low_latency_dispatch_recv(dev, g, a, stream);
  });
}

template <class Link>
ffi::Error LowLatencyCombineImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> layout,
                                 ffi::Buffer<ffi::S32> src_slot, ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                                 ffi::AnyBuffer /*order*/, ffi::Span<const int32_t> group_table, int64_t group_size,
                                 int64_t /*op_index*/, int64_t num_experts, int64_t max_tokens_per_rank,
                                 ffi::Result<ffi::AnyBuffer> out) {
  return low_latency_op<Link, LLCombine>(ordinal, group_table, group_size, "low_latency_combine", num_experts,
                                   max_tokens_per_rank, [&](auto& dev, const uccl_ep::nvl::Group& g, LLCombine& a) {
    set_combine_send(a, y, layout, src_slot);
    set_combine_recv(a, topk_idx, topk_weights, out);
    uccl_ep::nvl::low_latency_combine(dev, g, a, stream);
  });
}

template <class Link>
ffi::Error LowLatencyCombineSendImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y,
                                     ffi::Buffer<ffi::S32> layout, ffi::Buffer<ffi::S32> src_slot,
                                     ffi::AnyBuffer /*order*/,
                                     ffi::Span<const int32_t> group_table, int64_t group_size,
                                     int64_t /*op_index*/, int64_t num_experts, int64_t max_tokens_per_rank,
                                     int64_t topk, ffi::Result<ffi::Buffer<ffi::S32>> /*token*/) {
  return low_latency_op<Link, LLCombine>(ordinal, group_table, group_size, "low_latency_combine", num_experts,
                                   max_tokens_per_rank, [&](auto& dev, const uccl_ep::nvl::Group& g, LLCombine& a) {
    set_combine_send(a, y, layout, src_slot);
    a.topk = int(topk);
    uccl_ep::nvl::low_latency_combine_send(dev, g, a, stream);
  });
}

template <class Link>
ffi::Error LowLatencyCombineRecvImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer /*token*/,
                                     ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                                     ffi::AnyBuffer /*order*/, ffi::Span<const int32_t> group_table,
                                     int64_t group_size, int64_t /*op_index*/, int64_t num_experts,
                                     int64_t max_tokens_per_rank, ffi::Result<ffi::AnyBuffer> out) {
  return low_latency_op<Link, LLCombine>(ordinal, group_table, group_size, "low_latency_combine", num_experts,
                                   max_tokens_per_rank, [&](auto& dev, const uccl_ep::nvl::Group& g, LLCombine& a) {
    set_combine_recv(a, topk_idx, topk_weights, out);
    uccl_ep::nvl::low_latency_combine_recv(dev, g, a, stream);
  });
}

}  // namespace

// CUDA handlers take XLA's stream, then the same arguments as the CPU ones.
#define UCCL_EP_CUDA_BIND() ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()

#define UCCL_EP_LINK_HANDLERS(stem, name, signature)                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEp##stem##Nvl, stem##Impl<OverNvlink>,                   \
                                uccl_ep::ffi_common::signature(UCCL_EP_CUDA_BIND()));          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEp##stem##Proxy, stem##Impl<OverProxy>,                  \
                                uccl_ep::ffi_common::signature(UCCL_EP_CUDA_BIND()));
UCCL_EP_FFI_NORMAL_OPS(UCCL_EP_LINK_HANDLERS)
UCCL_EP_FFI_LOW_LATENCY_OPS(UCCL_EP_LINK_HANDLERS)
// Two-level routing names its levels' targets itself: the node level (NVLink within a node) and the level across
// nodes (GPU-initiated through the proxies), whatever the size of the whole job.
#define UCCL_EP_LEVEL_HANDLERS(stem, name, signature)                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEp##stem##Node, stem##Impl<OverNodeNvlink>,              \
                                uccl_ep::ffi_common::signature(UCCL_EP_CUDA_BIND()));
UCCL_EP_FFI_NORMAL_OPS(UCCL_EP_LEVEL_HANDLERS)

// The NVLink runtime alone serves GPUs of one node; when the process started the proxy runtime (GPUs on several
// nodes, perhaps with a node-level NVLink runtime beside it), ops run GPU-initiated where they can
// (kernels/nvl/api.hpp) and the rest host-staged.
namespace {
bool on_proxy() { return uccl_ep::Runtime::get().initialized(); }
using Handler = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);
template <bool (*kGpuInitiated)(uint32_t)>
XLA_FFI_Error* route(XLA_FFI_CallFrame* frame, Handler nvl, Handler proxy, Handler staged) {
  if (!on_proxy()) return nvl(frame);
  return kGpuInitiated(uccl_ep::Runtime::get().num_ranks()) ? proxy(frame) : staged(frame);
}
}  // namespace

#define UCCL_EP_ROUTED(stem, name, signature)                                                               \
  extern "C" XLA_FFI_Error* UcclEp##stem##Cuda(XLA_FFI_CallFrame* frame) {                                  \
    return route<uccl_ep::nvl::gpu_initiated_normal>(frame, UcclEp##stem##Nvl, UcclEp##stem##Proxy,         \
                                                     UcclEp##stem##Staged);                                 \
  }
UCCL_EP_FFI_NORMAL_OPS(UCCL_EP_ROUTED)
#define UCCL_EP_ROUTED_LOW_LATENCY(stem, name, signature)                                                   \
  extern "C" XLA_FFI_Error* UcclEp##stem##Cuda(XLA_FFI_CallFrame* frame) {                                  \
    return route<uccl_ep::nvl::gpu_initiated_low_latency>(frame, UcclEp##stem##Nvl, UcclEp##stem##Proxy,    \
                                                          UcclEp##stem##Staged);                            \
  }
UCCL_EP_FFI_LOW_LATENCY_OPS(UCCL_EP_ROUTED_LOW_LATENCY)
