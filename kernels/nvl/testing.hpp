// Microbenchmarks and test drivers of the GPU kernels (ring_bench.cu, loopback_bench.cu, built into the tests'
// extension only: ffi/testing.cpp), and the kernels' hooks they and the benches set (defined in normal_nvlink.cu
// and bulk_shapes.cu).
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include "../../proxy/command.hpp"
#include "api.hpp"

namespace uccl_ep::nvl {

// The GPU -> proxy command path without a transport (ring_bench.cu): `num_rings` warps each push
// `commands_per_ring` no-op commands into their own ring, host threads drain them as proxies would.
struct RingBenchResult {
  double seconds;                                  // launch until every command was drained
  double push_seconds;                             // launch until the kernel finished
  uint64_t commands;                               // drained
  uint64_t out_of_order;                           // arrived out of sequence (must be 0)
  double round_trip_median_ns, round_trip_p99_ns;  // ping-pong: push one command, see the host's echo
  // One way, push until the proxy sees the command, on the host's clock: at most the upper figures, at least the
  // median less host_read_round_trip_ns (a GPU read of mapped host memory, there and back).
  double one_way_upper_median_ns, one_way_upper_p99_ns, host_read_round_trip_ns;
  double push_ns;  // mean time a warp spends pushing one command (GPU clock)
};
RingBenchResult ring_bench(int cuda_device, int num_rings, uint64_t commands_per_ring, uint32_t ring_capacity,
                           uint64_t ping_rounds);

// The normal-mode bulk kernels whose spans the loopback bench reads (stamps.cuh). kRouting: dispatch's receive blocks
// waiting for every member's routing; kScan: then the routing scan (dispatch) or the positions (combine); kAcks:
// dispatch's send blocks waiting for the members' acknowledgements of our last message (in the pulled kernels:
// from the first block done with its copies to the end of the last's wait for the members' reads); kRoutingSent: from a
// send block's start until its routing is announced to every member; kScanCounted: inside kScan, from the first block
// done counting to the last one through the counts' handover (the place pass and its handover follow);
// kScanCounting and kScanPlacing: the scan's two passes over the blocks' units, from the first block starting one to
// the last block done with it (without the handovers after them).
enum class KernelKind {
  kScan,
  kDispatchSend,
  kDispatchReceive,
  kCombineSend,
  kCombineReceive,
  kRouting,
  kAcks,
  kRoutingSent,
  kScanCounted,
  kScanCounting,
  kScanPlacing,
  kCount
};
constexpr int kMaxLoopbackGpus = 8;
// Points the kernels' stamps at `stamps` (device memory, [KernelKind::kCount][start, end], start words set to
// UINT64_MAX and end words to 0 beforehand), or turns them off with null. With `sides_apart`, dispatch's receive
// side starts copying only once every member's rows have landed, so each side's span is what it moves alone.
// Given a stream (of `cuda_device`), the pointer changes in its order, between the launches queued on it.
void set_kernel_stamps(int cuda_device, uint64_t* stamps, bool sides_apart = false, cudaStream_t stream = nullptr);
// The same for ops run through XLA (bench/intranode.py --phases): start points `cuda_device`'s kernels at a fresh
// array, stop turns them off and returns [KernelKind] {start, length} in us from the earliest start of any kind
// (length -1: no kernel of that kind ran), on that GPU's own %globaltimer. The GPU must be idle at each call.
void start_kernel_stamps(int cuda_device);
std::vector<std::array<double, 2>> stop_kernel_stamps(int cuda_device);

// The bulk-copy rings of the normal-mode kernels (0: the default): how many jobs behind its stores a producer refills
// a stage (1 to 6), how many stages each producer gets (the send and dispatch-receive rings), how many stages each
// warp of the combine receiver gets, how many threads of a dispatch send block issue copies (4 or 8), and how many
// consecutive tokens' rows a dispatch send job moves (1 to 4, as far as they fit a stage); and whether the NVLink
// kernels' words to several members (meta counts, progress, acknowledgements, the pulled ops' words) go out as
// relaxed stores after the one system fence that orders what they announce (1, the default), or each as a release
// (2), whose own fence waits for the word before it to reach its member.
struct BulkTuning {
  int lag = 0;
  int stages_per_producer = 0;
  int combine_stages = 0;
  int send_producers = 0;
  int send_rows = 0;
  int announce_one_fence = 0;
};
void set_bulk_tuning(const BulkTuning& tuning);
// Lets normal-mode ops take an SM budget past the GPU's SMs (tests of what happens when an op's blocks cannot all
// run at once); off by default.
void allow_budget_past_the_gpu(bool allow);

// Normal mode's NVLink kernels pointed at the GPU's own memory (loopback_bench.cu): `num_ranks` ranks on
// `cuda_device` (or spread over `num_gpus` GPUs), each sending into the others' buffers, random top-k routing;
// dispatch (BF16 rows, or FP8 rows with scales) and, for BF16, combine, each timed over `iters` calls (the slowest
// rank's events), under the current transfer settings. The send and receive blocks of the ranks on a GPU must fit on
// it at once (its ranks x the SM budget).
struct LoopbackArgs {
  int cuda_device, num_tokens, hidden, topk, num_experts;
  bool fp8;
  int iters;
  uint64_t seed;
  int num_ranks;  // 1 to 8
  // Only rank 0's tokens go to other ranks (every other rank's to its own experts): rank 0's send side and the
  // others' receive sides, with the GPU's memory carrying about half of what every rank sending makes it carry.
  bool one_way = false;
  // The spans' call of dispatch holds its receive side back until every rank's rows have landed
  // (set_kernel_stamps), so that its send and receive spans are each side alone.
  bool sides_apart = false;
  // Rank r runs on GPU cuda_device + r % num_gpus: with more than one, the ranks' rows cross NVLink (peer access
  // within this process) and the times are the kernels' over the link rather than through one GPU's memory.
  int num_gpus = 1;
};
struct LoopbackResult {
  double dispatch_us, combine_us;       // per call (combine: 0 with fp8)
  uint64_t remote_rows, received_rows;  // of all ranks, per call
  uint64_t x_row_bytes;                 // bytes of a dispatched row (FP8: with its scales)
  // The last call's rows (with their FP8 scales), local experts' row counts and sums that differ from the inputs
  // (must be 0).
  uint64_t mismatched_rows, mismatched_expert_counts, mismatched_combine_rows;
  // One more call of each op, its bulk kernels' spans over all ranks: [KernelKind] {start, length} in us from the
  // earliest start of the op's kernels (negative length: the kernel did not run). With several GPUs these mix the
  // GPUs' %globaltimer clocks, which disagree by up to milliseconds; gpu_spans are each GPU's own (its ranks'
  // kernels on its clock, from the earliest start of the op's kernels on that GPU).
  double spans[2][int(KernelKind::kCount)][2];  // [dispatch, combine]
  double gpu_spans[kMaxLoopbackGpus][2][int(KernelKind::kCount)][2];
};
LoopbackResult loopback_bench(const LoopbackArgs& args);
// GB/s one kernel of `blocks` blocks copies: per block `producers` threads each running bulk copies through
// `stages` stages of `stage_bytes` (refilled one job behind, as in the kernels), or (warps) the block's warps with SM
// loads and stores of rows of `stage_bytes`. With `gpus` GPUs from `cuda_device` on, each runs the kernel at once
// and GPU g's kernel copies within itself (kLocal), into GPU g + 1's memory (kPush: what our senders do over NVLink)
// or out of it into its own (kPull: what a combine that reads its peers' rows does); the figure is per GPU, timed
// on the slowest. With one GPU the "next GPU" is itself.
enum class CopyDirection { kLocal, kPush, kPull };
double copy_bench(int cuda_device, int blocks, int64_t bytes_per_block, uint32_t stage_bytes, int stages, int producers,
                  bool warps, CopyDirection direction = CopyDirection::kLocal, int gpus = 1);

// Messages from a GPU through its proxy, end to end (the proxy path's device side): a warp writes the payload into
// mapped host memory of the proxy's registered buffer, pushes `messages` messages of it to `peer` into a channel's
// command ring (each `writes` writes that split the payload, then the fence that ends the message), waits for the
// proxy to retire them all (a device quiet: `retired` reaching the ring's head), then for the peer's as many
// messages to us (`released` reaching `released_target` + messages - 1), and compares the peer's payload with its
// pattern. Addresses are host addresses of host_alloc'd (pinned, mapped) memory; the caller keeps every other
// producer off the ring meanwhile.
struct ProxyPutArgs {
  RingSlot* ring_slots;
  uint64_t* ring_head;
  const uint64_t* ring_tail;
  uint32_t ring_capacity;
  const uint64_t* retired;    // the channel's retired-command count
  const uint64_t* released;   // messages released from `peer` on the channel
  uint64_t released_target;   // the count that means its next message is in
  char* payload;              // our buffer at `write.local_offset`
  const char* arrived;        // where the peer's message lands in our buffer
  uint64_t bytes;             // of each message's payload (a multiple of 4 * writes)
  uint32_t messages, writes;  // messages, and writes per message
  Command write, fence;       // the first write of a message (its length bytes / writes) and the fence
  uint32_t rank;              // ours: the payload pattern is (rank, word index)
};
struct ProxyPutResult {
  uint64_t mismatched_words;             // words of the peer's message that differ from its pattern
  double push_us, quiet_us, arrival_us;  // from the kernel's start (GPU clock): all pushed, all retired, all in
  int timed_out;                         // 1: the ring stayed full, 2: no quiet, 3: no message, by timeout_ns()
};
ProxyPutResult proxy_put(int cuda_device, const ProxyPutArgs& args, uint32_t peer_rank);

}  // namespace uccl_ep::nvl
