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
struct KernelStamp {
  int kind;
  __device__ explicit KernelStamp(KernelKind k) : kind(int(k)) {
    uint64_t* stamps = g_kernel_stamps;
    if (stamps && threadIdx.x == 0) atomicMin(reinterpret_cast<unsigned long long*>(stamps + 2 * kind), global_ns());
  }
  __device__ ~KernelStamp() {
    uint64_t* stamps = g_kernel_stamps;
    if (stamps && threadIdx.x == 0)
      atomicMax(reinterpret_cast<unsigned long long*>(stamps + 2 * kind + 1), global_ns());
  }
};

}  // namespace
}  // namespace uccl_ep::nvl
