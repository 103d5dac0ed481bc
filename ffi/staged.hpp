// Host staging for CUDA handlers (included by cpu_handlers.cpp in CUDA builds only).
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace uccl_ep::ffi_cpu {

namespace ffi = xla::ffi;

// The host-staged path (Path::kStaged: GPUs on the proxy runtime where kernels cannot push its commands). Each op
// copies its device buffers to host memory, runs the CPU handler's implementation on the copies, and copies the
// results back, on XLA's stream (with a host wait before and after): one host round trip per op.

// Pinned host memory for one device's staged ops, kept from call to call and grown when an op needs more: copies
// from pinned memory run at PCIe speed, and no call allocates, zeroes or faults in its buffers again.
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
  void plan(const ffi::Buffer<T>& b) {
    need_ += slot(b.size_bytes());
  }
  template <class T>
  void plan(ffi::Result<T>& r) {
    need_ += slot(r->size_bytes());
  }
  template <class T>
  void plan(const T&) {}
  // Then the host twin of each argument.
  ffi::AnyBuffer operator()(const ffi::AnyBuffer& b) { return ffi::AnyBuffer(copy_in(b)); }
  template <ffi::DataType T>
  ffi::Buffer<T> operator()(const ffi::Buffer<T>& b) {
    return ffi::Buffer<T>(copy_in(b));
  }
  template <class T>
  ffi::Result<T> operator()(ffi::Result<T>& r) {
    const XLA_FFI_Buffer* host = describe(*r);
    results_.push_back({r->untyped_data(), host->data, r->size_bytes()});
    return ffi::Result<T>(T(host));
  }
  template <class T>
  T operator()(T value) {
    return value;
  }  // the attributes stay as they are

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
    if (e != cudaSuccess)
      throw std::runtime_error(std::string("uccl_ep host staging: ") + what + ": " + cudaGetErrorString(e));
  }
  template <class B>
  const XLA_FFI_Buffer* describe(const B& b) {
    if (!base_) base_ = arena_.reserve(need_);
    if (used_ + slot(b.size_bytes()) > need_)
      throw std::logic_error("uccl_ep host staging: an argument was not planned");
    Host& h = hosts_.emplace_back();
    auto dims = b.dimensions();
    h.dims.assign(dims.begin(), dims.end());
    h.buffer = XLA_FFI_Buffer{
        XLA_FFI_Buffer_STRUCT_SIZE, nullptr,      static_cast<XLA_FFI_DataType>(b.element_type()), base_ + used_,
        int64_t(h.dims.size()),     h.dims.data()};
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
      auto host_args = std::tuple<std::decay_t<Args>...>(stage(args)...);  // held: the attributes come by reference
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

}  // namespace uccl_ep::ffi_cpu
