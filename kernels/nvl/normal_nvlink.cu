// Normal mode over NVLink (api.hpp): an op is one launch on XLA's stream whose first blocks send and the rest
// receive, moving rows by bulk copies (bulk.cuh, bulk_shapes.cuh) where they allow, else by the SM-store sides of
// normal.cuh; its last block to finish acknowledges the messages it read. Also the host API of the NVLink ops, and the
// loading of every normal-mode kernel.
#include <algorithm>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include <cuda_bf16.h>

#include "api.hpp"
#include "bulk.cuh"
#include "bulk_shapes.cuh"
#include "device_common.cuh"
#include "normal.cuh"
#include "normal_scan.cuh"
#include "pair_layout.cuh"
#include "stamps.cuh"
#include "testing.hpp"

namespace uccl_ep::nvl {
namespace {

// Blocks of one launch hand work to each other through words of NvlDevice::handoff_words: a unit's word gets the
// launch's number (`epoch`, from 1 up) once its writes are in, so the words need no reset and one left by an
// earlier launch never passes. A block that waits for another needs every block of the launch resident at once
// (check_budget_fits).
struct Handoff {
  uint64_t* words;  // in NvlDevice::handoff_words
  uint64_t epoch;
};
// Every fused launch's words: [0] its item counter (ItemCounter), [1] its finished blocks (Acks::finished: a tagged
// count, never read as a handed-over word, which would pass early), then the words it hands over.
constexpr size_t kItemWord = 0, kFinishedWord = 1, kFirstHandedOverWord = 2;

// After the block's units u = first, first + step, ... < count of a pass: their words, once every thread's writes
// are in (the barrier, then one fence cumulative over them for all of the words, not a release each). Only this
// launch's blocks read them: GPU scope.
__device__ void hand_over(const Handoff& h, uint64_t* words, int first, int step, int count) {
  block_sync();
  if (threadIdx.x != 0) return;
  fence_acq_rel_gpu();
  for (int u = first; u < count; u += step) store_relaxed_gpu(words + u, h.epoch);
}
// Waits (one thread) until `word` carries the launch's epoch; false once a peer was reported late (the op is given
// up) or after the deadline, when a block of the launch never ran beside the others (reported).
__device__ bool wait_word_handed_over(const uint64_t* word, uint64_t epoch, const Members& m) {
  const Polled p = poll_flag(word, epoch, m.timeout_ns, m.err, Sleep::kFlat, Scope::kGpu);
  if (p == Polled::kTimedOut)
    report(m.err, kBlocksNotResident, m.rank, gridDim.x, 0, int64_t(m.timeout_ns / 1000000000ull));
  return p == Polled::kReached;
}
// Waits until every unit of a pass has been handed over; false (to the whole block) as wait_word_handed_over.
__device__ bool wait_handed_over(const Handoff& h, const uint64_t* words, int count, const Members& m) {
  return block_waits(count, [&](int u) { return wait_word_handed_over(words + u, h.epoch, m); });
}

// The op's acknowledgements to the members whose messages it read (their regions in our buffer are free again),
// sent by the launch's last block to finish: one system fence after every block's reads, rather than a stream
// memory operation per member after the kernel (each a memory barrier of its own, between our launches).
struct Acks {
  uint64_t* flag[kMaxRanks];  // the members' ack words for us
  uint64_t value[kMaxRanks];  // the message of theirs we read
  int n;
  uint64_t* finished;  // a handoff word: the launch's epoch in its high half, its finished blocks in the low
  bool one_fence;      // as SendTo::one_fence
};
// Returns true to the thread that wrote them (the last block's first).
__device__ bool acknowledge_when_last(const Handoff& h, const Acks& a) {
  block_sync();  // every thread of the block is done with the messages
  if (threadIdx.x != 0) return false;
  __threadfence();
  auto* word = reinterpret_cast<unsigned long long*>(a.finished);
  const uint32_t epoch = uint32_t(h.epoch);  // the tag's 32 bits (wrapping after 2^32 launches, as the tag does)
  const unsigned long long tag = static_cast<unsigned long long>(epoch) << 32;
  unsigned long long seen = *reinterpret_cast<volatile unsigned long long*>(word), now;
  for (;;) {  // an earlier launch's count restarts with this launch's first block
    now = (uint32_t(seen >> 32) == epoch ? seen : tag) + 1;
    const unsigned long long was = atomicCAS(word, seen, now);
    if (was == seen) break;
    seen = was;
  }
  if (now - tag != gridDim.x) return false;
  __threadfence_system();  // every block's reads (their fences, then the count) before the words
  for (int i = 0; i < a.n; ++i)
    a.one_fence ? store_relaxed_sys(a.flag[i], a.value[i]) : store_release_sys(a.flag[i], a.value[i]);
  return true;
}

__device__ void init_stage_barriers(uint64_t* full, int stages) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) barrier_init(full + s, 1);
    fence_barrier_init();
  }
  block_sync();
}

// The bulk senders' announcement of chunk c's progress: the word only grows (red.max), and a release is enough;
// with SendTo::one_fence, one fence for every member's word (fence_acq_rel_sys, then max_relaxed_sys each).
__device__ __forceinline__ void max_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void max_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void announce_max(const SendTo& to, uint64_t* p, uint64_t v) {
  to.one_fence ? max_relaxed_sys(p, v) : max_release_sys(p, v);
}

// A bulk sender's producer `producer` publishes its frontier (its first job or token not yet landed; every one of
// its own before it has) in the block's `frontier` [producers]. The fence orders its landed copies before the word,
// for the announcer.
__device__ __forceinline__ void publish_frontier(int* frontier, int producer, int mine) {
  __threadfence_block();
  reinterpret_cast<volatile int*>(frontier)[producer] = mine;
}

// A bulk sender's announcer, one thread past the producers: until every producer's frontier reaches `end`, each time
// the least of them passes `announced` it announces it (announce(least): everything before it has landed; the fence
// puts the release after the producers' copies). The producers only publish, so none of them stalls on a
// system-scope release while its loaded stages wait.
template <class Announce>
__device__ void announce_frontiers(const int* frontier, int producers, int end, int announced, Announce&& announce) {
  while (announced < end) {
    int least = end;
    for (int q = 0; q < producers; ++q) least = min(least, reinterpret_cast<const volatile int*>(frontier)[q]);
    if (least <= announced) {
      __nanosleep(100);
      continue;
    }
    __threadfence_block();
    announce(least);
    announced = least;
  }
}

// The pass's scale rows (tokens p0 + i, i < tokens; 16-byte multiples) to their members, by `threads` threads (this
// is thread `thread`): the rows are contiguous in `scales`, so thread k takes 16-byte pieces k, k + threads, ... of
// them and a warp's loads and stores stay on consecutive bytes (with a row per thread, each access of a warp would
// touch 32 rows). A round's loads all go out before its stores. Reads the layout's members table.
__device__ void store_scale_rows(const DispatchSendArgs& a, int p0, int tokens, const unsigned* bits, unsigned others,
                                 int thread, int threads) {
  constexpr int kBatch = 10;  // pieces per thread a round: 342 rows of 224 bytes (56 scales) in two with 256 threads
  const int per_row = int(a.scale_row_bytes / 16), n = tokens * per_row;
  const int4* src = reinterpret_cast<const int4*>(a.scales + int64_t(p0) * a.scale_row_bytes);
  for (int i0 = 0; i0 < n; i0 += kBatch * threads) {
    int4 v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = i0 + k * threads + thread;
      if (i < n) v[k] = __ldg(src + i);
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = i0 + k * threads + thread;
      if (i >= n) break;
      const int token = i / per_row, piece = i - token * per_row;
      for (unsigned m = bits[token] & others; m; m &= m - 1) {
        const int d = __ffs(m) - 1;
        reinterpret_cast<int4*>(a.to.region[d] + a.scales_offset + int64_t(p0 + token) * a.scale_row_bytes)[piece] =
            v[k];
      }
    }
  }
}

// Send side of (cached) dispatch with bulk copies, in the one launch only (token slots: token t's row is row t of
// every message). Per pass of kTransferThreads tokens the block finds each token's members (a shared table; the first
// pass before it waits for the members' acknowledgements), and b.producers threads move the rows in groups of
// b.rows_per_job consecutive tokens, group q of the pass by producer q % b.producers: the group's rows (one row in
// segments of at most segment_bytes, or several whole rows) from x through a stage to every member that needs any of
// them. Meanwhile the warps past the producers send the routing (in the first pass) and store the FP8 scale rows (a
// scale row is too small to be worth a producer's bulk copy), so the copies wait for neither. A producer publishes how
// far its tokens have landed (`frontier`: every token before it that is its own has), and the first thread past the
// producers, once the pass's scale rows are in, announces the least frontier as the chunk's progress.
__device__ void dispatch_send_bulk(const DispatchSendArgs& a, const BulkShape& b, int block, int blocks) {
  const KernelStamp stamp(KernelKind::kDispatchSend);
  if (threadIdx.x == 0) stamp_edge(KernelKind::kRoutingSent, false);
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ int frontier[kMaxProducers];
  unsigned* bits = reinterpret_cast<unsigned*>(smem);
  init_stage_barriers(full, b.stages);
  const SendTo& to = a.to;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int P = b.producers;
  const bool producer = lane == 0 && warp < P;
  const int first_helper = P * kWarp;  // the warps past the producers
  const int per = b.stages / P;
  StageRing ring{smem + b.tables_bytes + size_t(warp * per) * b.stage_bytes, b.stage_bytes, per, full + warp * per,
                 b.lag};
  const int64_t xrb = a.x_row_bytes, srb = a.scales ? a.scale_row_bytes : 0;
  const int segs = int((xrb + b.segment_bytes - 1) / b.segment_bytes);
  const int g = segs == 1 ? b.rows_per_job : 1;  // tokens a job's group holds
  const unsigned others = ~(1u << to.self);
  bool first_pass = true;
  for (int c = block; c < a.chunks; c += blocks) {
    const int t0 = chunk_begin(a.num_tokens, a.chunks, c), t1 = chunk_begin(a.num_tokens, a.chunks, c + 1);
    for (int p0 = t0; p0 < t1; p0 += blockDim.x) {
      const int tokens = min(t1, p0 + int(blockDim.x)) - p0;
      if (int(threadIdx.x) < tokens) bits[threadIdx.x] = token_members(a, p0 + threadIdx.x, true);
      if (int(threadIdx.x) < P) frontier[threadIdx.x] = min(int(threadIdx.x) * g, tokens);
      // The table is in before the producers copy and the warps past them send; nothing lands in a member's
      // region before it has acknowledged our last message.
      if (first_pass) {
        const KernelStamp acks(KernelKind::kAcks);
        if (!wait_acks(to)) return;
      } else {
        block_sync();
      }
      if (warp >= P) {
        const int threads = int(blockDim.x) - first_helper, thread = int(threadIdx.x) - first_helper;
        if (first_pass) {
          send_routing(a, block, blocks, thread, threads);
          if (thread == 0) stamp_edge(KernelKind::kRoutingSent, true);
        }
        if (srb) {
          // The scale rows while the producers copy; a system fence (cumulative over the warps' stores, which the
          // named barrier orders before it) by the announcer before its first announcement.
          store_scale_rows(a, p0, tokens, bits, others, thread, threads);
          group_barrier(threads);
          if (thread == 0) __threadfence_system();
        }
        if (thread == 0)
          announce_frontiers(frontier, P, tokens, 0, [&](int least) {
            if (to.one_fence) fence_acq_rel_sys();
            for (int d = 0; d < to.num_ranks; ++d)
              if (d != to.self) announce_max(to, to.chunks[d] + c, progress(to.message[d], p0 - t0 + least));
          });
      }
      first_pass = false;
      if (producer) {
        // The pass's tokens in groups of g (group q: tokens q * g, ...); this producer's are groups warp, warp + P, ...
        const int mine = ((tokens + g - 1) / g - warp + P - 1) / P;
        const int n = max(0, mine) * segs;
        // Job j: segment j % segs of the producer's group j / segs (its `rows` tokens from p0 + i; a segment of a
        // row, or g whole rows), to the same rows of each member's message.
        const auto part = [&](int j, int& i, int& rows, int64_t& offset, uint32_t& x_bytes) {
          const int seg = segs == 1 ? 0 : j % segs;
          i = (warp + (segs == 1 ? j : j / segs) * P) * g;
          rows = min(g, tokens - i);
          offset = int64_t(seg) * b.segment_bytes;
          x_bytes = uint32_t(min(int64_t(b.segment_bytes), xrb - offset));
        };
        // The members any of the group's tokens go to. One token a job is the common case, and an issuing thread's
        // own work per job bounds small rows: it takes no loop.
        const auto group_members = [&](int i, int rows) {
          unsigned m = bits[i];
          for (int r = 1; r < rows; ++r) m |= bits[i + r];
          return m & others;
        };
        run_bulk_jobs(
            ring,
            [&](int j, char* stage, uint64_t* bar) -> int64_t {
              if (j >= n) return kNoMoreJobs;
              int i, rows;
              int64_t offset;
              uint32_t x_bytes;
              part(j, i, rows, offset, x_bytes);
              if (!group_members(i, rows)) return 0;
              const uint32_t bytes = x_bytes * uint32_t(rows);  // rows > 1: whole rows
              barrier_arrive_expect(bar, bytes);
              bulk_load(stage, a.x + int64_t(p0 + i) * xrb + offset, bytes, bar);
              return bytes;
            },
            [&](int j, char* stage) {
              int i, rows;
              int64_t offset;
              uint32_t x_bytes;
              part(j, i, rows, offset, x_bytes);
              // To each member, a store per run of the group's consecutive tokens that go to it.
              for (unsigned m = group_members(i, rows); m; m &= m - 1) {
                const int d = __ffs(m) - 1;
                if (rows == 1) {
                  bulk_store(to.region[d] + a.x_offset + int64_t(p0 + i) * xrb + offset, stage, x_bytes);
                  continue;
                }
                for (int r = 0, run = 0; r < rows; r += run) {
                  if (!(bits[i + r] >> d & 1)) {
                    run = 1;
                    continue;
                  }
                  for (run = 1; r + run < rows && bits[i + r + run] >> d & 1;) ++run;
                  bulk_store(to.region[d] + a.x_offset + int64_t(p0 + i + r) * xrb + offset, stage + size_t(r) * xrb,
                             x_bytes * uint32_t(run));
                }
              }
            },
            [&](int k) {
              // This producer's first k / segs groups have landed: its frontier is its next group's first token (or
              // the pass's end).
              publish_frontier(frontier, warp, min(tokens, (warp + k / segs * P) * g));
            });
      }
      block_sync();  // the table is the next pass's
    }
  }
  // A block whose chunk has no tokens still announces its routing (empty), which every member's scan waits for.
  if (first_pass && wait_acks(to)) {
    send_routing(a, block, blocks);
    if (threadIdx.x == 0) stamp_edge(KernelKind::kRoutingSent, true);
  }
}

// Hands out one launch's work items 0, 1, ... to whichever thread asks next, in any block of the launch (kItemWord
// of the device's handoff_words). The block that hands its tables over first resets it before it does, and every
// block takes items only after that handover, so a count an earlier launch left (or broke off) never leaks in.
struct ItemCounter {
  uint64_t* word;
  __device__ void reset() const { *reinterpret_cast<volatile unsigned*>(word) = 0; }
  __device__ int take() const { return int(atomicAdd(reinterpret_cast<unsigned*>(word), 1u)); }
};

// With the stamps, dispatch's receive side may also be held back until every member's rows have landed (the sides
// apart): each side's span is then what it moves with the GPU's memory to itself, where in the loopback both sides
// of every rank otherwise share it.
__device__ bool g_sides_apart = false;

// Waits until every chunk of every member's message to us has landed whole (the sides apart, g_sides_apart); false
// (to the whole block) once a member is late (reported).
__device__ bool wait_every_chunk(const DispatchReceiveArgs& a) {
  const ReceiveFrom& from = a.from;
  return block_waits(from.num_ranks * a.chunks, [&](int u) {
    const int s = u % from.num_ranks, c = u / from.num_ranks;
    return s == from.self ||
           wait_progress(from, s, c,
                         chunk_begin(a.num_tokens, a.chunks, c + 1) - chunk_begin(a.num_tokens, a.chunks, c)) >= 0;
  });
}

// Where a copy waits for the rows' tables of the units it reads (scan_routing_run's items_wait): the launch's placed
// words, [R sources][units] of unit_tokens tokens each, stamped with its epoch; null words where every unit was
// placed before the copies began.
struct PlacedUnits {
  const uint64_t* words;
  uint64_t epoch;
  int units, unit_tokens;

  // Units [first, last] of source s; false once the op is given up or a block of the launch never ran (reported).
  __device__ bool wait(int s, int first, int last, const ReceiveFrom& from) const {
    for (int x = first; x <= last; ++x)
      if (!wait_word_handed_over(words + s * units + x, epoch, from)) return false;
    return true;
  }
  // The units that wrote the rows of source s's tokens [t0, t1) and where its rows from t1 on start.
  __device__ bool wait_tokens(int s, int t0, int t1, int num_tokens, const ReceiveFrom& from) const {
    return !words || wait(s, t0 / unit_tokens, min(t1, num_tokens - 1) / unit_tokens, from);
  }
  // Every unit (by one thread).
  __device__ bool wait_all(int sources, const ReceiveFrom& from) const {
    for (int s = 0; words && s < sources; ++s)
      if (!wait(s, 0, units - 1, from)) return false;
    return true;
  }
};

// Receive side of (cached) dispatch with bulk copies: the work items of dispatch_receive_kernel, taken in order from
// the launch's counter by kProducers threads (lane 0 of the first warps), each with its own stages, so one's wait for a
// member or for the next item's bounds leaves the others' copies in flight (and a producer whose items were our own
// rows, there at once, goes on to members' rows instead of idling). A member's rows move once the chunk's progress
// covers the item. An item's rows land on consecutive output rows; where they are contiguous in the source too (every
// token of the item comes to us: the messages have token slots) they move (x, then scales) in stage-sized pieces, else
// as many whole rows a job as a stage holds, a load per run of consecutive tokens (a segment a job of larger rows). The
// other warps of receive block `block` (of `blocks`) localize the expert indices of its share of the kept rows and
// write its share of the padding past the kept count; a send block that `joined` once its sends were done only copies.
// With `placed` words, an item first waits for the units that placed its rows, and the other warps for every unit.
__device__ void dispatch_receive_bulk(const DispatchReceiveArgs& a, const BulkShape& b, const ItemCounter& items,
                                      int block, int blocks, bool joined, const PlacedUnits& placed = {}) {
  if (g_sides_apart && !a.pulled && !wait_every_chunk(a)) return;
  const KernelStamp stamp(KernelKind::kDispatchReceive);
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ char* part_dst[kMaxStages][2];
  __shared__ uint32_t part_bytes[kMaxStages][2];
  __shared__ int producer_tokens[kProducers][kPieceTokens];
  init_stage_barriers(full, b.stages);
  const ReceiveFrom& from = a.from;
  const int R = from.num_ranks, T = a.num_tokens;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  __shared__ int part_row[kMaxStages];     // pair slots: the job's first received row,
  __shared__ int part_rows[kMaxStages];    // its whole rows (1 for a segment)
  __shared__ int64_t part_at[kMaxStages];  // and where in the row its x bytes go
  const int64_t xrb = a.x_row_bytes, srb = a.recv_scales ? a.scale_row_bytes : 0;
  const bool pairs = a.pair_of != nullptr;  // each row to its pair slots, from a stage of rows (or a segment)
  if (warp < kProducers && lane == 0) {
    const int per = b.stages / kProducers, first_stage = warp * per;
    StageRing ring{smem + b.tables_bytes + size_t(first_stage) * b.stage_bytes, b.stage_bytes, per, full + first_stage,
                   b.lag};
    int* item_tokens = producer_tokens[warp];
    const int all_items = pieces(T, a.chunks) * a.chunks * R;
    const int segs = int((xrb + b.segment_bytes - 1) / b.segment_bytes);
    const int rows_per_job = segs == 1 ? int(b.stage_bytes / (xrb + srb)) : 1;  // of an item's rows
    // The stream's position: item, its source s and rows [o0, o1); then, where they are contiguous in the source's
    // message (from token t0's row on), a byte position in its x rows (phase 1) and scale rows (2), else a row and
    // segment of the item (3); 0: the next item.
    int item = 0, s = 0, o0 = 0, o1 = 0, t0 = 0, phase = 0, row = 0;
    int seg = 0;
    int64_t at = 0;
    run_bulk_jobs(
        ring,
        [&](int j, char* stage, uint64_t* bar) -> int64_t {
          const int st = first_stage + j % ring.stages;
          for (;;) {
            if (phase == 0) {  // the launch's next item that no producer has taken
              item = items.take();
              if (item >= all_items) return kNoMoreJobs;
              s = item % R;
              const int c = item / R % a.chunks;
              const int c0 = chunk_begin(T, a.chunks, c), c1 = chunk_begin(T, a.chunks, c + 1);
              t0 = c0 + item / (R * a.chunks) * kPieceTokens;
              const int t1 = min(c1, t0 + kPieceTokens);
              if (t0 >= t1) continue;
              if (!placed.wait_tokens(s, t0, t1, T, from)) return kNoMoreJobs;
              // Rows past the capacity are dropped: min(row, capacity) is min(row, rows kept), as no row passes
              // the total, and the capacity needs no unit's count.
              const int32_t* before = a.row_before + int64_t(s) * (T + 1);
              o0 = min(before[t0], a.capacity);
              o1 = min(before[t1], a.capacity);
              if (o0 >= o1) continue;
              if (s != from.self && !a.pulled && wait_progress(from, s, c, t1 - c0) < 0) continue;
              // Rows at their tokens' rows (token slots) are contiguous where every token of the item comes to us
              // (and is kept).
              if (o1 - o0 == t1 - t0 && !pairs) {
                phase = 1;
                at = 0;
              } else {
                // Every token loaded before any is stored: item_tokens may alias row_map as far as the compiler
                // knows, so a load a store would wait an L2 round trip each.
                int tokens[kPieceTokens];
#pragma unroll
                for (int i = 0; i < kPieceTokens; ++i) tokens[i] = i < o1 - o0 ? a.row_map[o0 + i].y : 0;
#pragma unroll
                for (int i = 0; i < kPieceTokens; ++i)
                  if (i < o1 - o0) item_tokens[i] = tokens[i];
                phase = 3;
                row = seg = 0;
              }
            }
            if (phase == 1 || phase == 2) {
              const int64_t rb = phase == 1 ? xrb : srb, total = int64_t(o1 - o0) * rb;
              if (at >= total) {
                phase = phase == 1 && srb ? 2 : 0;
                at = 0;
                continue;
              }
              const uint32_t bytes = uint32_t(min(int64_t(b.stage_bytes), total - at));
              const int64_t from_row = int64_t(t0) * rb, to_row = int64_t(o0) * rb;
              const char* src = (phase == 1 ? a.src.x[s] : a.src.scales[s]) + from_row + at;
              part_dst[st][0] = (phase == 1 ? a.recv_x : a.recv_scales) + to_row + at;
              part_bytes[st][0] = bytes;
              part_bytes[st][1] = 0;
              barrier_arrive_expect(bar, bytes);
              bulk_load(stage, src, bytes, bar);
              at += bytes;
              return bytes;
            }
            // Rows at their tokens' rows, with gaps, which land on consecutive output rows: rows that fit a stage
            // whole go as many a job as the stage holds (a load per run of consecutive tokens into [x rows][scale
            // rows], one store of each part); a larger row goes by segments, `seg` of row o0 + row, the scales with
            // the last segment.
            if (row >= o1 - o0) {
              phase = 0;
              continue;
            }
            if (rows_per_job > 1) {
              const int n = min(rows_per_job, o1 - o0 - row), o = o0 + row;
              part_dst[st][0] = a.recv_x + int64_t(o) * xrb;
              part_bytes[st][0] = uint32_t(n * xrb);
              part_dst[st][1] = srb ? a.recv_scales + int64_t(o) * srb : nullptr;
              part_bytes[st][1] = uint32_t(n * srb);
              part_row[st] = o;
              part_rows[st] = n;
              part_at[st] = 0;
              const uint32_t bytes = uint32_t(n * (xrb + srb));
              barrier_arrive_expect(bar, bytes);
              for (int r = 0, run = 1; r < n; r += run) {
                const int t = item_tokens[row + r];
                for (run = 1; r + run < n && item_tokens[row + r + run] == t + run;) ++run;
                bulk_load(stage + r * xrb, a.src.x[s] + int64_t(t) * xrb, uint32_t(run * xrb), bar);
                if (srb)
                  bulk_load(stage + n * xrb + r * srb, a.src.scales[s] + int64_t(t) * srb, uint32_t(run * srb), bar);
              }
              row += n;
              return bytes;
            }
            const int t = item_tokens[row], o = o0 + row;
            const int64_t offset_in_row = int64_t(seg) * b.segment_bytes;
            const uint32_t x_bytes = uint32_t(min(int64_t(b.segment_bytes), xrb - offset_in_row));
            const bool with_scales = srb && seg == segs - 1;
            part_dst[st][0] = a.recv_x + int64_t(o) * xrb + offset_in_row;
            part_bytes[st][0] = x_bytes;
            part_row[st] = o;
            part_rows[st] = 1;
            part_at[st] = offset_in_row;
            part_dst[st][1] = with_scales ? a.recv_scales + int64_t(o) * srb : nullptr;
            part_bytes[st][1] = with_scales ? uint32_t(srb) : 0;
            const uint32_t bytes = x_bytes + part_bytes[st][1];
            barrier_arrive_expect(bar, bytes);
            bulk_load(stage, a.src.x[s] + int64_t(t) * xrb + offset_in_row, x_bytes, bar);
            if (with_scales) bulk_load(stage + x_bytes, a.src.scales[s] + int64_t(t) * srb, uint32_t(srb), bar);
            if (++seg == segs) {
              seg = 0;
              ++row;
            }
            return bytes;
          }
        },
        [&](int j, char* stage) {
          const int st = first_stage + j % ring.stages;
          if (!pairs) {
            bulk_store(part_dst[st][0], stage, part_bytes[st][0]);
            if (part_bytes[st][1]) bulk_store(part_dst[st][1], stage + part_bytes[st][0], part_bytes[st][1]);
            return;
          }
          // The stage holds n rows' x parts, then their scale rows: a store of each part to each of its row's slots.
          // The slots of up to kSlotRows rows x kSlotsAtOnce are loaded before any store is issued: each store's
          // asm orders the loads after it, and one load at a time cost an L2 round trip per slot.
          constexpr int kSlotRows = 4, kSlotsAtOnce = 8;
          const int n = part_rows[st], K = a.topk;
          const uint32_t x_bytes = part_bytes[st][0] / uint32_t(n), s_bytes = part_bytes[st][1] / uint32_t(n);
          for (int r0 = 0; r0 < n; r0 += kSlotRows)
            for (int k0 = 0; k0 < K; k0 += kSlotsAtOnce) {
              int32_t slot[kSlotRows][kSlotsAtOnce];
#pragma unroll
              for (int i = 0; i < kSlotRows; ++i)
#pragma unroll
                for (int q = 0; q < kSlotsAtOnce; ++q)
                  slot[i][q] = r0 + i < n && k0 + q < K ? a.pair_of[int64_t(part_row[st] + r0 + i) * K + k0 + q]
                                                        : a.pair_capacity;
#pragma unroll
              for (int i = 0; i < kSlotRows; ++i)
#pragma unroll
                for (int q = 0; q < kSlotsAtOnce; ++q) {
                  if (slot[i][q] >= a.pair_capacity) continue;
                  const int64_t at = slot[i][q], r = r0 + i;
                  bulk_store(a.recv_x + at * xrb + part_at[st], stage + r * x_bytes, x_bytes);
                  if (s_bytes) bulk_store(a.recv_scales + at * srb, stage + n * x_bytes + r * s_bytes, s_bytes);
                }
            }
        },
        [](int) {});
    return;
  }
  if (warp < kProducers || joined || pairs) return;  // pairs: lay_out_pairs wrote the rest
  // The other warps: the kept rows' expert indices (and weights), localized, a row per thread; then the padding.
  const int helper_warps = warps - kProducers;
  const int helpers = helper_warps * kWarp, helper = (warp - kProducers) * kWarp + lane;
  if (placed.words) {  // the tables are whole once every unit is placed
    __shared__ bool whole;
    if (helper == 0) {
      whole = placed.wait_all(R, from);
      __threadfence();
    }
    group_barrier(helpers);
    if (!whole) return;
  }
  const int kept = *a.num_kept;
  const int local_experts = a.topk_mode ? a.num_experts / R : 0, first = from.self * local_experts;
  for (int o = block * helpers + helper; a.topk_mode && o < kept; o += blocks * helpers) {
    const int2 st = a.row_map[o];
    localize_row(a, o, st.x, st.y, first, local_experts);
  }
  for (int o = kept + block * helper_warps + warp - kProducers; o < a.capacity; o += blocks * helper_warps)
    pad_row(a, o, lane);
}

// Send side of combine with bulk copies: the rows of chunk c to each member are contiguous in y and in its region, so
// they move in stage-sized pieces, members taken in turn (job j: piece j / M of member j % M), dealt out over
// kProducers threads (job j to producer j % kProducers), each with its own stages. Each publishes its frontier (the
// next job of its own it has not completed), and the first thread past them announces to each member what the least
// frontier covers. Rows past y's capacity (dropped by the dispatch) go back as zeros, written by the block before the
// pieces move.
__device__ void combine_send_bulk(const CombineSendArgs& a, const BulkShape& b, int block, int blocks) {
  const KernelStamp stamp(KernelKind::kCombineSend);
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ int frontier[kProducers];
  const SendTo& to = a.to;
  const int R = to.num_ranks;
  check_combine_capacity(a, block);
  init_stage_barriers(full, b.stages);
  if (!wait_acks(to)) return;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const bool producer = lane == 0 && warp < kProducers;
  const int per = b.stages / kProducers;
  StageRing ring{smem + b.tables_bytes + size_t(warp * per) * b.stage_bytes, b.stage_bytes, per, full + warp * per,
                 b.lag};
  int offsets[kMaxRanks];
  for (int s = 0, o = 0; s < R; o += a.recv_counts[s], ++s) offsets[s] = o;
  const int64_t rb = a.row_bytes;
  for (int c = block; c < a.chunks; c += blocks) {
    // Member s's rows [j0, j1) of this chunk; those at or past y's capacity from `kept` on.
    int j0[kMaxRanks], j1[kMaxRanks], kept[kMaxRanks], pieces[kMaxRanks], members[kMaxRanks];
    int M = 0, most = 0;
    for (int s = 0; s < R; ++s) {
      if (s == to.self) continue;
      j0[M] = chunk_begin(a.recv_counts[s], a.chunks, c);
      j1[M] = chunk_begin(a.recv_counts[s], a.chunks, c + 1);
      kept[M] = max(j0[M], min(j1[M], a.capacity - offsets[s]));
      for (int j = kept[M] + warp; j < j1[M]; j += warps) warp_zero(to.region[s] + int64_t(j) * rb, rb, lane);
      pieces[M] = int((int64_t(kept[M] - j0[M]) * rb + b.stage_bytes - 1) / b.stage_bytes);
      most = max(most, pieces[M]);
      members[M++] = s;
    }
    const int jobs = most * M;
    if (threadIdx.x < kProducers) frontier[threadIdx.x] = min(int(threadIdx.x), jobs);
    block_sync();  // the zeros are written before the producers' announcements (the barrier, then releases)
    if (producer && M > 0) {
      // The producer's job i is job warp + i * kProducers.
      const auto piece = [&](int j, int m, int64_t& at, uint32_t& bytes) {
        const int64_t begin = int64_t(j0[m]) * rb, end = int64_t(kept[m]) * rb;
        at = begin + int64_t(j / M) * b.stage_bytes;
        bytes = uint32_t(min(int64_t(b.stage_bytes), end - at));
      };
      run_bulk_jobs(
          ring,
          [&](int i, char* stage, uint64_t* bar) -> int64_t {
            const int j = warp + i * kProducers;
            if (j >= jobs) return kNoMoreJobs;
            const int m = j % M;
            if (j / M >= pieces[m]) return 0;
            int64_t at;
            uint32_t bytes;
            piece(j, m, at, bytes);
            barrier_arrive_expect(bar, bytes);
            bulk_load(stage, a.y + int64_t(offsets[members[m]]) * rb + at, bytes, bar);
            return bytes;
          },
          [&](int i, char* stage) {
            const int j = warp + i * kProducers;
            const int m = j % M;
            int64_t at;
            uint32_t bytes;
            piece(j, m, at, bytes);
            bulk_store(to.region[members[m]] + at, stage, bytes);
          },
          [&](int k) {
            // This producer's first k jobs have landed: its frontier is its next job (or the chunk's end).
            publish_frontier(frontier, warp, min(jobs, warp + k * kProducers));
          });
    } else if (threadIdx.x == kProducers * kWarp && M > 0) {
      // From -1: a chunk whose rows were all dropped (no jobs) is still announced, as zeros.
      announce_frontiers(frontier, kProducers, jobs, -1, [&](int least) {
        if (to.one_fence) fence_acq_rel_sys();
        for (int m = 0; m < M; ++m) {
          const int done_pieces = least > m ? (least - m + M - 1) / M : 0;
          const int rows_done =
              done_pieces >= pieces[m] ? j1[m] - j0[m] : int(int64_t(done_pieces) * b.stage_bytes / rb);
          announce_max(to, to.chunks[members[m]] + c, progress(to.message[members[m]], rows_done));
        }
      });
    }
    announce_meta(to);  // keeps the meta count at `chunks` a message (combine has no routing to send)
  }
}

// Where a pull combine reads each member's rows of ours: its combine input (y, addressable here), the first of them
// and how many rows it holds (the dispatch's capacity: rows past it were dropped and count as absent).
struct PullSources {
  const char* y[kMaxRanks];
  int first[kMaxRanks], rows[kMaxRanks];
};

// Receive side of combine with bulk copies: every warp of the block works alone through its own `per` stages. It takes
// the launch's work items (pieces of kCombinePieceTokens tokens of a chunk, in the order of combine_receive_kernel) one
// at a time from its counter, waits for the item's rows and lists where each token's copies are; then per
// (token, segment of at most segment_bytes) its lanes load every copy of the segment into a stage (a slot per copy).
// Once a stage's loads land the warp sums them in float32 from shared memory, writes the sum and refills the stage
// with its next job, so the loads of its other stages stay in flight while it adds. With `pull` the copies are read
// where the members keep them (they are all there already: nothing to wait for) rather than from our buffer.
constexpr int kCombinePieceTokens = 4;
struct CombineJob {
  int token, rows;
  uint32_t offset, bytes;
};
template <typename T>
__device__ void combine_receive_bulk(const CombineReceiveArgs& a, const BulkShape& b, const ItemCounter& items,
                                     const PullSources* pull = nullptr) {
  const KernelStamp stamp(KernelKind::kCombineReceive);
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t full[kMaxStages];
  __shared__ CombineJob job_of[kMaxStages];
  // Per warp, its item's copies: [token][member] the row in the member's message (ours: in y), or -1.
  __shared__ int listed[kTransferWarps][kCombinePieceTokens][kMaxRanks];
  const ReceiveFrom& from = a.from;
  const int R = from.num_ranks, T_ = a.num_tokens, per = b.stages / kTransferWarps;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (threadIdx.x == 0) {
    for (int s = 0; s < b.stages; ++s) barrier_init(full + s, 1);
    fence_barrier_init();
  }
  block_sync();
  int own_offset = 0;
  for (int q = 0; q < from.self; ++q) own_offset += a.recv_counts[q];
  const int64_t rb = a.row_bytes;
  const int segs = int((rb + b.segment_bytes - 1) / b.segment_bytes);
  const int all_items = pieces(T_, a.chunks, kCombinePieceTokens) * a.chunks;
  int (*table)[kMaxRanks] = listed[warp];
  const char* source = lane >= R ? nullptr
                       : pull    ? pull->y[lane]
                                 : (lane == from.self ? a.y : from.region[lane]);  // lane d's member
  // The issuing side's place: tokens [t0, t1) of the current item, token t0 + i, segment g.
  int t0 = 0, t1 = 0, i = 0, g = 0;
  const auto next_job = [&](int st) -> bool {
    while (i >= t1 - t0) {  // the launch's next item that no warp has taken
      int k = 0;
      if (lane == 0) k = items.take();
      const int item = __shfl_sync(0xffffffffu, k, 0);
      if (item >= all_items) return false;
      const int c = item % a.chunks;
      t0 = chunk_begin(T_, a.chunks, c) + item / a.chunks * kCombinePieceTokens;
      t1 = min(chunk_begin(T_, a.chunks, c + 1), t0 + kCombinePieceTokens);
      i = g = 0;
      if (t0 >= t1) continue;
      bool ok = true;
      for (int p = lane; p < (pull ? 0 : R * a.chunks); p += kWarp) {
        const int d = p / a.chunks, cc = p % a.chunks;
        const int lo = a.excl[t0 * R + d], hi = a.excl[t1 * R + d], n = a.excl[T_ * R + d];
        const int c0 = chunk_begin(n, a.chunks, cc), c1 = chunk_begin(n, a.chunks, cc + 1);
        if (d != from.self && lo < hi && c0 < c1 && c0 < hi && c1 > lo &&
            wait_progress(from, d, cc, min(hi, c1) - c0) < 0)
          ok = false;
      }
      if (!__all_sync(0xffffffffu, ok)) {  // reported; the item's tokens stay unwritten
        t1 = t0;
        continue;
      }
      for (int p = lane; p < (t1 - t0) * R; p += kWarp) {
        const int q = p / R, d = p % R, t = t0 + q;
        int row = -1;
        if (a.mask[t * R + d]) {
          const int j = a.excl[t * R + d];
          if (pull)
            row = pull->first[d] + j < pull->rows[d] ? pull->first[d] + j : -1;  // else: dropped by the dispatch
          else if (d != from.self)
            row = j;
          else if (own_offset + j < a.capacity)
            row = own_offset + j;  // else: dropped by the dispatch
        }
        table[q][d] = row;
      }
      __syncwarp();
    }
    const int row = lane < R ? table[i][lane] : -1;
    const unsigned present = __ballot_sync(0xffffffffu, row >= 0);
    const uint32_t offset = uint32_t(g) * b.segment_bytes;
    const uint32_t bytes = uint32_t(min(int64_t(b.segment_bytes), rb - offset));
    if (lane == 0) {
      job_of[st] = CombineJob{t0 + i, __popc(present), offset, bytes};
      barrier_arrive_expect(full + st, uint32_t(__popc(present)) * bytes);
    }
    __syncwarp();
    if (row >= 0)
      bulk_load(smem + b.tables_bytes + size_t(st) * b.stage_bytes +
                    size_t(__popc(present & ((1u << lane) - 1))) * b.segment_bytes,
                source + int64_t(row) * rb + offset, bytes, full + st);
    if (++g == segs) {
      g = 0;
      ++i;
    }
    return true;
  };
  int issued = 0;
  while (issued < per && next_job(warp * per + issued)) ++issued;
  for (int k = 0; k < issued; ++k) {
    const int st = warp * per + k % per;
    barrier_wait(full + st, uint32_t(k / per) & 1u);
    const CombineJob job = job_of[st];
    int4* dst = reinterpret_cast<int4*>(a.out + int64_t(job.token) * rb + job.offset);
    const uint32_t slots = shared_address(smem + b.tables_bytes + size_t(st) * b.stage_bytes);
    const auto from_stage = [&](int j, int64_t v) {
      int4 x;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                   : "r"(slots + uint32_t(j) * b.segment_bytes + uint32_t(v) * 16u));
      return x;
    };
    const int64_t vectors = job.bytes / 16;
    for (int64_t v = lane; v < vectors; v += kUnroll * kWarp) sum_vectors<T>(dst, job.rows, v, vectors, from_stage);
    // Our reads of the stage come before the next bulk load into it (another proxy).
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (next_job(st)) ++issued;
  }
}

void check_fits(const NvlDevice& dev, size_t message, const char* op) {
  if (message > dev.region_bytes())
    throw std::invalid_argument(
        std::string("uccl_ep ") + op + ": a message of this shape needs " + std::to_string(message) +
        " bytes per peer but the NVLink buffer holds " + std::to_string(dev.region_bytes()) +
        "; initialize with buffer_bytes >= " + std::to_string(nvl_buffer_bytes_for(dev.num_ranks(), message)) +
        " (jax_uccl_ep.nvl_buffer_bytes gives it for your shapes)");
}

// Our reads and writes of shared memory come before bulk loads into it (another proxy).
__device__ __forceinline__ void fence_shared_for_bulk() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// What an acquire made visible to this thread in global memory (a member's inputs, once its pull words came) is
// visible to the bulk loads (another proxy) it issues next.
__device__ __forceinline__ void fence_global_for_bulk() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// An op on the NVLink buffers runs as one launch on XLA's stream: blocks [0, chunks) send, the rest receive. So
// nothing hops between streams, and no launch waits for another's between the routing's arrival and the copies.
// The receive blocks first build the tables their copies read (dispatch: the routing scan over every member's
// routing; combine: our tokens' positions in the members' messages), in units they hand over to each other.
struct DispatchLaunch {
  DispatchSendArgs send;
  ScanArgs scan;
  DispatchReceiveArgs receive;
  BulkShape send_shape, receive_shape;  // with bulk copies
  FlagWaits routing;                    // every member's routing has landed
  Handoff handoff;  // words: as kItemWord etc., then [2 passes][units * R], then the pair layout's [2][pairs.units]
  Acks acks;
  int run;           // the scan's tokens per thread: 1, 2, 4 or kMaxScanRun (scan_run)
  int units;         // scan units per source, of kTransferThreads * run tokens
  PairLayout pairs;  // dispatch(layout="expert") with bulk copies: out.pair_of set, the receive writes the pairs

  __device__ uint64_t* counted() const { return handoff.words + kFirstHandedOverWord; }
  __device__ int scan_units() const { return units * scan.num_ranks; }
  __device__ uint64_t* placed() const { return counted() + scan_units(); }
  __device__ uint64_t* pairs_counted() const { return placed() + scan_units(); }
  __device__ uint64_t* pairs_placed() const { return pairs_counted() + pairs.units; }
};

// Both scan passes of the receive blocks over the units u = block, block + blocks, ... of every source (`units` a
// source, kRun tokens per thread), each unit handed over once done: counted, then placed (`counted`, `placed`:
// [units * R] words of the launch's handoff); false (to the whole block) once the op is given up. A unit places its
// rows once the units before it are counted (not every unit), and the block with the last unit writes the totals.
// With `items_wait` the block goes on to the copies without waiting for the other units' placing: each copy item
// waits for the units it reads (PlacedUnits). A block keeps its first unit's routing bits from one pass to the next,
// so where the units are no more than the blocks (scan_run) placing reads no routing again.
template <int kRun>
__device__ bool scan_routing_run(const ScanArgs& scan, int units, const Handoff& h, uint64_t* counted, uint64_t* placed,
                                 const ItemCounter& items, int block, int blocks, const Members& m, bool items_wait) {
  const int all = units * scan.num_ranks;
  const KernelStamp stamp(KernelKind::kScan);
  unsigned first_takes = 0;
  {
    const KernelStamp counting(KernelKind::kScanCounting);
    for (int u = block; u < all; u += blocks) {
      const unsigned takes = count_unit<kRun>(scan, u % units, u / units, units);
      if (u == block) first_takes = takes;
    }
  }
  if (block == 0 && threadIdx.x == 0) items.reset();  // before the copies' first take (after unit 0's count)
  hand_over(h, counted, block, blocks, all);
  // A block without a unit waits for every count (its copies take items once the counter is reset).
  if (block >= all && !wait_handed_over(h, counted, all, m)) return false;
  {
    const KernelStamp placing(KernelKind::kScanPlacing);
    for (int u = block; u < all; u += blocks) {
      const int x = u % units, s = u / units;
      {
        const KernelStamp counted_stamp(KernelKind::kScanCounted);
        if (!wait_handed_over(h, counted, u, m)) return false;  // the units before u
      }
      place_unit<kRun>(scan, x, s, units, u == block ? first_takes : unit_takes<kRun>(scan, x, s), false);
    }
    if (block == (all - 1) % blocks && threadIdx.x == 0)  // every unit counted: the units before the last, and it
      for (int s = 0; s < scan.num_ranks; ++s) source_totals(scan, s, units);
  }
  hand_over(h, placed, block, blocks, all);
  if (!items_wait && !wait_handed_over(h, placed, all, m)) return false;
  fence_shared_for_bulk();
  return true;
}
__device__ bool scan_routing(const ScanArgs& scan, int run, int units, const Handoff& h, uint64_t* counted,
                             uint64_t* placed, const ItemCounter& items, int block, int blocks, const Members& m,
                             bool items_wait) {
  switch (run) {
    case 1:
      return scan_routing_run<1>(scan, units, h, counted, placed, items, block, blocks, m, items_wait);
    case 2:
      return scan_routing_run<2>(scan, units, h, counted, placed, items, block, blocks, m, items_wait);
    case 4:
      return scan_routing_run<4>(scan, units, h, counted, placed, items, block, blocks, m, items_wait);
    default:
      return scan_routing_run<kMaxScanRun>(scan, units, h, counted, placed, items, block, blocks, m, items_wait);
  }
}

// dispatch(layout="expert"): pair_layout.cuh's two passes, every receive block taking units, each pass's units handed
// over before the next reads them; the tables in the dynamic shared memory the stages take later. False (to the
// whole block) once the op is given up.
__device__ bool lay_out_pairs(const PairLayout& p, const ScanArgs& scan, const Handoff& h, uint64_t* counted,
                              uint64_t* placed, int block, int blocks, const Members& m) {
  extern __shared__ __align__(128) char smem[];
  const PairTables t = pair_tables(smem, p.groups);
  for (int v = block; v < p.units; v += blocks) count_unit_pairs(p, scan, t, v);
  hand_over(h, counted, block, blocks, p.units);
  if (!wait_handed_over(h, counted, p.units, m)) return false;
  pair_offsets(p, t, block == 0);
  for (int v = block; v < p.units; v += blocks) place_unit_pairs(p, scan, t, v);
  mark_pairs_outside(p, t, block, blocks);
  // The handover orders the units' slots before any copy reads pair_of; the padding's writes (which nothing in
  // the launch reads) are ordered by the launch's end.
  hand_over(h, placed, block, blocks, p.units);
  if (!wait_handed_over(h, placed, p.units, m)) return false;
  fence_shared_for_bulk();  // the stages' bytes were written here; bulk copies write them next
  return true;
}

// The receive blocks' tables, before any row moves: the routing scan (over `scan`: the launch's, or with the
// members' inputs as sources where it pulls), then where the receive writes the pairs their layout. False (to the
// whole block) once the op is given up.
__device__ bool lay_out_receive(const DispatchLaunch& d, const ScanArgs& scan, const ItemCounter& items, int block,
                                int blocks, bool items_wait) {
  const Members& m = d.receive.from;
  if (!scan_routing(scan, d.run, d.units, d.handoff, d.counted(), d.placed(), items, block, blocks, m, items_wait))
    return false;
  return !d.pairs.out.pair_of ||
         lay_out_pairs(d.pairs, scan, d.handoff, d.pairs_counted(), d.pairs_placed(), block, blocks, m);
}
// The copies' waits for the units' placing where they wait item by item (bulk copies without the pair layout, whose
// passes read every unit's rows).
__device__ PlacedUnits placed_units(const DispatchLaunch& d, bool items_wait) {
  return items_wait ? PlacedUnits{d.placed(), d.handoff.epoch, d.units, kTransferThreads * d.run} : PlacedUnits{};
}
// A send block that joins the copies once its sends are done: until the receive blocks' last pass is handed over.
__device__ bool wait_laid_out(const DispatchLaunch& d) {
  const Members& m = d.receive.from;
  return d.pairs.out.pair_of ? wait_handed_over(d.handoff, d.pairs_placed(), d.pairs.units, m)
                             : wait_handed_over(d.handoff, d.placed(), d.scan_units(), m);
}

// (Cached) dispatch: the send blocks as dispatch_send(_bulk); each receive block waits for every member's routing,
// counts the rows of its scan units, places them once the units before them are counted, and copies (with bulk copies
// an item once the units it reads are placed, else once every unit is). With bulk copies a send block whose sends are
// done joins the copies (the items come from one counter of the launch), so that neither side idles while the other
// still works.
template <bool kBulk>
__device__ void dispatch_blocks(const DispatchLaunch& f) {
  const int send_blocks = f.send.chunks;
  const Members& m = f.receive.from;
  const ItemCounter items{f.handoff.words + kItemWord};
  if (int(blockIdx.x) < send_blocks) {
    if constexpr (kBulk) {
      dispatch_send_bulk(f.send, f.send_shape, blockIdx.x, send_blocks);
      block_sync();  // every stage has been read (the rings end with their stores complete)
      fence_shared_for_bulk();
      if (wait_laid_out(f)) dispatch_receive_bulk(f.receive, f.receive_shape, items, 0, 1, /*joined=*/true);
    } else {
      dispatch_send(f.send, blockIdx.x, send_blocks);
    }
    return;
  }
  const int block = int(blockIdx.x) - send_blocks, blocks = int(gridDim.x) - send_blocks;
  const bool items_wait = kBulk && !f.pairs.out.pair_of;
  {
    {
      const KernelStamp stamp(KernelKind::kRouting);
      // A member whose routing never came is reported; the scan still runs (over what its region holds: every read
      // and write stays in bounds), so that every unit is handed over and no block waits for another in vain.
      wait_all(f.routing, m.timeout_ns, m.err, m.rank);
    }
    if (!lay_out_receive(f, f.scan, items, block, blocks, items_wait)) return;
  }
  if constexpr (kBulk)
    dispatch_receive_bulk(f.receive, f.receive_shape, items, block, blocks, /*joined=*/false,
                          placed_units(f, items_wait));
  else
    dispatch_receive(f.receive, block, blocks);
}
// Every thread of every block must come back from the body to the acknowledgements (no exit or trap on the way):
// a block that never counts itself withholds them, and the members wait for them until their deadline.
template <bool kBulk>
__global__ void __launch_bounds__(kTransferThreads, 1) dispatch_kernel(DispatchLaunch f) {
  dispatch_blocks<kBulk>(f);
  acknowledge_when_last(f.handoff, f.acks);
}

struct CombineLaunch {
  CombineSendArgs send;
  CombineReceiveArgs receive;
  BulkShape send_shape, receive_shape;  // with bulk copies
  Handoff handoff;                      // words: as kItemWord etc., then the positions'
  Acks acks;
};

// Combine's positions in a launch's receive blocks (block of blocks): blocks below the member count each lay out
// members block, block + blocks, ... and hand them over; the reductions wait for every member's word.
__device__ void lay_out_positions(const CombineReceiveArgs& a, const Handoff& h, uint64_t* positioned,
                                  const ItemCounter& items, int block, int blocks) {
  const int members = a.from.num_ranks;
  block_positions(a.mask, a.num_tokens, members, block, blocks, a.excl);
  if (block == 0 && threadIdx.x == 0) items.reset();  // before the reductions' first take (they wait for all)
  hand_over(h, positioned, block, blocks, members);
}

// Combine: the send blocks as combine_send(_bulk); the first receive blocks lay out our tokens' positions in the
// members' messages (block_positions, a member each) while the others wait for them, then every receive block
// reduces, and with bulk copies every send block too once its sends are done (the items come from one counter of the
// launch).
template <typename T, bool kBulk>
__device__ void combine_blocks(const CombineLaunch& f) {
  const int send_blocks = f.send.chunks;
  const CombineReceiveArgs& a = f.receive;
  const ItemCounter items{f.handoff.words + kItemWord};
  uint64_t* positioned = f.handoff.words + kFirstHandedOverWord;
  if (int(blockIdx.x) < send_blocks) {
    if constexpr (kBulk) {
      combine_send_bulk(f.send, f.send_shape, blockIdx.x, send_blocks);
      block_sync();  // every stage has been read (the rings end with their stores complete)
      fence_shared_for_bulk();
      if (wait_handed_over(f.handoff, positioned, a.from.num_ranks, a.from))
        combine_receive_bulk<T>(a, f.receive_shape, items);
    } else {
      combine_send(f.send, blockIdx.x, send_blocks);
    }
    return;
  }
  const int block = int(blockIdx.x) - send_blocks, blocks = int(gridDim.x) - send_blocks;
  {
    const KernelStamp stamp(KernelKind::kScan);
    if (block < a.from.num_ranks) lay_out_positions(a, f.handoff, positioned, items, block, blocks);
    if (!wait_handed_over(f.handoff, positioned, a.from.num_ranks, a.from)) return;
  }
  if constexpr (kBulk)
    combine_receive_bulk<T>(a, f.receive_shape, items);
  else
    combine_receive<T>(a, block, blocks);
}
// As dispatch_kernel: every thread comes back from the body to the acknowledgements.
template <typename T, bool kBulk>
__global__ void __launch_bounds__(kTransferThreads, 1) combine_kernel(CombineLaunch f) {
  combine_blocks<T, kBulk>(f);
  acknowledge_when_last(f.handoff, f.acks);
}

// A pulled op's end (the launch's last block, once it has acknowledged what it read): every member has finished
// reading our inputs (its acknowledgement of our message), so XLA may let them go once the launch ends.
__device__ void wait_members_read(const SendTo& to) {
  for (int s = 0; s < to.num_ranks; ++s)
    if (s != to.self &&
        !wait_flag(to.ack[s], to.message[s], -int64_t(to.message[s]), to.timeout_ns, to.err, to.rank, to.rank_of[s]))
      return;
}

// Member s's pull words for us, once its message's number is there; null (reported) once the member is late.
__device__ const volatile uint64_t* member_pull_words(const uint64_t* words, const ReceiveFrom& from, int s) {
  if (!wait_flag(words + NvlDevice::kPullMessageWord, from.message[s], int64_t(from.message[s]), from.timeout_ns,
                 from.err, from.rank, from.rank_of[s], Sleep::kBackoff))
    return nullptr;
  return words;
}

// (Cached) dispatch among GPUs of one process, by pulls: each member's routing and rows stay in its inputs (XLA's
// buffers, addressable here), and every block of the budget receives: it scans the members' routing where it is and
// copies their rows from there, so a row crosses NVLink once, loaded by the receiver; no member sends. A member
// tells us where its inputs are (its PullWords for us, the message's number last) and keeps them until we have
// read them (the acknowledgements, as pull_combine_kernel). Our own tokens' layout (the handle's token-in-rank mask)
// and the check of their expert indices, which a send side does, are spread over the blocks.
struct PullDispatchLaunch {
  DispatchLaunch d;  // its send: our inputs, message numbers, the members' meta and acknowledgement words
  uint64_t* words_to[kMaxRanks];
  const uint64_t* words_from[kMaxRanks];
};

// Where a pulled op's own words go out: the first of the launch's blocks that gets none of `parts` parts dealt one a
// block (part p to blocks p, p + blocks, ...), or block 0 where each gets one. The system fence before the words'
// stores holds the block that makes them, and every block waits for every part.
__device__ __forceinline__ int first_block_without_a_part(int parts, int blocks) { return blocks > parts ? parts : 0; }

// A pulled op's words for each member (write(s, w) fills member s's), then the message's number (which puts our
// inputs, written by earlier launches on this stream, and the words before it for the member's reads) and the meta
// count a sent op keeps: each a release of its own, or with `to.one_fence` every member's words, one system fence,
// then every number and count.
template <class Write>
__device__ void publish_pull_words(const SendTo& to, uint64_t* const (&words_to)[kMaxRanks], uint64_t chunks,
                                   const Write& write) {
  if (!to.one_fence) __threadfence_system();
  for (int s = 0; s < to.num_ranks; ++s) {
    if (s == to.self) continue;
    write(s, static_cast<volatile uint64_t*>(words_to[s]));
    if (to.one_fence) continue;
    store_release_sys(words_to[s] + NvlDevice::kPullMessageWord, to.message[s]);
    add_release_sys(to.meta[s], chunks);
  }
  if (!to.one_fence) return;
  __threadfence_system();
  for (int s = 0; s < to.num_ranks; ++s) {
    if (s == to.self) continue;
    store_relaxed_sys(words_to[s] + NvlDevice::kPullMessageWord, to.message[s]);
    add_relaxed_sys(to.meta[s], chunks);
  }
}

// One block's first thread, first: where our inputs are.
__device__ void publish_dispatch_words(const PullDispatchLaunch& f) {
  const Sources& own = f.d.scan.src;
  const int self = f.d.send.to.self;
  publish_pull_words(f.d.send.to, f.words_to, uint64_t(f.d.send.chunks), [&](int, volatile uint64_t* w) {
    w[0] = reinterpret_cast<uint64_t>(own.x[self]);
    w[1] = reinterpret_cast<uint64_t>(own.scales[self]);
    w[2] = f.d.scan.topk_mode ? reinterpret_cast<uint64_t>(own.topk_idx[self])
                              : reinterpret_cast<uint64_t>(own.mask[self]);
    w[3] = reinterpret_cast<uint64_t>(own.weights[self]);
  });
}

// Every block: every source's inputs (thread s waits for member s's words); false (to the whole block) once a member
// is late (reported).
__device__ bool read_dispatch_words(const PullDispatchLaunch& f, Sources& src) {
  const ReceiveFrom& from = f.d.receive.from;
  const bool ok = block_waits(from.num_ranks, [&](int s) {
    const Sources& own = f.d.scan.src;
    if (s == from.self) {
      src.x[s] = own.x[s];
      src.scales[s] = own.scales[s];
      src.topk_idx[s] = own.topk_idx[s];
      src.mask[s] = own.mask[s];
      src.weights[s] = own.weights[s];
      return true;
    }
    const volatile uint64_t* w = member_pull_words(f.words_from[s], from, s);
    if (!w) return false;
    src.x[s] = reinterpret_cast<const char*>(w[0]);
    src.scales[s] = reinterpret_cast<const char*>(w[1]);
    src.topk_idx[s] = f.d.scan.topk_mode ? reinterpret_cast<const int32_t*>(w[2]) : nullptr;
    src.mask[s] = f.d.scan.topk_mode ? nullptr : reinterpret_cast<const bool*>(w[2]);
    src.weights[s] = reinterpret_cast<const float*>(w[3]);
    return true;
  });
  fence_global_for_bulk();
  return ok;
}

// As dispatch_kernel: every thread comes back from the body to the acknowledgements.
__global__ void __launch_bounds__(kTransferThreads, 1) pull_dispatch_kernel(PullDispatchLaunch f) {
  // The launch's scan and receive arguments with the members' inputs as sources: one copy a block in shared memory
  // (a copy a thread would take ~1.2 KiB of stack each, which the context reserves for every thread of the GPU).
  __shared__ Sources src;
  __shared__ ScanArgs scan;
  __shared__ DispatchReceiveArgs receive;
  const DispatchLaunch& d = f.d;
  const int block = int(blockIdx.x), blocks = int(gridDim.x);
  const ItemCounter items{d.handoff.words + kItemWord};
  if (block == first_block_without_a_part(d.scan_units(), blocks) && threadIdx.x == 0) publish_dispatch_words(f);
  if (d.send.topk_idx)
    for (int t = block * int(blockDim.x) + int(threadIdx.x); t < d.send.num_tokens; t += blocks * int(blockDim.x))
      token_members(d.send, t, /*own=*/true);
  bool ok;
  {
    const KernelStamp stamp(KernelKind::kRouting);
    ok = read_dispatch_words(f, src);
  }
  if (ok) {
    if (threadIdx.x == 0) {
      scan = d.scan;
      scan.src = src;
      receive = d.receive;
      receive.src = src;
      receive.pulled = true;
    }
    block_sync();
    const bool items_wait = !d.pairs.out.pair_of;
    if (lay_out_receive(d, scan, items, block, blocks, items_wait))
      dispatch_receive_bulk(receive, d.receive_shape, items, block, blocks, /*joined=*/false,
                            placed_units(d, items_wait));
  }
  const KernelStamp stamp(KernelKind::kAcks);
  if (acknowledge_when_last(d.handoff, d.acks)) wait_members_read(d.send.to);  // before our inputs may go
}

// Combine among GPUs of one process, by pulls: each member's rows of ours stay in its y (XLA's buffer, addressable
// here), and every block of the budget reduces, reading the copies where they are; no member sends. A member tells
// us where its rows are (its PullWords for us, the message's number last) and may not let y go before we finished
// reading it, which the acknowledgements tell it: the launch's last block waits for every member's before the
// launch ends. The message numbers, the meta counts and the acknowledgements keep the pace of a sent combine, so
// either kind may follow.
struct PullCombineLaunch {
  CombineReceiveArgs receive;
  BulkShape receive_shape;
  CombineSendArgs send;           // its `to`: our message numbers, the members' meta words, our acknowledgement words
  uint64_t* words_to[kMaxRanks];  // the members' pull words for us
  const uint64_t* words_from[kMaxRanks];  // ours, written by the members
  Handoff handoff;                        // words: as kItemWord etc., then the positions'
  Acks acks;
};

// One block's first thread, first: where our rows of each member are in y.
__device__ void publish_combine_words(const PullCombineLaunch& f) {
  const CombineReceiveArgs& a = f.receive;
  check_combine_capacity(f.send, 0);
  int first[kMaxRanks];
  for (int s = 0, n = 0; s < f.send.to.num_ranks; n += a.recv_counts[s], ++s) first[s] = n;
  publish_pull_words(f.send.to, f.words_to, uint64_t(a.chunks), [&](int s, volatile uint64_t* w) {
    w[0] = reinterpret_cast<uint64_t>(a.y);
    w[1] = uint64_t(uint32_t(first[s])) | uint64_t(uint32_t(a.capacity)) << 32;
  });
}

// Every block: where each member's rows are (thread s waits for member s's words); false (to the whole block) once a
// member is late (reported).
__device__ bool read_pull_words(const PullCombineLaunch& f, PullSources& src) {
  const CombineReceiveArgs& a = f.receive;
  const ReceiveFrom& from = a.from;
  const bool ok = block_waits(from.num_ranks, [&](int s) {
    if (s == from.self) {
      int first = 0;
      for (int q = 0; q < s; ++q) first += a.recv_counts[q];
      src.y[s] = a.y;
      src.first[s] = first;
      src.rows[s] = a.capacity;
      return true;
    }
    const volatile uint64_t* w = member_pull_words(f.words_from[s], from, s);
    if (!w) return false;
    src.y[s] = reinterpret_cast<const char*>(w[0]);
    const uint64_t span = w[1];
    src.first[s] = int(uint32_t(span));
    src.rows[s] = int(uint32_t(span >> 32));
    return true;
  });
  fence_shared_for_bulk();
  fence_global_for_bulk();
  return ok;
}

template <typename T>
__global__ void __launch_bounds__(kTransferThreads, 1) pull_combine_kernel(PullCombineLaunch f) {
  __shared__ PullSources src;
  const CombineReceiveArgs& a = f.receive;
  const ItemCounter items{f.handoff.words + kItemWord};
  uint64_t* positioned = f.handoff.words + kFirstHandedOverWord;
  const int block = int(blockIdx.x), blocks = int(gridDim.x), members = a.from.num_ranks;
  if (block == first_block_without_a_part(members, blocks) && threadIdx.x == 0) publish_combine_words(f);
  if (block < members) {
    const KernelStamp stamp(KernelKind::kScan);
    lay_out_positions(a, f.handoff, positioned, items, block, blocks);
  }
  if (wait_handed_over(f.handoff, positioned, members, a.from) && read_pull_words(f, src))
    combine_receive_bulk<T>(a, f.receive_shape, items, &src);
  const KernelStamp stamp(KernelKind::kAcks);
  if (acknowledge_when_last(f.handoff, f.acks)) wait_members_read(f.send.to);  // before y may go
}

Members members(const NvlDevice& dev, const Group& g) {
  Members m{};
  m.num_ranks = g.size;
  m.self = g.self;
  m.rank = dev.rank();
  m.timeout_ns = timeout_ns();
  m.err = dev.errors_device();
  for (int s = 0; s < g.size; ++s) m.rank_of[s] = s == g.self ? dev.rank() : peer_of(dev, g, s);
  return m;
}

// One message to every other member (its number, and where it goes) and one from each.
SendTo send_to(NvlDevice& dev, const Group& g) {
  SendTo to{};
  static_cast<Members&>(to) = members(dev, g);
  for (int s = 0; s < g.size; ++s) {
    if (s == g.self) continue;
    const int p = to.rank_of[s];
    to.region[s] = dev.peer_in_region(p);
    to.meta[s] = dev.peer_meta_flag(p);
    to.chunks[s] = dev.peer_chunk_flags(p);
    to.ack[s] = dev.ack_flag(p);
    to.message[s] = ++dev.sent(p);
  }
  to.one_fence = announce_one_fence();
  return to;
}
ReceiveFrom receive_from(NvlDevice& dev, const Group& g) {
  ReceiveFrom from{};
  static_cast<Members&>(from) = members(dev, g);
  for (int s = 0; s < g.size; ++s) {
    if (s == g.self) continue;
    const int p = from.rank_of[s];
    from.region[s] = dev.in_region(p);
    from.chunks[s] = dev.chunk_flags(p);
    from.message[s] = ++dev.received(p);
  }
  return from;
}

// The words that tell every member we finished reading its message (the launch's last block writes them).
Acks acks_for(NvlDevice& dev, const Group& g, const ReceiveFrom& from, uint64_t* finished) {
  Acks a{};
  for (int s = 0; s < g.size; ++s)
    if (s != g.self) {
      a.flag[a.n] = dev.peer_ack_flag(from.rank_of[s]);
      a.value[a.n++] = from.message[s];
    }
  a.finished = finished;
  a.one_fence = announce_one_fence();
  return a;
}

// The fused scan's tokens per thread: the fewest (1, 2, 4 or kMaxScanRun) with which every source's units go to the
// receive blocks in one round, since a round is a few trips to a memory that the copies keep busy.
int scan_run(int num_tokens, int num_ranks, int blocks) {
  int run = 1;
  while (run < kMaxScanRun && num_ranks * scan_units(num_tokens, kTransferThreads * run) > blocks) run *= 2;
  return run;
}

// Bulk copies move 16-byte aligned runs of 16-byte multiples: rows that are not take the SM-store kernels.
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool bulk_dispatch(int64_t x_row_bytes, const void* x, const void* recv_x, int64_t scale_row_bytes, const void* scales,
                   const void* recv_scales) {
  return bulk_copies() && x_row_bytes % 16 == 0 && aligned16(x) && aligned16(recv_x) &&
         (!scales || (scale_row_bytes % 16 == 0 && aligned16(scales) && aligned16(recv_scales)));
}
bool bulk_dispatch(const DispatchSendArgs& s, const DispatchReceiveArgs& r) {
  return bulk_dispatch(s.x_row_bytes, s.x, r.recv_x, s.scale_row_bytes, s.scales, r.recv_scales);
}
bool bulk_combine(const CombineSendArgs& s, const CombineReceiveArgs& r) {
  return bulk_copies() && s.row_bytes % 16 == 0 && aligned16(s.y) && aligned16(r.out);
}

// An NVLink op's launch (see DispatchLaunch): the budget's blocks, one per SM, all resident at once.
bool g_allow_budget_past_the_gpu = false;  // testing.hpp
void check_budget_fits(const NvlDevice& dev, const char* op) {
  const int sms = dev.sm_count();
  if (num_sms() > sms && !g_allow_budget_past_the_gpu)
    throw std::invalid_argument(
        std::string("uccl_ep ") + op + ": the SM budget (UCCL_EP_NUM_SMS=" + std::to_string(num_sms()) +
        ") is more than this GPU's " + std::to_string(sms) +
        " SMs; its send and receive blocks run at once, one per SM: set UCCL_EP_NUM_SMS <= " + std::to_string(sms));
}
template <class Launch>
void launch_fused(void (*kernel)(Launch), const Launch& f, uint32_t shared_bytes, cudaStream_t stream,
                  const char* what) {
  kernel<<<num_sms(), kTransferThreads, shared_bytes, stream>>>(f);
  check(cudaGetLastError(), what);
}

// Every member's routing has landed: one announcement per chunk and message.
FlagWaits routing_waits(NvlDevice& dev, const Group& g, const ReceiveFrom& from) {
  FlagWaits w{};
  for (int s = 0; s < g.size; ++s)
    if (s != g.self) {
      const int p = from.rank_of[s];
      w.flag[w.n] = dev.meta_flag(p);
      w.value[w.n] = from.message[s] * uint64_t(send_blocks());
      w.peer[w.n++] = p;
    }
  return w;
}

// Grows the device's scratch to fit the op's (Scratch).
Scratch op_scratch(NvlDevice& dev, int capacity, int num_tokens) {
  dev.ensure_scratch(scratch_bytes(capacity, num_tokens));
  return scratch_at(dev.scratch(), capacity, num_tokens);
}
// The NVLink op: its one launch (its last block to finish acknowledges the messages it read).
void launch_dispatch(NvlDevice& dev, const Group& g, const DispatchKernels& k, bool pull, cudaStream_t stream,
                     const PairLayout* pairs = nullptr) {
  if (pairs && !pull && !bulk_dispatch(k.send, k.receive))
    throw std::logic_error("uccl_ep dispatch: the pair layout runs in the launches with bulk copies only");
  DispatchLaunch f{};
  f.send = k.send;
  f.scan = k.scan;
  f.receive = k.receive;
  f.routing = routing_waits(dev, g, k.receive.from);
  f.run = scan_run(k.scan.num_tokens, k.scan.num_ranks, pull ? num_sms() : receive_blocks());  // the blocks that scan
  f.units = scan_units(k.scan.num_tokens, kTransferThreads * f.run);
  const size_t scan_words = size_t(2) * f.units * k.scan.num_ranks + (pairs ? size_t(2) * pairs->units : 0);
  f.handoff = Handoff{dev.handoff_words(kFirstHandedOverWord + scan_words), dev.next_launch()};
  f.acks = acks_for(dev, g, k.receive.from, f.handoff.words + kFinishedWord);
  f.send.token_slots = f.receive.token_slots = true;
  f.receive_shape = piece_stages(k.receive.x_row_bytes, k.receive.recv_scales ? k.receive.scale_row_bytes : 0);
  // The pair layout's tables take the dynamic shared memory before the stages do.
  const uint32_t tables = pairs ? uint32_t(pair_tables_bytes(pairs->groups, k.scan.topk, kTransferThreads)) : 0;
  if (pairs) f.pairs = *pairs;
  uint32_t shared = 0;
  if (pull) {  // pulls() checked what bulk copies need
    PullDispatchLaunch p{};
    p.d = f;
    for (int s = 0; s < g.size; ++s)
      if (s != g.self) {
        const int peer = k.send.to.rank_of[s];
        p.words_to[s] = dev.peer_pull_words(peer);
        p.words_from[s] = dev.pull_words(peer);
      }
    launch_fused(pull_dispatch_kernel, p, std::max(f.receive_shape.shared_bytes(), tables), stream,
                 "pull_dispatch_kernel");
  } else if (bulk_dispatch(k.send, k.receive)) {
    f.send_shape = row_stages(k.send.x_row_bytes, kSendTablesBytes);
    shared = std::max({f.send_shape.shared_bytes(), f.receive_shape.shared_bytes(), tables});
    launch_fused(dispatch_kernel<true>, f, shared, stream, "dispatch_kernel");
  } else {
    launch_fused(dispatch_kernel<false>, f, shared, stream, "dispatch_kernel");
  }
}
void launch_combine(NvlDevice& dev, const Group& g, const CombineKernels& k, bool bf16, cudaStream_t stream) {
  CombineLaunch f{};
  f.send = k.send;
  f.receive = k.receive;
  f.handoff = Handoff{dev.handoff_words(kFirstHandedOverWord + kMaxRanks), dev.next_launch()};
  f.acks = acks_for(dev, g, k.receive.from, f.handoff.words + kFinishedWord);
  uint32_t shared = 0;
  if (bulk_combine(k.send, k.receive)) {
    f.send_shape = piece_stages(k.send.row_bytes, 0);
    f.receive_shape = combine_receive_stages(k.receive.row_bytes, k.receive.from.num_ranks, false, num_sms());
    shared = std::max(f.send_shape.shared_bytes(), f.receive_shape.shared_bytes());
    launch_fused(bf16 ? combine_kernel<__nv_bfloat16, true> : combine_kernel<float, true>, f, shared, stream,
                 "combine_kernel");
  } else {
    launch_fused(bf16 ? combine_kernel<__nv_bfloat16, false> : combine_kernel<float, false>, f, shared, stream,
                 "combine_kernel");
  }
}

// Whether an op pulls (`wanted`: its setting, `setting` by name): decided from what every member shares (the
// settings, the group, whether the rows' sizes are 16-byte multiples), since a member that sent while we pulled
// would wait for words that never come; before any message number is taken, so a refusal (buffers that bulk copies
// cannot move, which XLA's never are) leaves this rank in step with its members.
bool pulls(const NvlDevice& dev, const Group& g, bool wanted, bool rows_in_16_bytes,
           std::initializer_list<const void*> buffers, const char* op, const char* setting) {
  if (!wanted || !bulk_copies() || !rows_in_16_bytes) return false;
  const Members m = members(dev, g);
  for (int s = 0; s < g.size; ++s)
    if (s != g.self && !dev.peer_in_process(m.rank_of[s])) return false;
  for (const void* p : buffers)
    if (p && !aligned16(p))
      throw std::invalid_argument(std::string("uccl_ep ") + op + ": " + setting +
                                  "=1 needs 16-byte aligned inputs and outputs; this rank's are not: set " + setting +
                                  "=0");
  return true;
}
void launch_pull_combine(NvlDevice& dev, const Group& g, const CombineKernels& k, bool bf16, cudaStream_t stream) {
  PullCombineLaunch f{};
  f.receive = k.receive;
  f.send = k.send;
  for (int s = 0; s < g.size; ++s)
    if (s != g.self) {
      const int p = f.send.to.rank_of[s];
      f.words_to[s] = dev.peer_pull_words(p);
      f.words_from[s] = dev.pull_words(p);
    }
  f.handoff = Handoff{dev.handoff_words(kFirstHandedOverWord + kMaxRanks), dev.next_launch()};
  f.acks = acks_for(dev, g, k.receive.from, f.handoff.words + kFinishedWord);
  f.receive_shape = combine_receive_stages(k.receive.row_bytes, k.receive.from.num_ranks, true, num_sms());
  launch_fused(bf16 ? pull_combine_kernel<__nv_bfloat16> : pull_combine_kernel<float>, f,
               f.receive_shape.shared_bytes(), stream, "pull_combine_kernel");
}

}  // namespace

int normal_send_blocks() { return send_blocks(); }

// Every unit's g_kernel_stamps (stamps.cuh): this one's and normal_proxy.cu's.
// Pageable sources: each async copy stages its value before it returns.
void set_kernel_stamps(int cuda_device, uint64_t* stamps, bool sides_apart, cudaStream_t stream) {
  check(cudaSetDevice(cuda_device), "cudaSetDevice");
  check(cudaMemcpyToSymbolAsync(g_kernel_stamps, &stamps, sizeof(stamps), 0, cudaMemcpyHostToDevice, stream),
        "cudaMemcpyToSymbolAsync");
  set_proxy_kernel_stamps(stamps, stream);
  sides_apart = sides_apart && stamps;
  check(cudaMemcpyToSymbolAsync(g_sides_apart, &sides_apart, sizeof(sides_apart), 0, cudaMemcpyHostToDevice, stream),
        "cudaMemcpyToSymbolAsync");
  if (!stream) check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

void allow_budget_past_the_gpu(bool allow) { g_allow_budget_past_the_gpu = allow; }

void dispatch(NvlDevice& dev, const Group& g, const DispatchArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  check_group(dev, g, "dispatch");
  check_budget_fits(dev, "dispatch");
  const auto l = dispatch_layout(a.num_tokens, a.x_row_bytes, a.scale_row_bytes, a.topk, a.topk_weights != nullptr);
  check_fits(dev, l.total, "dispatch");
  const Scratch scratch = op_scratch(dev, a.capacity, a.num_tokens);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  const bool pull =
      pulls(dev, g, pull_dispatch(), a.x_row_bytes % 16 == 0 && a.scale_row_bytes % 16 == 0,
            {a.x, a.recv_x, a.scale_row_bytes ? a.scales : nullptr, a.scale_row_bytes ? a.recv_scales : nullptr},
            "dispatch", "UCCL_EP_NVL_PULL_DISPATCH");
  dev.timing_begin(stream);
  launch_dispatch(dev, g, dispatch_kernels(a, g, l, scratch, send_to(dev, g), receive_from(dev, g)), pull, stream);
  dev.timing_end(stream, "dispatch");
}

void dispatch_pairs(NvlDevice& dev, const Group& g, DispatchArgs a, const PairBuffer& p, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  const char* op = "dispatch(layout='expert')";
  check_group(dev, g, op);
  check_budget_fits(dev, op);
  check_pair_buffer(op, a, g.size, p, "over NVLink");
  const int G = a.num_experts / g.size;
  a = pair_dispatch_args(a, p);
  const auto l = dispatch_layout(a.num_tokens, a.x_row_bytes, a.scale_row_bytes, a.topk, a.topk_weights != nullptr);
  check_fits(dev, l.total, op);
  const size_t scratch_bytes_rows = scratch_bytes(a.capacity, a.num_tokens);
  dev.ensure_scratch(scratch_bytes_rows + pair_scratch_bytes(p, G));
  const Scratch scratch = scratch_at(dev.scratch(), a.capacity, a.num_tokens);
  const PairLayout pairs = pair_layout(a, p, G, static_cast<char*>(dev.scratch()) + scratch_bytes_rows);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  // Decided before any message number is taken, so that a refusal leaves this rank in step with its members.
  const bool pull = pulls(dev, g, pull_dispatch(), a.x_row_bytes % 16 == 0 && a.scale_row_bytes % 16 == 0,
                          {a.x, p.x, a.scale_row_bytes ? a.scales : nullptr, a.scale_row_bytes ? p.scales : nullptr},
                          op, "UCCL_EP_NVL_PULL_DISPATCH");
  if (!pull &&
      !bulk_dispatch(a.x_row_bytes, a.x, p.x, a.scale_row_bytes, a.scale_row_bytes ? a.scales : nullptr, p.scales))
    throw std::invalid_argument(std::string("uccl_ep ") + op +
                                " over NVLink writes the pair buffer with bulk copies (UCCL_EP_NVL_BULK=1, rows and "
                                "scale rows of 16-byte multiples, 16-byte aligned buffers); jax_uccl_ep lays other "
                                "pairs out after token rows");
  DispatchKernels k = dispatch_kernels(a, g, l, scratch, send_to(dev, g), receive_from(dev, g));
  k.receive.pair_of = p.pair_of;
  k.receive.pair_capacity = p.capacity;
  dev.timing_begin(stream);
  launch_dispatch(dev, g, k, pull, stream, &pairs);
  dev.timing_end(stream, "dispatch");
}

void cached_dispatch(NvlDevice& dev, const Group& g, const CachedDispatchArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  check_group(dev, g, "cached_dispatch");
  check_budget_fits(dev, "cached_dispatch");
  check_fits(dev, cached_message_bytes(a.num_tokens, a.row_bytes, g.size), "cached_dispatch");
  const Scratch scratch = op_scratch(dev, a.capacity, a.num_tokens);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  const bool pull = pulls(dev, g, pull_dispatch(), a.row_bytes % 16 == 0, {a.x, a.recv_x}, "cached_dispatch",
                          "UCCL_EP_NVL_PULL_DISPATCH");
  launch_dispatch(dev, g, cached_dispatch_kernels(a, g, scratch, send_to(dev, g), receive_from(dev, g)), pull, stream);
}

void combine(NvlDevice& dev, const Group& g, const CombineArgs& a, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  check_group(dev, g, "combine");
  check_budget_fits(dev, "combine");
  check_fits(dev, combine_message_bytes(a.num_tokens, a.hidden, a.dtype), "combine");
  const Scratch scratch = op_scratch(dev, 0, a.num_tokens);
  check(cudaSetDevice(dev.cuda_device()), "cudaSetDevice");
  const int64_t row_bytes = int64_t(a.hidden) * float_bytes(a.dtype);
  const bool pull =
      pulls(dev, g, pull_combine(), row_bytes % 16 == 0, {a.y, a.out}, "combine", "UCCL_EP_NVL_PULL_COMBINE");
  dev.timing_begin(stream);
  const CombineKernels k = combine_kernels(a, scratch, send_to(dev, g), receive_from(dev, g));
  if (pull)
    launch_pull_combine(dev, g, k, a.dtype == FloatType::kBF16, stream);
  else
    launch_combine(dev, g, k, a.dtype == FloatType::kBF16, stream);
  dev.timing_end(stream, "combine");
}

void preload_intranode_kernels() {
  preload_proxy_normal_kernels();
  load_kernels(dispatch_kernel<true>, dispatch_kernel<false>, combine_kernel<float, true>,
               combine_kernel<__nv_bfloat16, true>, combine_kernel<float, false>, combine_kernel<__nv_bfloat16, false>,
               pull_combine_kernel<float>, pull_combine_kernel<__nv_bfloat16>, pull_dispatch_kernel);
  allow_shared_bytes(kBulkSharedBytes, dispatch_kernel<true>, pull_dispatch_kernel, combine_kernel<float, true>,
                     combine_kernel<__nv_bfloat16, true>, pull_combine_kernel<float>,
                     pull_combine_kernel<__nv_bfloat16>);
}

}  // namespace uccl_ep::nvl
