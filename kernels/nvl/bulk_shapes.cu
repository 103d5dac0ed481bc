// The bulk-copy kernels' ring shapes (bulk_shapes.cuh), and the benches' knob over them (set_bulk_tuning,
// testing.hpp). Stages of at most a row segment each for the row copies, larger ones for contiguous pieces; the
// combine receiver's stage holds a segment of each member's copy.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "bulk.cuh"
#include "bulk_shapes.cuh"
#include "device_common.cuh"
#include "testing.hpp"

namespace uccl_ep::nvl {
namespace {

uint32_t align_down(uint64_t n, uint32_t to) { return uint32_t(n / to * to); }
BulkTuning g_tuning{};  // set_bulk_tuning (zeros: the defaults below)
// A stage is refilled one job behind its stores, so each issuing thread keeps stages - 1 loads in flight (with 2
// behind, one: the loopback's send kernels copied ~20% slower, bench/RESULTS.md).
int ring_lag() { return g_tuning.lag > 0 ? g_tuning.lag : 1; }
int stages_per_producer() {
  return std::max(g_tuning.stages_per_producer > 0 ? g_tuning.stages_per_producer : 3, ring_lag() + 1);
}
BulkShape piece_stages(int64_t row_bytes, int64_t tail_bytes, int stages) {
  BulkShape b{};
  b.lag = ring_lag();
  b.producers = kProducers;
  b.stage_bytes = align_down(kBulkSharedBytes / uint32_t(stages), 128);
  b.segment_bytes = uint32_t(std::min<int64_t>(row_bytes, align_down(b.stage_bytes - uint32_t(tail_bytes), 16)));
  b.stages = stages;
  return b;
}

}  // namespace

// The dispatch sender's rings: kMaxProducers issuing threads where each still gets its stages of a whole row (FP8
// rows of 7 KiB: a thread's own work per row bounds that sender, bench/RESULTS.md), else kProducers.
BulkShape row_stages(int64_t row_bytes, uint32_t tables_bytes) {
  BulkShape b{};
  b.tables_bytes = tables_bytes;
  b.lag = ring_lag();
  const uint32_t room = kBulkSharedBytes - tables_bytes;
  const auto most = [&](int producers) { return room / uint32_t(producers * stages_per_producer()) - 128; };
  b.producers = g_tuning.send_producers > 0        ? g_tuning.send_producers
                : most(kMaxProducers) >= row_bytes ? kMaxProducers
                                                   : kProducers;
  b.segment_bytes = uint32_t(std::min<int64_t>(row_bytes, align_down(most(b.producers), 16)));
  // Small rows go several a job: a job's own work costs its issuing thread about the same whatever the rows' size
  // (the SM's copies themselves keep their rate down to 3.5 KiB), and with token slots consecutive tokens' rows are
  // consecutive in x and in every message.
  const int fit = int(std::min<int64_t>(kMaxRowsPerJob, most(b.producers) / row_bytes));
  b.rows_per_job = std::max(1, g_tuning.send_rows > 0 ? std::min(g_tuning.send_rows, fit) : fit);
  b.stage_bytes = (b.segment_bytes * uint32_t(b.rows_per_job) + 127) / 128 * 128;
  b.stages = int(std::min<uint32_t>(kMaxStages, room / b.stage_bytes)) / b.producers * b.producers;  // each its own
  return b;
}
BulkShape piece_stages(int64_t row_bytes, int64_t tail_bytes) {
  return piece_stages(row_bytes, tail_bytes, kProducers * stages_per_producer());
}
// The combine receiver: `per` stages for each of its warps, each stage a slot per member's copy of a row segment
// (segments of a row made even). More stages keep more of a warp's loads in flight while it sums one, but shrink the
// copies. Sent (the members' rows in our own buffer): in the loopback two won at 2 members (~2.9 KiB copies), one at 4
// and 8 (copies of 1.6 KiB rather than 800 B: -10% at 8). Pulled (the rows in the members' memory, over NVLink): at 2
// members on 2x H200 three stages (2.1 KiB copies) took 15% off two at 24 blocks, one added 30%; at 4 members on 4x
// H200 two took 7-9% off one at 8 blocks and cost 0-13% at 24 (bench/RESULTS.md). So as many stages as keep copies
// of 2 KiB (sent: two at most), and pulled two where the blocks are few and copies keep 1 KiB.
BulkShape combine_receive_stages(int64_t row_bytes, int num_ranks, bool pulled, int blocks) {
  const auto copy_bytes = [&](int stages) {
    return kBulkSharedBytes / (stages * kTransferWarps) / uint32_t(num_ranks);
  };
  const int most_stages = pulled ? kMaxStages / kTransferWarps : 2;
  int per = 1;
  while (per < most_stages && copy_bytes(per + 1) >= 2048) ++per;
  if (pulled && blocks <= 8 && per < 2 && copy_bytes(2) >= 1024) per = 2;
  if (g_tuning.combine_stages > 0) per = g_tuning.combine_stages;
  BulkShape b = piece_stages(row_bytes, 0, per * kTransferWarps);
  const int64_t most = align_down(b.stage_bytes / uint32_t(num_ranks), 16);
  const int64_t segs = (row_bytes + most - 1) / most;
  b.segment_bytes = uint32_t(std::min<int64_t>(most, (row_bytes / segs + 15) / 16 * 16));
  return b;
}

bool announce_one_fence() { return g_tuning.announce_one_fence != 2; }

void set_bulk_tuning(const BulkTuning& tuning) {
  if (tuning.lag < 0 || tuning.lag > kMaxLag || tuning.stages_per_producer < 0 ||
      tuning.stages_per_producer * kProducers > kMaxStages || tuning.combine_stages < 0 ||
      tuning.combine_stages * kTransferWarps > kMaxStages ||
      (tuning.send_producers != 0 && tuning.send_producers != kProducers && tuning.send_producers != kMaxProducers) ||
      tuning.send_rows < 0 || tuning.send_rows > kMaxRowsPerJob || tuning.announce_one_fence < 0 ||
      tuning.announce_one_fence > 2)
    throw std::invalid_argument("set_bulk_tuning: lag 0 to " + std::to_string(kMaxLag) + ", stages_per_producer 0 to " +
                                std::to_string(kMaxStages / kProducers) + ", combine_stages 0 to " +
                                std::to_string(kMaxStages / kTransferWarps) + ", send_producers 0, " +
                                std::to_string(kProducers) + " or " + std::to_string(kMaxProducers) +
                                ", send_rows 0 to " + std::to_string(kMaxRowsPerJob) + ", announce_one_fence 0 to 2");
  g_tuning = tuning;
}

}  // namespace uccl_ep::nvl
