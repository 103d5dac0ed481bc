// The normal-mode kernels' stamps of their spans (KernelStamp). Included by the .cu files whose kernels stamp
// (normal_nvlink.cu, normal_proxy.cu): without separate compilation a __device__ global belongs to one translation
// unit, so each has its own g_kernel_stamps, and set_kernel_stamps points every one.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "device_common.cuh"
#include "testing.hpp"

namespace uccl_ep::nvl {
namespace {

// Kernel spans for the loopback bench (set_kernel_stamps, testing.hpp): per KernelKind the earliest start and the
// latest end of any block of any rank, in ns of %globaltimer, while the bench points this at a device array; null
// otherwise (one load and branch per block).
__device__ uint64_t* g_kernel_stamps = nullptr;
// One edge of kind k's span (its start, or its end), stamped by whichever thread calls it.
__device__ inline void stamp_edge(KernelKind k, bool end) {
  uint64_t* stamps = g_kernel_stamps;
  if (!stamps) return;
  auto* word = reinterpret_cast<unsigned long long*>(stamps + 2 * int(k) + (end ? 1 : 0));
  if (end)
    atomicMax(word, global_ns());
  else
    atomicMin(word, global_ns());
}

// A scope's span, stamped by the block's thread 0.
struct KernelStamp {
  KernelKind kind;
  __device__ explicit KernelStamp(KernelKind k) : kind(k) {
    if (threadIdx.x == 0) stamp_edge(kind, false);
  }
  __device__ ~KernelStamp() {
    if (threadIdx.x == 0) stamp_edge(kind, true);
  }
};

}  // namespace
}  // namespace uccl_ep::nvl
