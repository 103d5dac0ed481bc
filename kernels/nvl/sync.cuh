// Device-side synchronization with peers and the host (system scope) and between the blocks of one launch (GPU
// scope: a system-scope release fences against every peer and the host, which such words need not wait for):
// acquire loads and release writes on 64-bit words, and the GPU's global nanosecond timer for deadlines.
// Framework-free; included by the NVLink kernels and the command-ring producer.
#pragma once
#include <cstdint>

namespace uccl_ep::nvl {

// The block's barrier, for code that threads may reach with their warp diverged: these kernels leave work to one
// lane (thread 0's handovers and announcements, the bulk rings' issuing lanes), and the compiler need not bring the
// warp back together before the next barrier, nor keep one copy of it (it may duplicate the code after a branch).
// __syncthreads() is bar.sync, i.e. barrier.sync.aligned, which requires the whole warp at one instruction: a warp
// that reaches it diverged is let through early, and its threads run a barrier out of step with the block from then
// on (seen on H200: issuing lanes arming stage barriers that thread 0 had not initialized yet; a __syncwarp() first
// did not keep the warp together). Without .aligned, each thread waits for its warp's other non-exited threads at
// whichever barrier instruction they reach. A block's sums go through shared memory between these
// (normal_scan.cuh's block_exclusive_scan), not a reduction barrier (barrier.red, __syncthreads_count), which a
// warp split over two copies of it would meet apart from the block's plain barriers.
__device__ __forceinline__ void block_sync() { asm volatile("barrier.sync 0;" ::: "memory"); }

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// A release for several words of one launch at once: fence_acq_rel_gpu() once, then store_relaxed_gpu() to each.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ void store_relaxed_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// No ordering with the stores before it (the command rings' head: ring_producer.cuh).
__device__ __forceinline__ void store_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// A release for several words at once: fence_acq_rel_sys() once, then add_relaxed_sys() to each (a release add each
// would fence again before every word, each fence waiting for the add before it to reach its peer).
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ void add_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

}  // namespace uccl_ep::nvl
