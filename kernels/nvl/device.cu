// NvlDevice: the per-GPU buffer and its mapping into peers.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#include "../../proxy/errors.hpp"
#include "../../proxy/host_memory.hpp"
#include "../settings.hpp"
#include "api.hpp"
#include "device_common.cuh"

namespace uccl_ep::nvl {
namespace {
void* pinned_alloc(size_t bytes) {
  void* p = nullptr;
  if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}
void pinned_free(void* p) { cudaFreeHost(p); }
}  // namespace

constexpr const char* kPinnedAllocator = "pinned, mapped (cudaHostAlloc)";

bool install_pinned_host_allocator() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // no driver or no GPU: keep ordinary memory
    return false;
  }
  set_host_allocator(HostAllocator{pinned_alloc, pinned_free, kPinnedAllocator});
  return true;
}

namespace {
// `count` zeroed Ts in pinned host memory the GPU reads and writes; *device gets the GPU's address of it.
template <class T>
T* mapped_host(size_t count, T** device) {
  T* host = nullptr;
  check(cudaHostAlloc(reinterpret_cast<void**>(&host), count * sizeof(T), cudaHostAllocMapped), "cudaHostAlloc");
  std::memset(static_cast<void*>(host), 0, count * sizeof(T));
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(device), host, 0), "cudaHostGetDevicePointer");
  return host;
}
}  // namespace

int num_sms() { return std::max(2, settings().num_sms); }
int num_send_sms() { return std::max(0, settings().num_send_sms); }
bool bulk_copies() { return settings().nvl_bulk; }
bool pull_combine() { return settings().nvl_pull_combine; }
bool pull_dispatch() { return settings().nvl_pull_dispatch; }
int low_latency_blocks() { return std::max(1, settings().ll_num_sms); }
bool low_latency_fused() { return settings().ll_fused; }

namespace {
// The kernels write into the proxy's buffer and rings: only where the runtime made them pinned and mapped.
bool gpu_initiated(uint32_t num_ranks, int most_ranks) {
  return num_ranks <= uint32_t(most_ranks) && std::string(host_allocator_name()) == kPinnedAllocator;
}
}  // namespace

bool gpu_initiated_low_latency(uint32_t num_ranks) { return gpu_initiated(num_ranks, kMaxLowLatencyRanks); }
bool gpu_initiated_normal(uint32_t num_ranks) { return gpu_initiated(num_ranks, kMaxRanks); }

uint64_t timeout_ns() { return uint64_t(settings().timeout_s * 1e9); }

NvlDevice::NvlDevice(int cuda_device, int rank, int num_ranks, size_t buffer_bytes, size_t low_latency_bytes)
    : device_(cuda_device), rank_(rank), num_ranks_(num_ranks), buffer_bytes_(buffer_bytes) {
  if (num_ranks < 1 || num_ranks > kMaxRanks)
    throw std::invalid_argument("uccl_ep nvl: NVLink groups hold 1 to 8 GPUs, got " + std::to_string(num_ranks));
  if (buffer_bytes < kFlagBytes + size_t(num_ranks) * 4096)
    throw std::invalid_argument("uccl_ep nvl: buffer of " + std::to_string(buffer_bytes) + " bytes is too small");
  region_bytes_ = (buffer_bytes - kFlagBytes) / size_t(num_ranks) / 4096 * 4096;
  ll_offset_ = (buffer_bytes + 4095) / 4096 * 4096;
  ll_half_ = low_latency_bytes / 2 / 4096 * 4096;
  ll_stride_ = ll_half_ / size_t(num_ranks) / 256 * 256;
  ll_bytes_ = 2 * ll_half_;
  check(cudaSetDevice(device_), "cudaSetDevice");
  check(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_), "cudaDeviceGetAttribute");
  check(cudaMalloc(&buffer_, ll_offset_ + ll_bytes_),
        "cudaMalloc of " + std::to_string(ll_offset_ + ll_bytes_) + " bytes");
  check(cudaMemset(buffer_, 0, kFlagBytes), "cudaMemset");
  errors_host_ = mapped_host<DeviceErrors>(1, &errors_device_);
  timing_ = settings().kernel_timing > 0;
  if (settings().kernel_timing == 2) phases_host_ = mapped_host<uint64_t>(kPhaseWords, &phases_device_);
  handoff_words(kInitialHandoffWords);
  preload_intranode_kernels();
  preload_low_latency_kernels();
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  peer_buffers_.assign(num_ranks, nullptr);
  opened_ipc_.assign(num_ranks, false);
  peer_buffers_[rank] = buffer_;
}

NvlDevice::~NvlDevice() {
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  for (int p = 0; p < num_ranks_; ++p)
    if (opened_ipc_[p]) cudaIpcCloseMemHandle(peer_buffers_[p]);
  if (scratch_) cudaFree(scratch_);
  if (handoff_) cudaFree(handoff_);
  if (buffer_) cudaFree(buffer_);
  for (auto& t : timings_) spare_events_.insert(spare_events_.end(), {t.second.first, t.second.second});
  if (timing_start_) spare_events_.push_back(timing_start_);
  for (auto e : spare_events_) cudaEventDestroy(e);
  if (errors_host_) cudaFreeHost(errors_host_);
  if (phases_host_) cudaFreeHost(phases_host_);
}

std::vector<uint8_t> NvlDevice::ipc_handle() const {
  cudaIpcMemHandle_t h;
  check(cudaSetDevice(device_), "cudaSetDevice");
  check(cudaIpcGetMemHandle(&h, buffer_), "cudaIpcGetMemHandle");
  const uint8_t* p = reinterpret_cast<const uint8_t*>(&h);
  return std::vector<uint8_t>(p, p + sizeof(h));
}

void NvlDevice::connect(const std::vector<std::vector<uint8_t>>& ipc_handles,
                        const std::vector<NvlDevice*>& same_process) {
  check(cudaSetDevice(device_), "cudaSetDevice");
  for (int p = 0; p < num_ranks_; ++p) {
    if (p == rank_) continue;
    if (same_process[p]) {
      // Same process: map the peer's allocation directly.
      enable_peer_access(device_, same_process[p]->cuda_device());
      peer_buffers_[p] = same_process[p]->buffer_;
    } else {
      if (ipc_handles[p].size() != sizeof(cudaIpcMemHandle_t))
        throw std::invalid_argument("uccl_ep nvl: bad IPC handle for rank " + std::to_string(p));
      cudaIpcMemHandle_t h;
      std::memcpy(&h, ipc_handles[p].data(), sizeof(h));
      void* ptr = nullptr;
      check(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess),
            "cudaIpcOpenMemHandle for rank " + std::to_string(p));
      peer_buffers_[p] = static_cast<char*>(ptr);
      opened_ipc_[p] = true;
    }
  }
}

char* NvlDevice::in_region(int peer) const { return buffer_ + kFlagBytes + size_t(peer) * region_bytes_; }
char* NvlDevice::peer_in_region(int peer) const {
  return peer_buffers_[peer] + kFlagBytes + size_t(rank_) * region_bytes_;
}
char* NvlDevice::low_latency_region(int parity, int sender) const {
  return buffer_ + ll_offset_ + size_t(parity) * ll_half_ + size_t(sender) * ll_stride_;
}
char* NvlDevice::peer_low_latency_region(int peer, int parity) const {
  return peer_buffers_[peer] + ll_offset_ + size_t(parity) * ll_half_ + size_t(rank_) * ll_stride_;
}
// Flag words, indexed by the writing peer: [unused x kMaxRanks][meta x kMaxRanks][ack x kMaxRanks]
// [low-latency x kMaxRanks][unused to word 64][chunks: kChunks x kMaxRanks][pull: kPullWords x kMaxRanks].
uint64_t* NvlDevice::low_latency_arrivals(int sender) const {
  return reinterpret_cast<uint64_t*>(buffer_) + 3 * kMaxRanks + sender;
}
uint64_t* NvlDevice::peer_low_latency_arrivals(int peer) const {
  return reinterpret_cast<uint64_t*>(peer_buffers_[peer]) + 3 * kMaxRanks + rank_;
}

constexpr size_t kPullWordsAt = 64 + kChunks * kMaxRanks;
static_assert((kPullWordsAt + NvlDevice::kPullWords * kMaxRanks) * sizeof(uint64_t) <= kFlagBytes,
              "chunk flags and pull words outgrow the flag page");
uint64_t* NvlDevice::pull_words(int peer) const {
  return reinterpret_cast<uint64_t*>(buffer_) + kPullWordsAt + size_t(peer) * kPullWords;
}
uint64_t* NvlDevice::peer_pull_words(int peer) const {
  return reinterpret_cast<uint64_t*>(peer_buffers_[peer]) + kPullWordsAt + size_t(rank_) * kPullWords;
}

uint64_t* NvlDevice::chunk_flags(int peer) const {
  return reinterpret_cast<uint64_t*>(buffer_) + 64 + size_t(peer) * kChunks;
}
uint64_t* NvlDevice::meta_flag(int peer) const { return reinterpret_cast<uint64_t*>(buffer_) + kMaxRanks + peer; }
uint64_t* NvlDevice::ack_flag(int peer) const { return reinterpret_cast<uint64_t*>(buffer_) + 2 * kMaxRanks + peer; }
uint64_t* NvlDevice::peer_chunk_flags(int peer) const {
  return reinterpret_cast<uint64_t*>(peer_buffers_[peer]) + 64 + size_t(rank_) * kChunks;
}
uint64_t* NvlDevice::peer_meta_flag(int peer) const {
  return reinterpret_cast<uint64_t*>(peer_buffers_[peer]) + kMaxRanks + rank_;
}
uint64_t* NvlDevice::peer_ack_flag(int peer) const {
  return reinterpret_cast<uint64_t*>(peer_buffers_[peer]) + 2 * kMaxRanks + rank_;
}

namespace {

// Replaces `*buffer` (of `*bytes`) with an allocation of `wanted` bytes on the current device, `zeroed` before any
// stream's launch reads it. Kernels queued on any stream may still use the old one, so it is freed only after they
// finish. Nothing else synchronizes: in one process that drives several ranks on a GPU (the loopback bench), a
// rank's queued kernel can wait for a launch of another rank that this call comes before.
void grow_device_buffer(void** buffer, size_t* bytes, size_t wanted, bool zeroed, const char* what) {
  if (*buffer) {
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cudaFree(*buffer);
    *buffer = nullptr;
    *bytes = 0;
  }
  check(cudaMalloc(buffer, wanted), what);
  if (zeroed) {
    check(cudaMemset(*buffer, 0, wanted), "cudaMemset");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  *bytes = wanted;
}

}  // namespace

void NvlDevice::ensure_scratch(size_t bytes) {
  if (bytes <= scratch_bytes_) return;
  check(cudaSetDevice(device_), "cudaSetDevice");
  grow_device_buffer(&scratch_, &scratch_bytes_, bytes, false, "cudaMalloc scratch");
}

uint64_t* NvlDevice::handoff_words(size_t count) {
  if (count * sizeof(uint64_t) > handoff_bytes_) {
    check(cudaSetDevice(device_), "cudaSetDevice");
    grow_device_buffer(reinterpret_cast<void**>(&handoff_), &handoff_bytes_, count * sizeof(uint64_t), true,
                       "cudaMalloc handoff words");
  }
  return handoff_;
}

cudaEvent_t NvlDevice::timing_event() {
  if (!spare_events_.empty()) {
    cudaEvent_t e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  cudaEvent_t e;
  check(cudaEventCreate(&e), "cudaEventCreate");
  return e;
}

void NvlDevice::timing_begin(cudaStream_t stream) {
  if (!timing_ || timings_.size() >= 100000) return;
  if (!timing_start_) timing_start_ = timing_event();
  check(cudaEventRecord(timing_start_, stream), "cudaEventRecord");
}

void NvlDevice::timing_end(cudaStream_t stream, const char* label) {
  if (!timing_ || !timing_start_) return;
  cudaEvent_t end = timing_event();
  check(cudaEventRecord(end, stream), "cudaEventRecord");
  timings_.push_back({label, {timing_start_, end}});
  timing_start_ = nullptr;
}

std::vector<std::pair<std::string, float>> NvlDevice::kernel_times() {
  check(cudaSetDevice(device_), "cudaSetDevice");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  std::vector<std::pair<std::string, float>> out;
  for (auto& [label, events] : timings_) {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, events.first, events.second), "cudaEventElapsedTime");
    out.emplace_back(label, ms * 1000.f);
    spare_events_.insert(spare_events_.end(), {events.first, events.second});
  }
  timings_.clear();
  return out;
}

std::vector<uint64_t> NvlDevice::kernel_phases() {
  if (!phases_host_) return {};
  check(cudaSetDevice(device_), "cudaSetDevice");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return std::vector<uint64_t>(phases_host_, phases_host_ + kPhaseWords);
}

void NvlDevice::set_global_ranks(std::vector<int32_t> global_of_local) {
  if (!global_of_local.empty() && global_of_local.size() != size_t(num_ranks_))
    throw std::invalid_argument("uccl_ep nvl: " + std::to_string(global_of_local.size()) + " global ranks for " +
                                std::to_string(num_ranks_) + " GPUs");
  global_of_local_ = std::move(global_of_local);
}

int NvlDevice::global_of(int local) const {
  return global_of_local_.empty() || local < 0 || local >= num_ranks_ ? local : global_of_local_[size_t(local)];
}

int NvlDevice::local_of(int global) const {
  if (global_of_local_.empty()) return global >= 0 && global < num_ranks_ ? global : -1;
  for (int l = 0; l < num_ranks_; ++l)
    if (global_of_local_[size_t(l)] == global) return l;
  return -1;
}

void NvlDevice::check_errors(const char* op) {
  // Kernels record NVLink ranks; under two-level routing the user knows the runtime's.
  if (global_of_local_.empty()) return raise_pending_device_error(errors_host_, op);
  raise_pending_device_error(errors_host_, op, [this](int local) { return global_of(local); });
}

void raise_pending_device_error(DeviceErrors* word, const char* op, const std::function<int(int)>& rank_of) {
  DeviceErrors e;  // a snapshot: the word is the kernels' to write
  std::memcpy(&e, const_cast<const DeviceErrors*>(word), sizeof(e));
  if (e.code == kNoError) return;
  std::memset(word, 0, sizeof(DeviceErrors));
  if (rank_of) {
    e.rank = rank_of(e.rank);
    if (e.code == kPeerLate || (e.code == kRingFull && e.a >= 0)) e.a = rank_of(int(e.a));  // the peer's rank
  }
  raise_device_error(e, std::string("uccl_ep ") + op + ": an earlier op on rank " + std::to_string(e.rank) + " ");
}

void raise_device_error(const DeviceErrors& e, const std::string& where) {
  if (e.code == kBadExpertIndex)
    throw std::invalid_argument(where + "found topk_idx[" + std::to_string(e.a) + ", " + std::to_string(e.b) +
                                "] = " + std::to_string(e.c) + " outside [-1, num_experts) (that slot was skipped)");
  if (e.code == kOverCapacity)
    throw std::invalid_argument(where + "received " + std::to_string(e.a) + " tokens but capacity is " +
                                std::to_string(e.b) + " (rows past the capacity were dropped)");
  if (e.code == kRowsDifferFromHandle)
    throw std::invalid_argument(where + "got " + std::to_string(e.b) + " rows from group member " +
                                std::to_string(e.a) + " where the handle records " + std::to_string(e.c) +
                                " (stale handle?)");
  if (e.code == kPeerLate && e.b < 0)
    throw TimeoutError(where + "waited " + std::to_string(e.c) + " s for rank " + std::to_string(e.a) +
                       " to finish reading our message " + std::to_string(-e.b) +
                       " (peer dead or out of step; UCCL_EP_TIMEOUT_S); results of that op are not valid");
  if (e.code == kPeerLate)
    throw TimeoutError(where + "waited " + std::to_string(e.c) + " s for message " + std::to_string(e.b) +
                       " from rank " + std::to_string(e.a) +
                       ", which did not arrive (peer dead or out of step; UCCL_EP_TIMEOUT_S); results of that op "
                       "are not valid");
  if (e.code == kLowLatencyRowCount)
    throw std::invalid_argument(where + "got " + std::to_string(e.a) + " rows for local expert " + std::to_string(e.b) +
                                " from rank " + std::to_string(e.c) +
                                " in low_latency_combine where its dispatch sent a different number (was topk_idx "
                                "the dispatch's?)");
  if (e.code == kUnknownRowSource)
    throw std::runtime_error(where + "found a dispatch row from rank " + std::to_string(e.a) + " naming token row " +
                             std::to_string(e.b) + " and source slot " + std::to_string(e.c) +
                             " in low_latency_dispatch, which no sender writes (corrupt or out-of-step low-latency "
                             "buffer); that row was not delivered");
  if (e.code == kExpertRowsPastN)
    throw std::invalid_argument(where + "sent " +
                                expert_rows_past_n(int(e.a & 0xffffffff), e.b, int(e.a >> 32), int(e.c)) +
                                " (the rows were sent; the op's results are not valid)");
  if (e.code == kNoSourceSlot)
    throw std::invalid_argument(where + "found no source slot (" + std::to_string(e.c) + ") for row " +
                                std::to_string(e.b) + " of local expert " + std::to_string(e.a) +
                                " in low_latency_combine (stale handle?); that row was not returned");
  if (e.code == kHandleDisagreesWithY)
    throw std::invalid_argument(where + "was handed a handle recording " + std::to_string(e.a) +
                                " received rows for a y of " + std::to_string(e.b) + " rows (stale handle?)");
  if (e.code == kRingFull)
    throw TimeoutError(where + "found its proxy's command ring full for " + std::to_string(e.c) + " s " +
                       (e.a >= 0 ? "while sending to rank " + std::to_string(e.a) : std::string("acknowledging")) +
                       " (the proxy thread is stuck or gone; UCCL_EP_TIMEOUT_S); results of that op are not valid");
  if (e.code == kBlocksNotResident)
    throw TimeoutError(
        where + "waited " + std::to_string(e.c) + " s for its own blocks: the op's " + std::to_string(e.a) +
        " blocks (UCCL_EP_NUM_SMS) never all ran at once on this GPU (other work holding its SMs, or "
        "a share of the GPU: MPS, a partition); lower UCCL_EP_NUM_SMS. Results of that op are not valid");
  throw std::runtime_error(where + "failed with device error code " + std::to_string(e.code));
}

}  // namespace uccl_ep::nvl

namespace uccl_ep::nvl {

NvlRuntime& NvlRuntime::get() {
  static NvlRuntime* runtime = new NvlRuntime();  // never destroyed: handlers may outlive static destructors
  return *runtime;
}

void NvlRuntime::start(size_t buffer_bytes, size_t low_latency_bytes, int num_ranks,
                       const std::vector<std::pair<int, int>>& local, const std::vector<int32_t>& global_of_local) {
  std::unique_lock<std::shared_mutex> lock(lifetime_);
  if (!devices_.empty()) throw std::runtime_error("uccl_ep nvl: already started");
  for (auto [ordinal, rank] : local) {
    devices_.push_back(std::make_unique<NvlDevice>(ordinal, rank, num_ranks, buffer_bytes, low_latency_bytes));
    devices_.back()->set_global_ranks(global_of_local);
  }
}

std::vector<std::pair<int, std::vector<uint8_t>>> NvlRuntime::ipc_handles() {
  std::shared_lock<std::shared_mutex> lock(lifetime_);
  std::vector<std::pair<int, std::vector<uint8_t>>> out;
  for (auto& d : devices_) out.emplace_back(d->rank(), d->ipc_handle());
  return out;
}

void NvlRuntime::connect(const std::vector<std::vector<uint8_t>>& handles_by_rank) {
  std::unique_lock<std::shared_mutex> lock(lifetime_);
  if (devices_.empty()) return;
  std::vector<NvlDevice*> same_process(devices_.front()->num_ranks(), nullptr);
  for (auto& d : devices_) same_process[d->rank()] = d.get();
  for (auto& d : devices_) d->connect(handles_by_rank, same_process);
  initialized_.store(true);
}

void NvlRuntime::shutdown() {
  std::unique_lock<std::shared_mutex> lock(lifetime_);
  initialized_.store(false);
  devices_.clear();
}

NvlDevice& NvlRuntime::device_by_ordinal(int ordinal) {
  if (!initialized_.load())
    throw std::runtime_error("uccl_ep: the runtime is not initialized; call jax_uccl_ep.initialize() first");
  for (auto& d : devices_)
    if (d->cuda_device() == ordinal) return *d;
  throw std::runtime_error("uccl_ep: no NVLink state for local GPU " + std::to_string(ordinal));
}

std::vector<NvlDevice*> NvlRuntime::devices() {
  std::vector<NvlDevice*> out;
  for (auto& d : devices_) out.push_back(d.get());
  return out;
}

void NvlRuntime::check_errors(const char* op) {
  std::exception_ptr first;
  std::string messages;
  for (auto* d : devices()) {
    cudaSetDevice(d->cuda_device());
    cudaDeviceSynchronize();
    try {
      d->check_errors(op);
    } catch (const std::exception& e) {
      if (!first) first = std::current_exception();
      messages += (messages.empty() ? "" : "; ") + std::string(e.what());
    }
  }
  if (!first) return;
  try {
    std::rethrow_exception(first);
  } catch (const TimeoutError&) {
    throw TimeoutError(messages);
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument(messages);
  } catch (const std::exception&) {
    throw std::runtime_error(messages);
  }
}

}  // namespace uccl_ep::nvl
