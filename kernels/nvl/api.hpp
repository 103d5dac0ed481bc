// Intranode (NVLink) normal mode on CUDA GPUs: a framework-free host API. Plain device pointers and a stream
// in; every launch is asynchronous on that stream, with no host synchronization.
//
// How data moves: bulk bytes go GPU-to-GPU with the copy engines (cudaMemcpyAsync into the peer's buffer,
// mapped through CUDA IPC or peer access), which reach the NVLink peak without spending SMs. A message is
// announced by a stream write of a sequence number into the peer's flag (cuStreamWriteValue64, which fences the
// copy before it) and awaited with cuStreamWaitValue64, so no SM spins either. SM kernels only do local work:
// routing scans, gathers into the output and the float32 reduction of combine.
//
// Per GPU one buffer: [flags 4 KiB][in-region of each peer][out-region of each peer]. Peer p copies its
// messages into our in-region(p); combine stages rows for p in out-region(p). Flags, all written by p:
// meta[p] = k once the small leading pieces of message k (routing) landed; data[p] = k * chunks + c + 1 once
// chunk c of its bulk rows landed (the receiver works on chunks as they arrive, overlapping the copy engine);
// ack[p] = k once p has finished reading our message k (we may overwrite its in-region then).
// Sends run on a side stream of ours, so the copy engine moves bulk bytes while SMs gather what has arrived.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

namespace uccl_ep::nvl {

constexpr int kMaxRanks = 8;
constexpr size_t kFlagBytes = 4096;

// Errors kernels find (bad expert index, capacity exceeded) land in host-mapped memory and are raised by
// check_errors(): a kernel cannot fail the call that launched it, and an op must not fail on one rank only
// (its peers' streams would wait for it forever), so ops never raise them themselves.
struct DeviceErrors {
  int32_t code;  // 0 none, 1 bad expert index, 2 capacity exceeded
  int32_t rank;
  int64_t a, b, c;  // details: (token, slot, index) or (received, capacity, -)
};

class NvlDevice {
 public:
  NvlDevice(int cuda_device, int rank, int num_ranks, size_t buffer_bytes);
  ~NvlDevice();
  NvlDevice(const NvlDevice&) = delete;
  NvlDevice& operator=(const NvlDevice&) = delete;

  int cuda_device() const { return device_; }
  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  size_t buffer_bytes() const { return buffer_bytes_; }
  size_t region_bytes() const { return region_bytes_; }
  // Bytes a buffer must hold for messages of `message_bytes` among `num_ranks` GPUs.
  static size_t buffer_bytes_for(int num_ranks, size_t message_bytes);

  std::vector<uint8_t> ipc_handle() const;
  // `peers[r]`: the IPC handle of rank r, or empty for ranks whose buffer is in `local_buffers` (same process).
  void connect(const std::vector<std::vector<uint8_t>>& ipc_handles, const std::vector<NvlDevice*>& same_process);

  char* in_region(int peer) const;        // ours, written by `peer`
  char* out_region(int peer) const;       // ours, staging for `peer`
  char* peer_in_region(int peer) const;   // peer's in-region for us
  uint64_t* data_flag(int peer) const;    // ours
  uint64_t* meta_flag(int peer) const;    // ours
  uint64_t* ack_flag(int peer) const;     // ours
  uint64_t* peer_data_flag(int peer) const;
  uint64_t* peer_meta_flag(int peer) const;
  uint64_t* peer_ack_flag(int peer) const;
  // Side stream for sends, and events to fork it from and join it to XLA's stream.
  cudaStream_t send_stream() const { return send_stream_; }
  cudaEvent_t fork_event() const { return fork_event_; }
  cudaEvent_t join_event() const { return join_event_; }
  // Combine stages rows on a stream of its own, so staging chunk c+1 overlaps the copy of chunk c.
  cudaStream_t stage_stream() const { return stage_stream_; }
  cudaEvent_t chunk_event(int c) const { return chunk_events_[c]; }
  cudaEvent_t stage_done_event() const { return stage_done_event_; }
  int chunks() const { return chunks_; }

  // Message sequencing (host side, under op_mutex): both ends of a pair enqueue ops in the same order.
  std::mutex& op_mutex() { return op_mutex_; }
  uint64_t& sent(int peer) { return sent_[peer]; }
  uint64_t& received(int peer) { return received_[peer]; }

  DeviceErrors* errors_device() const { return errors_device_; }
  // Raises (std::runtime_error) and clears a pending kernel-detected error.
  void check_errors(const char* op);
  void* scratch() const { return scratch_; }  // device scratch for routing tables
  size_t scratch_bytes() const { return scratch_bytes_; }
  void ensure_scratch(size_t bytes);

 private:
  int device_, rank_, num_ranks_;
  size_t buffer_bytes_, region_bytes_;
  char* buffer_ = nullptr;
  std::vector<char*> peer_buffers_;
  std::vector<bool> opened_ipc_;
  uint64_t sent_[kMaxRanks] = {}, received_[kMaxRanks] = {};
  std::mutex op_mutex_;
  DeviceErrors* errors_host_ = nullptr;
  DeviceErrors* errors_device_ = nullptr;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  cudaStream_t send_stream_ = nullptr;
  cudaEvent_t fork_event_ = nullptr, join_event_ = nullptr;
  cudaStream_t stage_stream_ = nullptr;
  std::vector<cudaEvent_t> chunk_events_;
  cudaEvent_t stage_done_event_ = nullptr;
  int chunks_ = 8;
};

// Process-global registry of this process's GPUs. Handlers hold lifetime_mutex() shared for an op.
class NvlRuntime {
 public:
  static NvlRuntime& get();
  // `local`: (CUDA device ordinal, global rank) of each GPU this process drives.
  void start(size_t buffer_bytes, int num_ranks, const std::vector<std::pair<int, int>>& local);
  std::vector<std::pair<int, std::vector<uint8_t>>> ipc_handles();  // (rank, handle) of local GPUs
  // `handles_by_rank[r]`: rank r's IPC handle; entries of this process's own GPUs are not used.
  void connect(const std::vector<std::vector<uint8_t>>& handles_by_rank);
  void shutdown();
  bool initialized() const { return initialized_.load(); }
  std::shared_mutex& lifetime_mutex() { return lifetime_; }
  NvlDevice& device_by_ordinal(int ordinal);
  std::vector<NvlDevice*> devices();

 private:
  std::shared_mutex lifetime_;
  std::atomic<bool> initialized_{false};
  std::vector<std::unique_ptr<NvlDevice>> devices_;
};

// Installs pinned, device-mapped host memory as the proxy runtime's host allocator when a GPU is present
// (command rings a kernel can write, staging for providers without GPU memory support). Returns whether it did.
bool install_pinned_host_allocator();

// Stream memory operations from the driver, found at run time (no libcuda at link time).
void stream_write_value(cudaStream_t stream, uint64_t* address, uint64_t value);
void stream_wait_value(cudaStream_t stream, uint64_t* address, uint64_t value);

struct Group {
  const int32_t* ranks;  // host copy of the group's global ranks, in axis order
  int size;
  int self;
};

struct DispatchArgs {
  const void* x;             // [T, x_row_bytes]
  int64_t x_row_bytes;
  const void* scales;        // [T, scale_row_bytes] or null
  int64_t scale_row_bytes;
  const int32_t* topk_idx;   // [T, K]
  const float* topk_weights; // [T, K] or null
  int num_tokens, topk, num_experts, capacity;
  void* recv_x;
  void* recv_scales;
  int32_t* recv_topk_idx;
  float* recv_topk_weights;
  int32_t* recv_num_tokens;
  int32_t* num_tokens_per_expert;  // [E / R]
  bool* is_token_in_rank;          // [T, R]
  int32_t* recv_counts;            // [R]
};
// Bytes of the message one rank sends another for a dispatch of this shape.
size_t dispatch_message_bytes(int num_tokens, int64_t x_row_bytes, int64_t scale_row_bytes, int topk, bool weights);
void dispatch(NvlDevice& dev, const Group& group, const DispatchArgs& args, cudaStream_t stream);

struct CachedDispatchArgs {
  const void* x;
  int64_t row_bytes;
  int num_tokens, capacity;
  const bool* is_token_in_rank;  // [T, R]
  const int32_t* recv_counts;    // [R] (checked against what arrives)
  void* recv_x;
};
void cached_dispatch(NvlDevice& dev, const Group& group, const CachedDispatchArgs& args, cudaStream_t stream);

struct CombineArgs {
  const void* y;  // [capacity, hidden]
  bool bf16;      // else float32
  int hidden, capacity, num_tokens;
  const bool* is_token_in_rank;  // [T, R]
  const int32_t* recv_counts;    // [R]
  void* out;                     // [T, hidden]
};
size_t combine_message_bytes(int num_tokens, int hidden, bool bf16);
void combine(NvlDevice& dev, const Group& group, const CombineArgs& args, cudaStream_t stream);

// SMs the routing and gather kernels may occupy (UCCL_EP_NUM_SMS, default 24).
int num_sms();

}  // namespace uccl_ep::nvl
