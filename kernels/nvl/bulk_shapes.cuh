// The shapes of the bulk-copy kernels' rings (normal_nvlink.cu; bulk.cuh): how a block's shared memory splits into
// stages for each thread that issues copies, chosen per op from the rows' size (bulk_shapes.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "device_common.cuh"

namespace uccl_ep::nvl {

// The bulk-copy kernels' shared memory (dynamic): their tables, then `stages` stages of `stage_bytes`.
struct BulkShape {
  uint32_t segment_bytes;  // most of a row one job moves (dispatch send: rows are cut into segments)
  uint32_t stage_bytes;
  uint32_t tables_bytes;
  int stages;
  int lag;               // StageRing::lag of each producer's ring
  int producers;         // issuing threads (the dispatch sender's; the other kernels have kProducers)
  int rows_per_job = 1;  // the dispatch sender's: consecutive tokens' whole rows a job moves
  __host__ __device__ uint32_t shared_bytes() const { return tables_bytes + uint32_t(stages) * stage_bytes; }
};

// The bulk dispatch sender's shared table, per pass of kTransferThreads tokens: each token's members.
constexpr uint32_t kSendTablesBytes = kTransferThreads * 4;

// Threads of a bulk-copy block that issue copies (lane 0 of the first warps), each through its own stages: one
// thread spends ~0.36 us per copy, so one alone bounds a block well below what its SM can move. The dispatch sender
// takes up to kMaxProducers where rows are small enough (row_stages).
constexpr int kProducers = 4;
constexpr int kMaxProducers = 8;
constexpr int kMaxRowsPerJob = 4;  // a dispatch send job's consecutive tokens (rows of at most a quarter stage)

// The dispatch sender's rings (row_stages), those of the other senders and of dispatch's receive blocks (piece_stages:
// kProducers threads' stages, each a row segment and tail_bytes more), and the combine receiver's (`pulled`: reading
// the members' memory rather than our buffer, with `blocks` receiving).
BulkShape row_stages(int64_t row_bytes, uint32_t tables_bytes);
BulkShape piece_stages(int64_t row_bytes, int64_t tail_bytes);
BulkShape combine_receive_stages(int64_t row_bytes, int num_ranks, bool pulled, int blocks);
// Whether the NVLink kernels' words to several members go out behind one system fence (set_bulk_tuning).
bool announce_one_fence();

}  // namespace uccl_ep::nvl
