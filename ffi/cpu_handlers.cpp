// XLA FFI handlers for CPU devices: decode buffers and attributes, find the device's runtime state by ordinal,
// call the CPU implementation in kernels/cpu. Nothing else happens here.
#include "cpu_handlers.hpp"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <shared_mutex>
#include <string>

#ifdef UCCL_EP_WITH_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>
#include <deque>
#include <map>
#include <tuple>
#include <vector>
#endif

#include "../kernels/cpu/low_latency.hpp"
#include "../kernels/cpu/normal.hpp"
#include "common.hpp"

namespace ffi = xla::ffi;

namespace uccl_ep::ffi_cpu {
namespace {

namespace ffi_common = uccl_ep::ffi_common;
using ffi_common::row_bytes;
using ffi_common::row_bytes_3d;

template <class Body>
ffi::Error guarded(Body&& body) {
  return ffi_common::guarded(Runtime::get().lifetime_mutex(), std::forward<Body>(body));
}

// An op that is one level of a two-level dispatch or combine (jax_uccl_ep/normal.py; attribute two_level != 0): the
// other level's ranks wait on this one's rows, so a failure (bad input included, which fails only this level's
// group) aborts every rank of the job, and all fail at once with this rank's reason instead of at their deadline.
// The runtime then needs shutdown() and initialize(), as after any abort.
template <class Op>
void aborting_the_job_on_failure(Device& dev, int64_t two_level, Op&& op) {
  try {
    op();
  } catch (const std::exception& e) {
    // A rank that failed on a peer's abort does not pass it on: the author told everyone.
    if (two_level != 0 && !dev.aborted_by_peer()) {
      std::vector<uint32_t> everyone(dev.num_ranks());
      for (uint32_t r = 0; r < dev.num_ranks(); ++r) everyone[r] = r;
      std::lock_guard<std::mutex> lock(dev.op_mutex());
      dev.abort(everyone, e.what());
    }
    throw;
  }
}

// UCCL_EP_POISON=1 fills outputs with 0xFF bytes before an op, so a row the op forgets to write shows as NaN
// or -1 in tests instead of looking like valid data.
bool poison_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("UCCL_EP_POISON");
    return v && *v && std::strcmp(v, "0") != 0;
  }();
  return on;
}
template <class... Buffers>
void poison(Buffers&... buffers) {
  if (poison_enabled()) (std::memset(buffers->untyped_data(), 0xFF, buffers->size_bytes()), ...);
}

int64_t dim(const ffi::AnyBuffer& b, int i) { return b.dimensions()[i]; }
template <ffi::DataType T>
int64_t dim(const ffi::Buffer<T>& b, int i) { return b.dimensions()[i]; }

// The lowering passes every EP group of the mesh ([groups, size], runtime ranks); this device's is the row
// that holds its rank.
cpu::Group group_of(Device& dev, ffi::Span<const int32_t> table, int64_t size, const char* op) {
  auto [row, index] = ffi_common::find_group(table, size, dev.rank());
  if (!row)
    throw InvalidArgument(std::string("uccl_ep ") + op + ": rank " + std::to_string(dev.rank()) +
                          " is in no EP group of the mesh");
  return cpu::make_group(dev, row, int(size), op);
}

ffi::Error LayoutImpl(ffi::Buffer<ffi::S32> topk_idx, int64_t num_experts, int64_t num_ranks,
                      ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_rank,
                      ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_expert,
                      ffi::Result<ffi::Buffer<ffi::PRED>> is_token_in_rank) {
  return guarded([&] {
    cpu::get_dispatch_layout(topk_idx.typed_data(), int(dim(topk_idx, 0)), int(dim(topk_idx, 1)), int(num_experts),
                             int(num_ranks), num_tokens_per_rank->typed_data(), num_tokens_per_expert->typed_data(),
                             is_token_in_rank->typed_data());
  });
}

ffi::Error DispatchImpl(int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer scales, ffi::Buffer<ffi::S32> topk_idx,
                        ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/,
                        ffi::Span<const int32_t> group_table,
                        int64_t group_size, int64_t op_index, int64_t num_experts, int64_t two_level,
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
    cpu::Group g = group_of(dev, group_table, group_size, "dispatch");
    const bool has_weights = topk_weights.element_count() != 0;
    cpu::DispatchArgs a{};
    a.x = static_cast<const uint8_t*>(x.untyped_data());
    a.x_row_bytes = row_bytes(x);
    a.scales = static_cast<const uint8_t*>(scales.untyped_data());
    a.scale_row_bytes = row_bytes(scales);
    a.topk_idx = topk_idx.typed_data();
    a.topk_weights = has_weights ? topk_weights.typed_data() : nullptr;
    a.num_tokens = int(dim(topk_idx, 0));
    a.topk = int(dim(topk_idx, 1));
    a.num_experts = int(num_experts);
    a.capacity = int(dim(*recv_x, 0));
    a.recv_x = static_cast<uint8_t*>(recv_x->untyped_data());
    a.recv_scales = static_cast<uint8_t*>(recv_scales->untyped_data());
    a.recv_topk_idx = recv_topk_idx->typed_data();
    a.recv_topk_weights = has_weights ? recv_topk_weights->typed_data() : nullptr;
    a.recv_num_tokens = recv_num_tokens->typed_data();
    a.num_tokens_per_expert = num_tokens_per_expert->typed_data();
    a.is_token_in_rank = is_token_in_rank->typed_data();
    a.recv_counts = recv_counts->typed_data();
    a.op_index = uint32_t(op_index);
    aborting_the_job_on_failure(dev, two_level, [&] { cpu::dispatch(dev, g, a); });
  });
}

ffi::Error CachedDispatchImpl(int32_t ordinal, ffi::AnyBuffer x, ffi::Buffer<ffi::PRED> is_token_in_rank,
                              ffi::Buffer<ffi::S32> recv_counts, ffi::AnyBuffer /*order*/,
                              ffi::Span<const int32_t> group_table, int64_t group_size, int64_t op_index,
                              int64_t two_level, ffi::Result<ffi::AnyBuffer> recv_x) {
  return guarded([&] {
    poison(recv_x);
    Device& dev = Runtime::get().device_by_ordinal(ordinal);
    cpu::Group g = group_of(dev, group_table, group_size, "cached_dispatch");
    cpu::CachedDispatchArgs a{static_cast<const uint8_t*>(x.untyped_data()),
                              uint64_t(row_bytes(x)),
                              int(dim(x, 0)),
                              is_token_in_rank.typed_data(),
                              recv_counts.typed_data(),
                              int(dim(*recv_x, 0)),
                              static_cast<uint8_t*>(recv_x->untyped_data()),
                              uint32_t(op_index)};
    aborting_the_job_on_failure(dev, two_level, [&] { cpu::cached_dispatch(dev, g, a); });
  });
}

cpu::FloatType float_type(const ffi::AnyBuffer& b, const char* op) {
  if (b.element_type() == ffi::DataType::F32) return cpu::FloatType::kF32;
  if (b.element_type() == ffi::DataType::BF16) return cpu::FloatType::kBF16;
  throw InvalidArgument(std::string("uccl_ep ") + op + ": expected float32 or bfloat16 rows");
}

ffi::Error CombineImpl(int32_t ordinal, ffi::AnyBuffer y, ffi::Buffer<ffi::PRED> is_token_in_rank,
                       ffi::Buffer<ffi::S32> recv_counts, ffi::AnyBuffer /*order*/,
                       ffi::Span<const int32_t> group_table, int64_t group_size, int64_t op_index,
                       int64_t two_level, ffi::Result<ffi::AnyBuffer> out) {
  return guarded([&] {
    poison(out);
    Device& dev = Runtime::get().device_by_ordinal(ordinal);
    cpu::Group g = group_of(dev, group_table, group_size, "combine");
    cpu::CombineArgs a{static_cast<const uint8_t*>(y.untyped_data()),
                       float_type(y, "combine"),
                       int(dim(y, 1)),
                       int(dim(y, 0)),
                       int(dim(is_token_in_rank, 0)),
                       is_token_in_rank.typed_data(),
                       recv_counts.typed_data(),
                       static_cast<uint8_t*>(out->untyped_data()),
                       uint32_t(op_index)};
    aborting_the_job_on_failure(dev, two_level, [&] { cpu::combine(dev, g, a); });
  });
}

// Argument filling shared by the one-call and two-call forms of the low-latency ops.
void set_dispatch_inputs(cpu::LowLatencyDispatchArgs& a, const ffi::AnyBuffer& x, const ffi::AnyBuffer& scales,
                         const ffi::Buffer<ffi::S32>& topk_idx, int64_t op_index, int64_t fp8_cast) {
  const ffi_common::DispatchRows rows = ffi_common::dispatch_rows(x, scales, fp8_cast);
  a.x = static_cast<const uint8_t*>(x.untyped_data());
  a.x_row_bytes = uint64_t(rows.row_bytes);
  a.scales = rows.cast == Fp8Cast::kNone ? static_cast<const uint8_t*>(scales.untyped_data()) : nullptr;
  a.scale_row_bytes = uint64_t(rows.scale_row_bytes);
  a.cast = rows.cast;
  a.x_bf16 = rows.x_bf16;
  a.topk_idx = topk_idx.typed_data();
  a.num_tokens = int(dim(topk_idx, 0));
  a.topk = int(dim(topk_idx, 1));
  a.op_index = uint32_t(op_index);
}

void set_dispatch_outputs(cpu::LowLatencyDispatchArgs& a, ffi::Result<ffi::AnyBuffer>& recv_x,
                          ffi::Result<ffi::AnyBuffer>& recv_scales, ffi::Result<ffi::Buffer<ffi::S32>>& recv_count,
                          ffi::Result<ffi::Buffer<ffi::S32>>& layout, ffi::Result<ffi::Buffer<ffi::S32>>& src_slot) {
  poison(recv_x, recv_scales, recv_count, layout, src_slot);
  a.x_row_bytes = row_bytes_3d(*recv_x);
  a.scale_row_bytes = row_bytes_3d(*recv_scales);
  a.recv_x = static_cast<uint8_t*>(recv_x->untyped_data());
  a.recv_scales = static_cast<uint8_t*>(recv_scales->untyped_data());
  a.recv_count = recv_count->typed_data();
  a.layout = layout->typed_data();
  a.src_slot = src_slot->typed_data();
}

void set_combine_send(cpu::LowLatencyCombineArgs& a, const ffi::AnyBuffer& y, const ffi::Buffer<ffi::S32>& layout,
                      int64_t op_index) {
  a.y = static_cast<const uint8_t*>(y.untyped_data());
  a.dtype = float_type(y, "low_latency_combine");
  a.hidden = int(y.dimensions()[2]);
  a.layout = layout.typed_data();
  a.op_index = uint32_t(op_index);
}

void set_combine_receive(cpu::LowLatencyCombineArgs& a, const ffi::Buffer<ffi::S32>& topk_idx,
                         const ffi::Buffer<ffi::F32>& topk_weights, ffi::Result<ffi::AnyBuffer>& out) {
  poison(out);
  a.dtype = float_type(*out, "low_latency_combine");
  a.hidden = int(out->dimensions()[1]);
  a.topk_idx = topk_idx.typed_data();
  a.topk_weights = topk_weights.typed_data();
  a.num_tokens = int(dim(topk_idx, 0));
  a.topk = int(dim(topk_idx, 1));
  a.out = static_cast<uint8_t*>(out->untyped_data());
}

// What every low-latency handler does first: find the device and its group, set the static sizes.
template <class Args, class Body>
ffi::Error low_latency_op(int32_t ordinal, ffi::Span<const int32_t> group_table, int64_t group_size, const char* op,
                          int64_t num_experts, int64_t max_tokens_per_rank, Body&& body) {
  return guarded([&] {
    Device& dev = Runtime::get().device_by_ordinal(ordinal);
    cpu::Group g = group_of(dev, group_table, group_size, op);
    Args a{};
    a.num_experts = int(num_experts);
    a.max_tokens_per_rank = int(max_tokens_per_rank);
    body(dev, g, a);
  });
}

ffi::Error LowLatencyDispatchImpl(int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer scales,
                                  ffi::Buffer<ffi::S32> topk_idx, ffi::AnyBuffer /*order*/,
                                  ffi::Span<const int32_t> group_table, int64_t group_size, int64_t op_index,
                                  int64_t num_experts, int64_t max_tokens_per_rank, int64_t fp8_cast,
                                  ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_scales,
                                  ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                                  ffi::Result<ffi::Buffer<ffi::S32>> layout,
                                  ffi::Result<ffi::Buffer<ffi::S32>> src_slot) {
  return low_latency_op<cpu::LowLatencyDispatchArgs>(
      ordinal, group_table, group_size, "low_latency_dispatch", num_experts, max_tokens_per_rank,
      [&](Device& dev, const cpu::Group& g, cpu::LowLatencyDispatchArgs& a) {
        set_dispatch_outputs(a, recv_x, recv_scales, recv_count, layout, src_slot);
        set_dispatch_inputs(a, x, scales, topk_idx, op_index, fp8_cast);
        cpu::low_latency_dispatch(dev, g, a);
      });
}

ffi::Error LowLatencyDispatchSendImpl(int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer scales,
                                      ffi::Buffer<ffi::S32> topk_idx, ffi::AnyBuffer /*order*/,
                                      ffi::Span<const int32_t> group_table, int64_t group_size, int64_t op_index,
                                      int64_t num_experts, int64_t max_tokens_per_rank, int64_t fp8_cast,
                                      ffi::Result<ffi::Buffer<ffi::S32>> token) {
  return low_latency_op<cpu::LowLatencyDispatchArgs>(
      ordinal, group_table, group_size, "low_latency_dispatch", num_experts, max_tokens_per_rank,
      [&](Device& dev, const cpu::Group& g, cpu::LowLatencyDispatchArgs& a) {
        set_dispatch_inputs(a, x, scales, topk_idx, op_index, fp8_cast);
        cpu::low_latency_dispatch_send(dev, g, a);
        *token->typed_data() = int32_t(op_index);
      });
}

ffi::Error LowLatencyDispatchRecvImpl(int32_t ordinal, ffi::AnyBuffer /*token*/, ffi::AnyBuffer /*order*/,
                                      ffi::Span<const int32_t> group_table, int64_t group_size, int64_t /*op_index*/,
                                      int64_t num_experts, int64_t max_tokens_per_rank, int64_t topk,
                                      ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_scales,
                                      ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                                      ffi::Result<ffi::Buffer<ffi::S32>> layout,
                                      ffi::Result<ffi::Buffer<ffi::S32>> src_slot) {
  return low_latency_op<cpu::LowLatencyDispatchArgs>(
      ordinal, group_table, group_size, "low_latency_dispatch", num_experts, max_tokens_per_rank,
      [&](Device& dev, const cpu::Group& g, cpu::LowLatencyDispatchArgs& a) {
        set_dispatch_outputs(a, recv_x, recv_scales, recv_count, layout, src_slot);
    a.topk = int(topk);
        cpu::low_latency_dispatch_receive(dev, g, a);
      });
}

// (src_slot is for the GPU kernels; the CPU exchange returns rows in the layout's order.)
ffi::Error LowLatencyCombineImpl(int32_t ordinal, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> layout,
                                 ffi::Buffer<ffi::S32> /*src_slot*/, ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                                 ffi::AnyBuffer /*order*/, ffi::Span<const int32_t> group_table, int64_t group_size,
                                 int64_t op_index, int64_t num_experts, int64_t max_tokens_per_rank,
                                 ffi::Result<ffi::AnyBuffer> out) {
  return low_latency_op<cpu::LowLatencyCombineArgs>(
      ordinal, group_table, group_size, "low_latency_combine", num_experts, max_tokens_per_rank,
      [&](Device& dev, const cpu::Group& g, cpu::LowLatencyCombineArgs& a) {
        set_combine_receive(a, topk_idx, topk_weights, out);
        set_combine_send(a, y, layout, op_index);
        cpu::low_latency_combine(dev, g, a);
      });
}

ffi::Error LowLatencyCombineSendImpl(int32_t ordinal, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> layout,
                                     ffi::Buffer<ffi::S32> /*src_slot*/, ffi::AnyBuffer /*order*/,
                                     ffi::Span<const int32_t> group_table, int64_t group_size, int64_t op_index,
                                     int64_t num_experts, int64_t max_tokens_per_rank, int64_t /*topk*/,
                                     ffi::Result<ffi::Buffer<ffi::S32>> token) {
  return low_latency_op<cpu::LowLatencyCombineArgs>(
      ordinal, group_table, group_size, "low_latency_combine", num_experts, max_tokens_per_rank,
      [&](Device& dev, const cpu::Group& g, cpu::LowLatencyCombineArgs& a) {
        set_combine_send(a, y, layout, op_index);
        cpu::low_latency_combine_send(dev, g, a);
        *token->typed_data() = int32_t(op_index);
      });
}

ffi::Error LowLatencyCombineRecvImpl(int32_t ordinal, ffi::AnyBuffer /*token*/, ffi::Buffer<ffi::S32> topk_idx,
                                     ffi::Buffer<ffi::F32> topk_weights, ffi::AnyBuffer /*order*/,
                                     ffi::Span<const int32_t> group_table, int64_t group_size, int64_t /*op_index*/,
                                     int64_t num_experts, int64_t max_tokens_per_rank,
                                     ffi::Result<ffi::AnyBuffer> out) {
  return low_latency_op<cpu::LowLatencyCombineArgs>(
      ordinal, group_table, group_size, "low_latency_combine", num_experts, max_tokens_per_rank,
      [&](Device& dev, const cpu::Group& g, cpu::LowLatencyCombineArgs& a) {
        set_combine_receive(a, topk_idx, topk_weights, out);
        cpu::low_latency_combine_receive(dev, g, a);
      });
}

#ifdef UCCL_EP_WITH_CUDA
// GPUs on several nodes: the proxy path, staged through host memory. Each op copies its device buffers to host
// memory, runs the CPU implementation above on the copies, and copies the results back, on XLA's stream (with a
// host wait before and after). Correct wherever the proxy runtime runs; one host round trip per op (kernels that
// post commands to the proxies themselves are not built yet).

// Pinned host memory for one device's staged ops, kept from call to call and grown when an op needs more: copies
// from pinned memory run at PCIe speed, and no call allocates, zeroes or faults in its buffers again. (Measured on
// 2xH200 before it, with a fresh zeroed std::vector per buffer per call: 171 ms for a BF16 dispatch of 4096
// tokens x 7168.)
class HostArena {
 public:
  static HostArena& of(int32_t ordinal) {
    static std::mutex mutex;
    static std::map<int32_t, HostArena> arenas;  // stable addresses
    std::lock_guard<std::mutex> lock(mutex);
    return arenas[ordinal];
  }
  HostArena() = default;
  HostArena(const HostArena&) = delete;
  // Runtime shutdown frees nothing here: the arena lives as long as the process, like the CUDA context.

  std::mutex& mutex() { return mutex_; }  // held for a whole staged op
  char* reserve(size_t bytes) {
    if (bytes > bytes_) {
      const size_t grown = std::max(bytes, bytes_ * 3 / 2);
      if (base_) cudaFreeHost(base_);
      base_ = nullptr;
      bytes_ = 0;
      void* p = nullptr;
      if (cudaHostAlloc(&p, grown, cudaHostAllocPortable) != cudaSuccess)
        throw std::runtime_error("uccl_ep host staging: cudaHostAlloc of " + std::to_string(grown) + " bytes failed");
      base_ = static_cast<char*>(p);
      bytes_ = grown;
    }
    return base_;
  }

 private:
  std::mutex mutex_;
  char* base_ = nullptr;
  size_t bytes_ = 0;
};

class HostStage {
 public:
  HostStage(cudaStream_t stream, HostArena& arena) : stream_(stream), arena_(arena) {}

  // First pass over the arguments: the host bytes they need.
  void plan(const ffi::AnyBuffer& b) { need_ += slot(b.size_bytes()); }
  template <ffi::DataType T>
  void plan(const ffi::Buffer<T>& b) { need_ += slot(b.size_bytes()); }
  template <class T>
  void plan(ffi::Result<T>& r) { need_ += slot(r->size_bytes()); }
  template <class T>
  void plan(const T&) {}
  // Then the host twin of each argument.
  ffi::AnyBuffer operator()(const ffi::AnyBuffer& b) { return ffi::AnyBuffer(copy_in(b)); }
  template <ffi::DataType T>
  ffi::Buffer<T> operator()(const ffi::Buffer<T>& b) { return ffi::Buffer<T>(copy_in(b)); }
  template <class T>
  ffi::Result<T> operator()(ffi::Result<T>& r) {
    const XLA_FFI_Buffer* host = describe(*r);
    results_.push_back({r->untyped_data(), host->data, r->size_bytes()});
    return ffi::Result<T>(T(host));
  }
  template <class T>
  T operator()(T value) { return value; }  // attributes and spans stay as they are

  // Waits for the copies to host memory (and the work before them).
  void fetch() { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
  // Copies the results back and waits for them (the arena is reused by the next op).
  void store() {
    for (const auto& r : results_)
      if (r.bytes)
        check(cudaMemcpyAsync(r.device, r.host, r.bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  struct Host {
    XLA_FFI_Buffer buffer;
    std::vector<int64_t> dims;
  };
  struct Copy {
    void* device;
    const void* host;
    size_t bytes;
  };
  static size_t slot(size_t bytes) { return (std::max<size_t>(bytes, 16) + 255) / 256 * 256; }
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string("uccl_ep host staging: ") + what + ": " +
                                                   cudaGetErrorString(e));
  }
  template <class B>
  const XLA_FFI_Buffer* describe(const B& b) {
    if (!base_) base_ = arena_.reserve(need_);
    if (used_ + slot(b.size_bytes()) > need_) throw std::logic_error("uccl_ep host staging: an argument was not planned");
    Host& h = hosts_.emplace_back();
    auto dims = b.dimensions();
    h.dims.assign(dims.begin(), dims.end());
    h.buffer = XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, static_cast<XLA_FFI_DataType>(b.element_type()),
                              base_ + used_, int64_t(h.dims.size()), h.dims.data()};
    used_ += slot(b.size_bytes());
    return &h.buffer;
  }
  template <class B>
  const XLA_FFI_Buffer* copy_in(const B& b) {
    const XLA_FFI_Buffer* host = describe(b);
    if (b.size_bytes())
      check(cudaMemcpyAsync(host->data, b.untyped_data(), b.size_bytes(), cudaMemcpyDeviceToHost, stream_),
            "cudaMemcpyAsync");
    return host;
  }

  cudaStream_t stream_;
  HostArena& arena_;
  char* base_ = nullptr;
  size_t need_ = 0, used_ = 0;
  std::deque<Host> hosts_;  // stable addresses: the FFI buffers point into them
  std::vector<Copy> results_;
};

// A CUDA handler over the CPU implementation `kImpl`: the same arguments, after XLA's stream.
template <auto kImpl>
struct Staged;
template <class... Args, ffi::Error (*kImpl)(int32_t, Args...)>
struct Staged<kImpl> {
  static ffi::Error call(cudaStream_t stream, int32_t ordinal, Args... args) {
    try {
      HostArena& arena = HostArena::of(ordinal);
      std::lock_guard<std::mutex> lock(arena.mutex());
      HostStage stage(stream, arena);
      (stage.plan(args), ...);
      auto host_args = std::tuple<Args...>(stage(args)...);
      stage.fetch();
      ffi::Error error = std::apply([&](auto&... a) { return kImpl(ordinal, a...); }, host_args);
      if (error.failure()) return error;  // XLA fails the program: nothing reads the outputs
      stage.store();
      return error;
    } catch (const std::exception& e) {
      return ffi::Error(ffi::ErrorCode::kInternal, e.what());
    }
  }
};
#endif

}  // namespace
}  // namespace uccl_ep::ffi_cpu

using namespace uccl_ep::ffi_cpu;

XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEpLayoutCpu, LayoutImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()    // topk_idx
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks")
                                  .Ret<ffi::Buffer<ffi::S32>>()    // num_tokens_per_rank
                                  .Ret<ffi::Buffer<ffi::S32>>()    // num_tokens_per_expert
                                  .Ret<ffi::Buffer<ffi::PRED>>());  // is_token_in_rank

#define UCCL_EP_CPU_HANDLER(stem, name, signature) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(UcclEp##stem##Cpu, stem##Impl,  \
                                ffi_common::signature(ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>()));
UCCL_EP_FFI_OPS(UCCL_EP_CPU_HANDLER)

#ifdef UCCL_EP_WITH_CUDA
// The host-staged CUDA handlers (see HostStage); ffi/cuda_handlers.cpp routes to them when the process runs the
// proxy runtime instead of the NVLink one.
#define UCCL_EP_STAGED_HANDLER(stem, name, signature)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                       \
      UcclEp##stem##Staged, Staged<stem##Impl>::call,                                  \
      ffi_common::signature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()));
UCCL_EP_FFI_OPS(UCCL_EP_STAGED_HANDLER)
#endif
