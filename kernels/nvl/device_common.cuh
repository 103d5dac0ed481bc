// Device helpers the NVLink kernels share: error reports, warp copies, 16-byte vectors of float32 or bfloat16.
// Included by the .cu files of kernels/nvl only (everything is in an anonymous namespace).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "api.hpp"
#include "sync.cuh"

namespace uccl_ep::nvl {
namespace {

constexpr int kWarp = 32;
constexpr int kTransferThreads = 512;  // threads of normal mode's send and receive blocks
constexpr int kTransferWarps = kTransferThreads / kWarp;

inline void check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw std::runtime_error("uccl_ep nvl: " + what + ": " + cudaGetErrorString(e));
}

// Lets the current GPU, `device`, reach GPU `peer`'s memory. A GPU reaches its own without it, and access enabled
// earlier (by another buffer or bench of this process) stays as it is.
inline void enable_peer_access(int device, int peer) {
  if (peer == device) return;
  const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // clears the error it left behind
    return;
  }
  check(e, "cudaDeviceEnablePeerAccess to GPU " + std::to_string(peer));
}

// The peer a group position stands for, checked against this GPU's ranks.
inline int peer_of(const NvlDevice& dev, const Group& g, int s) {
  int p = g.ranks[s];
  if (p < 0 || p >= dev.num_ranks())
    throw std::invalid_argument("uccl_ep nvl: group member " + std::to_string(p) + " is not a GPU of this host");
  return p;
}

inline void check_group(const NvlDevice& dev, const Group& g, const char* op) {
  if (g.size > kMaxRanks)
    throw std::invalid_argument(std::string("uccl_ep ") + op + ": NVLink groups hold at most 8 GPUs");
  if (g.ranks[g.self] != dev.rank()) throw std::logic_error("uccl_ep nvl: group does not hold this rank");
}

// The GPU's address of pinned, mapped host memory (the proxy runtime's rings, words and buffers).
template <class T>
T* device_view(T* host) {
  void* d = nullptr;
  check(cudaHostGetDevicePointer(&d, const_cast<void*>(static_cast<const void*>(host)), 0),
        "cudaHostGetDevicePointer (host memory must be pinned and mapped: UCCL_EP_PINNED=0 leaves it unmapped)");
  return static_cast<T*>(d);
}

// Loads kernels now (see preload_intranode_kernels in api.hpp for why).
template <class... Kernels>
void load_kernels(const Kernels&... kernels) {
  cudaFuncAttributes attr;
  (check(cudaFuncGetAttributes(&attr, kernels), "loading a kernel"), ...);
}

// Lets kernels take `bytes` of dynamic shared memory (past the default 48 KiB).
template <class... Kernels>
void allow_shared_bytes(uint32_t bytes, const Kernels&... kernels) {
  (check(cudaFuncSetAttribute(kernels, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
         "cudaFuncSetAttribute"),
   ...);
}

// The first error of a kernel wins, except that a peer or proxy that did not answer (kPeerLate, kRingFull: the rank is
// out of step) replaces an input error (the host must see it to tell the peers); check_errors() raises it on the host.
__device__ void report(DeviceErrors* err, int code, int rank, int64_t a, int64_t b, int64_t c) {
  int seen = atomicCAS(&err->code, 0, code);
  if (seen != kNoError && seen != kPeerLate && seen != kRingFull && (code == kPeerLate || code == kRingFull))
    seen = atomicCAS(&err->code, seen, code) == seen ? 0 : seen;
  if (seen == 0) {
    err->rank = rank;
    err->a = a;
    err->b = b;
    err->c = c;
    __threadfence_system();
  }
}

// How a waiting thread sleeps between polls after its first 32: not at all; a flat 100 ns; or 100 ns doubling every
// 32 polls, at most 1.6 us (a normal-mode receive side has hundreds of waiting warps, and their loads of the few
// words the senders write would take the memory system from the copies they wait for).
enum class Sleep { kNone, kFlat, kBackoff };
enum class Polled { kReached, kTimedOut, kGivenUp };
// Who writes the word polled: a peer or the host (system scope), or another block of this launch (GPU scope).
enum class Scope { kSystem, kGpu };
// Polls `flag` until it reaches `value`; gives up after `timeout_ns`, or once a wait reported a late peer (the op is
// given up). The clock and the error word (host memory) are read every 256 polls.
__device__ inline Polled poll_flag(const uint64_t* flag, uint64_t value, uint64_t timeout_ns, const DeviceErrors* err,
                                   Sleep sleep, Scope scope = Scope::kSystem) {
  const uint64_t start = global_ns();
  for (uint32_t spins = 1; (scope == Scope::kGpu ? load_acquire_gpu(flag) : load_acquire_sys(flag)) < value; ++spins) {
    if (spins > 32 && sleep != Sleep::kNone)
      __nanosleep(sleep == Sleep::kFlat ? 100u : 100u << min((spins - 33) / 32, 4u));
    if (spins % 256 != 0) continue;
    if (*reinterpret_cast<const volatile int*>(&err->code) == kPeerLate) return Polled::kGivenUp;
    if (global_ns() - start > timeout_ns) return Polled::kTimedOut;
  }
  return Polled::kReached;
}

// Waits until `flag` reaches `value`; false once `timeout_ns` passed (reporting code 5: `peer` did not send message
// `message`), or as soon as an earlier wait timed out (the stream is out of step after that).
__device__ inline bool wait_flag(const uint64_t* flag, uint64_t value, int64_t message, uint64_t timeout_ns,
                                 DeviceErrors* err, int rank, int peer, Sleep sleep = Sleep::kNone) {
  if (poll_flag(flag, value, timeout_ns, err, sleep) == Polled::kReached) return true;
  report(err, kPeerLate, rank, peer, message, int64_t(timeout_ns / 1000000000ull));
  return false;
}

// Loads for warp_copy: the read-only path for data that no one writes while the kernel runs, L2 only (the
// point of coherence for peers' NVLink stores) for data a peer wrote while this kernel waited for it.
enum class Load { kReadOnly, kCoherent };
template <Load kLoad>
__device__ __forceinline__ int4 load16(const int4* p) {
  if constexpr (kLoad == Load::kReadOnly)
    return __ldg(p);
  else
    return __ldcg(p);
}

// The last index l of [0, n) with starts[l] <= v, for non-decreasing `starts` (0 where there is none, or n <= 1):
// the group that position v falls in, given each group's first position.
__device__ __forceinline__ int group_of(const int* starts, int n, int64_t v) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (starts[mid] <= v)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// Copies n 16-byte vectors, thread `thread` of `threads` taking vectors thread, thread + threads, ..., with several
// loads in flight per thread before their stores (one load at a time leaves the memory system idle); the last batch
// is partial, so a tail costs one round trip rather than one a vector.
constexpr int kUnroll = 4;
template <Load kLoad = Load::kReadOnly>
__device__ __forceinline__ void strided_copy16(int4* __restrict__ d, const int4* __restrict__ s, int64_t n, int thread,
                                               int threads) {
  for (int64_t i = thread; i < n; i += kUnroll * threads) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * threads < n) v[u] = load16<kLoad>(s + i + u * threads);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * threads < n) d[i + u * threads] = v[u];
  }
}

// Copies `bytes` with one warp: 16-byte rows as int4 (strided_copy16).
template <Load kLoad = Load::kReadOnly>
__device__ __forceinline__ void warp_copy(char* __restrict__ dst, const char* __restrict__ src, int64_t bytes,
                                          int lane) {
  if ((bytes % 16) == 0 && (reinterpret_cast<uintptr_t>(dst) % 16) == 0 &&
      (reinterpret_cast<uintptr_t>(src) % 16) == 0) {
    strided_copy16<kLoad>(reinterpret_cast<int4*>(dst), reinterpret_cast<const int4*>(src), bytes / 16, lane, kWarp);
    return;
  }
  for (int64_t i = lane; i < bytes; i += kWarp) dst[i] = kLoad == Load::kReadOnly ? src[i] : __ldcg(src + i);
}
__device__ __forceinline__ void warp_zero(char* dst, int64_t bytes, int lane) {
  if ((bytes % 16) == 0 && (reinterpret_cast<uintptr_t>(dst) % 16) == 0) {
    int4* d = reinterpret_cast<int4*>(dst);
    for (int64_t i = lane; i < bytes / 16; i += kWarp) d[i] = make_int4(0, 0, 0, 0);
    return;
  }
  for (int64_t i = lane; i < bytes; i += kWarp) dst[i] = 0;
}

// 16 bytes of T as float32 lanes: acc += scale * v, and back.
template <typename T>
struct Vec;
template <>
struct Vec<float> {
  static constexpr int kN = 4;
  __device__ static void add(float* acc, const int4& v, float scale = 1.f) {
    const float* f = reinterpret_cast<const float*>(&v);
    for (int i = 0; i < kN; ++i) acc[i] += scale * f[i];
  }
  __device__ static int4 pack(const float* acc) {
    int4 v;
    float* f = reinterpret_cast<float*>(&v);
    for (int i = 0; i < kN; ++i) f[i] = acc[i];
    return v;
  }
};
template <>
struct Vec<__nv_bfloat16> {
  static constexpr int kN = 8;
  __device__ static void add(float* acc, const int4& v, float scale = 1.f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
    for (int i = 0; i < kN / 2; ++i) {
      float2 f = __bfloat1622float2(h[i]);
      acc[2 * i] += scale * f.x;
      acc[2 * i + 1] += scale * f.y;
    }
  }
  __device__ static int4 pack(const float* acc) {
    int4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
    for (int i = 0; i < kN / 2; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    return v;
  }
};

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

}  // namespace
}  // namespace uccl_ep::nvl
