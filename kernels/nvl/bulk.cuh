// Hopper bulk copies (TMA, cp.async.bulk) for the normal-mode kernels: an issuing thread moves rows global ->
// shared -> global (a peer's buffer over NVLink, or our own memory) through a ring of stages while the SM's other
// warps do the layout or reduce. An SM copies at most ~50 GB/s either way, and one issuing thread spends ~0.36 us
// per copy (bench/RESULTS.md), so small copies want several issuing threads. Addresses and sizes: multiples of 16.
// Included by the .cu files of kernels/nvl only.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace uccl_ep::nvl {
namespace {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
}
// After barrier_init and before any bulk copy completes on the barrier (then a block_sync for the other threads).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival that also expects `bytes` of bulk loads to complete on the barrier before its phase ends.
__device__ __forceinline__ void barrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}
// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
}

// global -> shared, completing `bytes` on `bar`.
__device__ __forceinline__ void bulk_load(void* smem, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_address(smem)),
               "l"(src), "r"(bytes), "r"(shared_address(bar))
               : "memory");
}
// shared -> global (ours or a peer's), in the thread's current bulk group.
__device__ __forceinline__ void bulk_store(void* dst, const void* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(shared_address(smem)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until at most N of the thread's bulk groups still read their shared memory (stages older than that are free).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// The same with N (1 to kMaxLag) known only at run time.
constexpr int kMaxLag = 6;
template <int N = kMaxLag>
__device__ __forceinline__ void bulk_wait_read(int n) {
  if constexpr (N > 1) {
    if (n < N) return bulk_wait_read<N - 1>(n);
  }
  bulk_wait_read<N>();
}
// Until at most N of the thread's bulk groups are incomplete (the older groups' writes are performed).
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
// Shared memory a block of these kernels may take (H100/H200: 227 KiB), less what the kernels declare statically.
constexpr uint32_t kBulkSharedBytes = 200 * 1024;
constexpr int kMaxStages = 64;  // four a warp for the combine receiver's 16 warps

// A stage ring driven by one thread: job j goes through stage j % stages; `full[s]` completes when a job's loads
// have landed. The thread's parity bits track each stage's phase (bit s). A stage is refilled `lag` jobs after its
// stores were issued (1 to kMaxLag, fewer than `stages`): stages - lag loads stay in flight behind the stores.
struct StageRing {
  char* base;
  uint32_t stage_bytes;
  int stages;
  uint64_t* full;  // [stages], shared
  int lag;
  uint32_t parity = 0;
  __device__ char* stage(int s) const { return base + size_t(s) * stage_bytes; }
};

// Runs a stream of jobs through the ring, in order, from one thread. next(j, stage, bar) makes job j (j = 0, 1, ...
// in turn): it issues the job's bulk loads into `stage`, arming `bar` for their bytes, and returns the bytes, 0 for a
// job that moves nothing (`bar` untouched), or kNoMoreJobs. store(j, stage) issues job j's bulk stores once its
// loads landed; each job's stores are one bulk group. done(k) is called, in order and now and then, with a count k
// of jobs whose stores have completed (their writes performed), and at the end with the number of jobs. A stage is
// refilled ring.lag jobs after its stores were issued, once they have read it; jobs are loaded ahead as far as the
// stages allow. Returns with every store complete.
constexpr int64_t kNoMoreJobs = -1;
template <int kPending = 8, int kAnnounceEvery = 16, class Next, class Store, class Done>
__device__ void run_bulk_jobs(StageRing& ring, Next&& next, Store&& store, Done&& done) {
  const int S = ring.stages, lag = ring.lag;
  uint32_t loaded = 0;  // bit s: stage s's job moves bytes (else its barrier was not armed)
  int issued = 0;
  bool more = true;
  const auto issue = [&] {
    const int s = issued % S;
    const int64_t bytes = next(issued, ring.stage(s), ring.full + s);
    if (bytes == kNoMoreJobs) {
      more = false;
      return;
    }
    loaded = bytes ? loaded | 1u << s : loaded & ~(1u << s);
    ++issued;
  };
#pragma unroll 1
  while (more && issued < S) issue();
#pragma unroll 1
  for (int j = 0; j < issued; ++j) {
    const int s = j % S;
    if (loaded >> s & 1u) {
      barrier_wait(ring.full + s, ring.parity >> s & 1u);
      ring.parity ^= 1u << s;
      store(j, ring.stage(s));
    }
    bulk_commit();  // an empty group for a job that moved nothing keeps group j = job j
    // Refill the stage of job j - lag: at most lag groups still reading means its stores have read it.
    if (j >= lag && more) {
      bulk_wait_read(lag);
      issue();
    }
    if ((j + 1) % kAnnounceEvery == 0 && j + 1 > kPending) {
      bulk_wait<kPending>();
      done(j + 1 - kPending);
    }
  }
  bulk_wait<0>();
  done(issued);
}

}  // namespace
}  // namespace uccl_ep::nvl
