// The ops on CUDA GPUs, a framework-free host API: normal and low-latency mode over NVLink (normal_nvlink.cu,
// low_latency.cu), and GPU-initiated across nodes through the proxy runtime (normal_proxy.cu, low_latency.cu). Plain
// device pointers and a stream in; an NVLink op's launches are asynchronous on that stream, with no host
// synchronization (a GPU-initiated op waits for its kernels, below).
//
// How normal mode's data moves: send kernels push each token's row only to the members that need it, straight into the
// member's buffer over NVLink (mapped through CUDA IPC or peer access), each at its token's row there, so no sender
// lays out or counts rows (the proxy path packs the message in token order); the receiving member's kernels copy the
// rows out as their chunks land. Rows move by bulk copies (bulk.cuh: one thread drives a ring of shared-memory stages,
// global -> shared -> peer), or by SM stores (normal.cuh, which both paths share) where rows are not 16-byte multiples
// and on the proxy path (host memory). An op's send and receive blocks share one SM budget (num_sms()).
//
// Per GPU one buffer: [flags 4 KiB][in-region of each peer][low-latency area]. Peer p writes its messages into
// our in-region(p). Flags, all written by p: meta[p] counts the chunks of p's messages whose routing landed
// (a chunk per send block); chunk[p][c] = k << 32 | n once n tokens (rows, in combine) of chunk c of p's message
// k landed; ack[p] = k once p has finished reading our message k (we may overwrite its in-region then). An op is one
// launch on XLA's stream whose send blocks and receive blocks run side by side (the receive blocks scan the routing
// as it lands); its last block to finish writes the acknowledgements.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "../../proxy/command.hpp"
#include "../contract.hpp"
#include "sizes.hpp"

namespace uccl_ep {
class Device;     // proxy/runtime.hpp: a GPU's state in the proxy runtime (GPUs on several nodes)
struct RingSlot;  // proxy/ring.hpp: a command ring's slot
}  // namespace uccl_ep

namespace uccl_ep::nvl {

constexpr int kMaxRanks = 8;  // GPUs of one host (NVLink)
// Ranks the low-latency kernels' per-member tables hold (by value, in a launch's parameters: 32 keep them under
// the classic 4 KiB): NVLink groups stop at kMaxRanks; groups across nodes (the proxy path) at this.
constexpr int kMaxLowLatencyRanks = 32;
// Most chunks a normal-mode message's rows are announced in (a flag each per peer; a chunk per send block): the
// receiver copies or reduces a chunk as soon as it landed.
constexpr int kChunks = 48;

// Errors kernels find (bad expert index, capacity exceeded) land in host-mapped memory and are raised by
// check_errors(): a kernel cannot fail the call that launched it, and an op must not fail on one rank only
// (its peers' streams would wait for it forever), so ops never raise them themselves.
struct DeviceErrors {
  int32_t code;  // a DeviceErrorCode (kernels/contract.hpp), whose comment says what a, b, c hold
  int32_t rank;
  int64_t a, b, c;  // details: (token, slot, index) or (received, capacity, -)
};

// Raises the error `e` describes (TimeoutError for a peer or proxy that did not answer); `where` starts the message.
[[noreturn]] void raise_device_error(const DeviceErrors& e, const std::string& where);
// Raises (and clears) the error recorded in `word` (host address), if any, as found by an earlier op. With
// `rank_of`, the ranks the kernels recorded (NVLink ranks of a node) are named by rank_of(rank) instead.
void raise_pending_device_error(DeviceErrors* word, const char* op, const std::function<int(int)>& rank_of = {});

class NvlDevice {
 public:
  // `buffer_bytes` for normal mode's regions, `low_latency_bytes` for low-latency mode's (see low_latency.cu).
  NvlDevice(int cuda_device, int rank, int num_ranks, size_t buffer_bytes, size_t low_latency_bytes);
  ~NvlDevice();
  NvlDevice(const NvlDevice&) = delete;
  NvlDevice& operator=(const NvlDevice&) = delete;

  int cuda_device() const { return device_; }
  int sm_count() const { return sm_count_; }  // the GPU's SMs
  int rank() const { return rank_; }          // in this NVLink group (a node's GPUs under two-level routing)
  int num_ranks() const { return num_ranks_; }
  // Runtime-wide ranks of the group's members by their NVLink rank, when the group is one node of a job on the
  // proxy runtime (two-level routing); empty when NVLink ranks are the runtime's.
  void set_global_ranks(std::vector<int32_t> global_of_local);
  int global_rank() const { return global_of_local_.empty() ? rank_ : global_of_local_[size_t(rank_)]; }
  int global_of(int local) const;
  int local_of(int global) const;  // -1 when `global` is not in this group
  size_t buffer_bytes() const { return buffer_bytes_; }
  size_t region_bytes() const { return region_bytes_; }

  std::vector<uint8_t> ipc_handle() const;
  // `peers[r]`: the IPC handle of rank r, or empty for ranks whose buffer is in `local_buffers` (same process).
  void connect(const std::vector<std::vector<uint8_t>>& ipc_handles, const std::vector<NvlDevice*>& same_process);

  char* in_region(int peer) const;        // ours, written by `peer`
  char* peer_in_region(int peer) const;   // peer's in-region for us
  uint64_t* chunk_flags(int peer) const;  // ours: [kChunks]
  uint64_t* meta_flag(int peer) const;    // ours
  uint64_t* ack_flag(int peer) const;     // ours
  uint64_t* peer_chunk_flags(int peer) const;
  uint64_t* peer_meta_flag(int peer) const;
  uint64_t* peer_ack_flag(int peer) const;
  // Whether `peer`'s memory is this process's (a GPU it drives): any of its device pointers is valid here.
  bool peer_in_process(int peer) const { return !opened_ipc_[size_t(peer)]; }
  // A pulled op's words from `peer` to us (ours) and from us to `peer` (its): where its inputs are (combine: y, first
  // row of ours | rows << 32; dispatch: x, scales, topk_idx or the token-in-rank mask, weights), then the message's
  // number (kPullMessageWord), written last.
  static constexpr int kPullWords = 6, kPullMessageWord = kPullWords - 1;
  uint64_t* pull_words(int peer) const;
  uint64_t* peer_pull_words(int peer) const;

  // Message sequencing (host side, under op_mutex): both ends of a pair enqueue ops in the same order.
  std::mutex& op_mutex() { return op_mutex_; }
  uint64_t& sent(int peer) { return sent_[peer]; }
  uint64_t& received(int peer) { return received_[peer]; }

  // Low-latency area: two halves (the parity of the pair's op count), each split into one region per sending
  // rank. SM kernels write rows straight into the peer's region; an arrival counter per sender counts its
  // send blocks (op count x blocks per send).
  size_t low_latency_bytes() const { return ll_bytes_; }
  size_t low_latency_stride() const { return ll_stride_; }    // bytes of one sender's region
  char* low_latency_region(int parity, int sender) const;     // ours, written by `sender`
  char* peer_low_latency_region(int peer, int parity) const;  // peer's region for us
  uint64_t* low_latency_arrivals(int sender) const;  // ours: how many of the sender's send blocks arrived, ever
  uint64_t* peer_low_latency_arrivals(int peer) const;
  uint64_t& low_latency_sent(int peer) { return ll_sent_[peer]; }
  uint64_t& low_latency_received(int peer) { return ll_received_[peer]; }

  // Kernel timing (UCCL_EP_KERNEL_TIMING=1): events around each op's work on the GPU, read by kernel_times().
  // An op's span runs from its first kernel's start to its last kernel's end, so it includes waiting for peers
  // but no host overhead; low-latency ops report their send kernel and the rest (receive, waiting) apart.
  void timing_begin(cudaStream_t stream);
  void timing_end(cudaStream_t stream, const char* label);
  std::vector<std::pair<std::string, float>> kernel_times();  // (label, microseconds); waits for the GPU
  // With UCCL_EP_KERNEL_TIMING=2, low-latency kernels also stamp SM clocks at their phases (block 0, thread 0,
  // the last launch of each kernel) into kPhaseWords mapped words: [kernel * 8 + phase], see low_latency.cu.
  static constexpr int kPhaseWords = 32;
  uint64_t* phases_device() const { return phases_device_; }  // null unless enabled
  std::vector<uint64_t> kernel_phases();                      // waits for the GPU

  DeviceErrors* errors_device() const { return errors_device_; }
  // Raises (std::runtime_error) and clears a pending kernel-detected error.
  void check_errors(const char* op);
  void* scratch() const { return scratch_; }  // device scratch for routing tables
  size_t scratch_bytes() const { return scratch_bytes_; }
  void ensure_scratch(size_t bytes);
  // At least `count` words through which the blocks of one launch hand work to each other, each stamped with a
  // launch's number (next_launch(), from 1 up); zeroed when they grow, so a word never passes early.
  uint64_t* handoff_words(size_t count);
  static constexpr size_t kInitialHandoffWords = 1 << 14;  // a dispatch of up to 512K tokens per rank among 8
  uint64_t next_launch() { return ++launches_; }

 private:
  int device_, rank_, num_ranks_;
  int sm_count_ = 0;
  std::vector<int32_t> global_of_local_;
  size_t buffer_bytes_, region_bytes_;
  size_t ll_offset_ = 0, ll_bytes_ = 0, ll_half_ = 0, ll_stride_ = 0;
  uint64_t ll_sent_[kMaxRanks] = {}, ll_received_[kMaxRanks] = {};
  bool timing_ = false;
  uint64_t* phases_host_ = nullptr;
  uint64_t* phases_device_ = nullptr;
  cudaEvent_t timing_start_ = nullptr;  // begun, not yet ended
  std::vector<std::pair<std::string, std::pair<cudaEvent_t, cudaEvent_t>>> timings_;
  std::vector<cudaEvent_t> spare_events_;
  cudaEvent_t timing_event();
  char* buffer_ = nullptr;
  std::vector<char*> peer_buffers_;
  std::vector<bool> opened_ipc_;
  uint64_t sent_[kMaxRanks] = {}, received_[kMaxRanks] = {};
  std::mutex op_mutex_;
  DeviceErrors* errors_host_ = nullptr;
  DeviceErrors* errors_device_ = nullptr;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  uint64_t* handoff_ = nullptr;
  size_t handoff_bytes_ = 0;
  uint64_t launches_ = 0;
};

// Process-global registry of this process's GPUs. Handlers hold lifetime_mutex() shared for an op.
class NvlRuntime {
 public:
  static NvlRuntime& get();
  // `local`: (CUDA device ordinal, rank) of each GPU this process drives. `global_of_local`: for a runtime of
  // one node's GPUs beside the proxy runtime (two-level routing), the runtime-wide rank of each NVLink rank.
  void start(size_t buffer_bytes, size_t low_latency_bytes, int num_ranks,
             const std::vector<std::pair<int, int>>& local, const std::vector<int32_t>& global_of_local = {});
  std::vector<std::pair<int, std::vector<uint8_t>>> ipc_handles();  // (rank, handle) of local GPUs
  // `handles_by_rank[r]`: rank r's IPC handle; entries of this process's own GPUs are not used.
  void connect(const std::vector<std::vector<uint8_t>>& handles_by_rank);
  void shutdown();
  bool initialized() const { return initialized_.load(); }
  std::shared_mutex& lifetime_mutex() { return lifetime_; }
  NvlDevice& device_by_ordinal(int ordinal);
  std::vector<NvlDevice*> devices();
  // Waits for every local GPU and raises (clearing them) the errors its kernels found: one error names them all,
  // with the first one's type.
  void check_errors(const char* op);

 private:
  std::shared_mutex lifetime_;
  std::atomic<bool> initialized_{false};
  std::vector<std::unique_ptr<NvlDevice>> devices_;
};

// Installs pinned, device-mapped host memory as the proxy runtime's host allocator when a GPU is present
// (command rings a kernel can write, staging for providers without GPU memory support). Returns whether it did.
bool install_pinned_host_allocator();

using uccl_ep::CachedDispatchArgs;
using uccl_ep::CombineArgs;
using uccl_ep::DispatchArgs;
using uccl_ep::FloatType;
using uccl_ep::Group;  // ranks: a host copy of the group's ranks
using uccl_ep::LowLatencyCombineArgs;
using uccl_ep::LowLatencyDispatchArgs;

using uccl_ep::ExpandPairsArgs;
// Enqueues ExpandPairsArgs's copy on `stream` (no communication).
void expand_pairs(const ExpandPairsArgs& args, cudaStream_t stream);
using uccl_ep::SumPairsArgs;
// Enqueues SumPairsArgs's sums on `stream` (no communication).
void sum_pairs(const SumPairsArgs& args, cudaStream_t stream);

using uccl_ep::SwigluArgs;
// Enqueues the experts' elementwise step (SwigluArgs) on `stream` (no communication).
void swiglu(const SwigluArgs& args, cudaStream_t stream);

using uccl_ep::LayoutArgs;
using uccl_ep::PairBuffer;
// Enqueues the layout on `stream`; a bad expert index is skipped and recorded in `err` (raised by check_errors()).
void get_dispatch_layout(const LayoutArgs& args, DeviceErrors* err, int rank, cudaStream_t stream);

void dispatch(NvlDevice& dev, const Group& group, const DispatchArgs& args, cudaStream_t stream);

// dispatch(layout="expert") where the dispatch pulls (pulls() below): the receive copies each row straight into
// its slots of the pair buffer (PairBuffer's rule), which must never drop; `args`' own outputs other than the
// token-in-rank mask and the counts are unused.
void dispatch_pairs(NvlDevice& dev, const Group& group, DispatchArgs args, const PairBuffer& pairs,
                    cudaStream_t stream);

void cached_dispatch(NvlDevice& dev, const Group& group, const CachedDispatchArgs& args, cudaStream_t stream);

void combine(NvlDevice& dev, const Group& group, const CombineArgs& args, cudaStream_t stream);

// Loads every kernel of normal and low-latency mode on the current device. CUDA loads modules lazily, at a
// kernel's first launch, and a load can wait for the device to go idle, which a stream blocked on a peer's
// flag never does (in one process driving several GPUs that can deadlock): load them all at start instead.
void preload_intranode_kernels();
void preload_low_latency_kernels();

// Views of the settings (kernels/settings.hpp) as the kernels use them.
// Normal mode's SM budget: its send and receive blocks together, one per SM; of those, the send blocks (at most
// kChunks; 0: the kernels choose, a half with bulk copies, else a third).
int num_sms();
int num_send_sms();
int normal_send_blocks();  // what the kernels take of the budget to send (the rest receive)
// Whether normal mode's NVLink kernels move rows with bulk copies (TMA) rather than SM stores; rows that are not
// 16-byte multiples, and the proxy path's host-memory regions, always take SM stores.
bool bulk_copies();
// Whether normal mode's combine, where every member is a GPU of this process (its memory, XLA's buffers included, is
// addressable here), reads the members' rows where they are (a pull: one copy, every block of the budget reducing)
// rather than having each member send them into our buffer first.
bool pull_combine();
// Likewise for (cached) dispatch: each receiver reads the members' routing and rows in their inputs (XLA's buffers).
bool pull_dispatch();
// Blocks of the split low-latency receive kernels; send and fused kernels use kSendBlocks (low_latency.cu).
int low_latency_blocks();
// How long a kernel waits for a peer's message before it reports the peer as missing.
uint64_t timeout_ns();
// Low-latency kernels: a non-split op's send and receive in one kernel.
bool low_latency_fused();

// Low-latency mode (low_latency.cu). Shapes as in jax_uccl_ep.low_latency: L = num_experts / R local experts,
// N = max_tokens_per_rank; recv_x [L, R * N, x_row_bytes], rows of local expert l: [0, recv_count[l]) valid,
// grouped by source (group order), then token. Padding rows of recv_x are not written (src_slot is -1 there).
// The send half reads x, scales, topk_idx; the receive half (later on the same stream, no EP op between) writes
// the outputs.
void low_latency_dispatch_send(NvlDevice& dev, const Group& group, const LowLatencyDispatchArgs& args,
                               cudaStream_t stream);
void low_latency_dispatch_recv(NvlDevice& dev, const Group& group, const LowLatencyDispatchArgs& args,
                               cudaStream_t stream);
// Both halves, in one kernel where its blocks fit on the GPU at once (UCCL_EP_LL_FUSED=0: two launches).
void low_latency_dispatch(NvlDevice& dev, const Group& group, const LowLatencyDispatchArgs& args, cudaStream_t stream);

void low_latency_combine_send(NvlDevice& dev, const Group& group, const LowLatencyCombineArgs& args,
                              cudaStream_t stream);
void low_latency_combine_recv(NvlDevice& dev, const Group& group, const LowLatencyCombineArgs& args,
                              cudaStream_t stream);
void low_latency_combine(NvlDevice& dev, const Group& group, const LowLatencyCombineArgs& args, cudaStream_t stream);
// Low-latency mode across nodes (GPUs on the proxy runtime), GPU-initiated: the same kernels, with regions in the
// proxy's registered buffer (pinned host memory mapped into the GPU) in place of the peers' NVLink buffers. The
// send kernel's last block pushes one message per receiver into channel 0's command ring (a write per used piece
// of the region, then the fence), once that receiver acknowledged our previous message; the proxy posts them.
// The receive kernel waits for each sender's released-message word and reads the rows from host memory; a
// one-warp kernel then acknowledges every sender. Each call waits for its kernels (as the host-staged ops do),
// then brings the host's protocol state in step (messages consumed, acknowledgements owed), so host-staged ops
// may run between them. At most kMaxLowLatencyRanks ranks. A peer or proxy that did not answer in time is raised
// by the call (TimeoutError; the rank is out of step and the peers are told); errors in the inputs (bad expert
// index, capacity, stale handle) by check_proxy_errors(), as NVLink ops leave them for check_errors().
void low_latency_dispatch_send(Device& dev, const Group& group, const LowLatencyDispatchArgs& args,
                               cudaStream_t stream);
void low_latency_dispatch_recv(Device& dev, const Group& group, const LowLatencyDispatchArgs& args,
                               cudaStream_t stream);
void low_latency_dispatch(Device& dev, const Group& group, const LowLatencyDispatchArgs& args, cudaStream_t stream);
void low_latency_combine_send(Device& dev, const Group& group, const LowLatencyCombineArgs& args, cudaStream_t stream);
void low_latency_combine_recv(Device& dev, const Group& group, const LowLatencyCombineArgs& args, cudaStream_t stream);
void low_latency_combine(Device& dev, const Group& group, const LowLatencyCombineArgs& args, cudaStream_t stream);
// Raises (and clears) the first input error the GPU-initiated ops of this process found, naming the rank.
void check_proxy_errors(const char* op);
// The error word of the proxy path on `cuda_device` (device address), which check_proxy_errors() reads.
DeviceErrors* proxy_error_word(int cuda_device);
// Whether low-latency ops on the proxy runtime can run GPU-initiated (above) for a job of `num_ranks`: at most
// kMaxLowLatencyRanks ranks, in pinned mapped memory. The plan (jax_uccl_ep/_plan.py) decides, with the settings.
bool gpu_initiated_low_latency(uint32_t num_ranks);

// Normal mode across nodes (GPUs on the proxy runtime), GPU-initiated: the NVLink path's kernels with each member's
// region in our registered buffer (mapped host memory) in place of its NVLink buffer. The send kernel packs every
// member's rows and routing into our send region for it; a one-warp kernel then pushes one message per member
// into channel 0's command ring (only the used pieces of the region), once that member acknowledged our previous
// message; the receive side waits for each member's released-message word, scans the routing and copies or
// reduces from our receive regions, then acknowledges every member. Flat: every token crosses once per GPU that
// needs it (no fan-out within a node), for jobs of at most kMaxRanks ranks; larger jobs, or UCCL_EP_GPU_INITIATED=0,
// stage through the host (the CPU path's hierarchical rounds). Each call waits for its kernels, as the
// low-latency ops above do; errors as there.
void dispatch(Device& dev, const Group& group, const DispatchArgs& args, cudaStream_t stream);
// dispatch(layout="expert") on this path: once every message is in, the pair layout, then each received row copied
// from our receive region straight into its slots (the NVLink dispatch_pairs' rule and limits).
void dispatch_pairs(Device& dev, const Group& group, DispatchArgs args, const PairBuffer& pairs, cudaStream_t stream);
void cached_dispatch(Device& dev, const Group& group, const CachedDispatchArgs& args, cudaStream_t stream);
void combine(Device& dev, const Group& group, const CombineArgs& args, cudaStream_t stream);
bool gpu_initiated_normal(uint32_t num_ranks);

}  // namespace uccl_ep::nvl
