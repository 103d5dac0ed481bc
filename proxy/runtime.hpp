// The process-global proxy runtime: per local device a registered buffer, one command ring and one proxy
// thread per channel, and the receive counters that the ordering protocol publishes.
//
// Buffer layout (every rank identical, so senders compute remote offsets from their own layout):
//   [scratch: kScratchBytes][send staging: num_ranks regions][receive: num_ranks regions]
// Region r of the send staging holds what this rank sends to rank r; region s of the receive area holds
// what rank s sent here. A message is a run of writes into one region followed by a fence.
#pragma once
#include <any>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "errors.hpp"
#include "ordering.hpp"
#include "ring.hpp"
#include "transport.hpp"

namespace uccl_ep {

// Scratch: [0, 16) fence carriers, [1024, 2048) outgoing abort reason, [2048, 3072) incoming abort reason.
constexpr size_t kScratchBytes = 4096;
// Regions are whole pages of the buffer ((buffer - scratch) / (2 * ranks), rounded down to a page).
constexpr size_t kRegionPage = 4096;
// The UCCL_EP_BUFFER_BYTES whose regions hold `region_bytes` each, for `num_ranks` ranks: what an error advises.
inline uint64_t buffer_bytes_for_region(uint64_t region_bytes, uint32_t num_ranks) {
  return kScratchBytes + 2 * uint64_t(num_ranks) * ((region_bytes + kRegionPage - 1) / kRegionPage * kRegionPage);
}
constexpr size_t kAbortOutOffset = 1024;
constexpr size_t kAbortInOffset = 2048;
constexpr size_t kAbortReasonBytes = 1024;

// The proxy runtime's settings; jax_uccl_ep/config.py holds their defaults and fills every field.
struct Config {
  std::string providers;             // libfabric providers to try, in order
  int num_channels = 0;              // proxy threads (and rings, endpoints) per device
  size_t buffer_bytes = 0;           // registered bytes per device
  double timeout_s = 0;              // deadline of every wait on a peer
  uint32_t max_inflight_writes = 0;  // per channel
  uint32_t max_write_bytes = 0;
  uint64_t max_inflight_bytes = 0;  // per channel: posted, uncompleted bytes (0: no limit; one write always goes)
  uint32_t ring_capacity = 4096;    // commands per ring
  // A proxy thread idle this long sleeps until a host thread pushes or waits (0: it always polls). Only where every
  // producer and consumer is a host thread: a GPU pushing commands or waiting on the words rings no doorbell.
  double park_after_idle_s = 0;
};

// Test modes of the proxy threads: set only through the tests' extension (ffi/testing.cpp), never by the package.
// A device takes them when it is created.
struct ProxyTestModes {
  bool reorder = false;      // post writes out of order and late
  bool stuck_proxy = false;  // a proxy thread ignores stop(), as one stuck in libfabric would
};
ProxyTestModes& proxy_test_modes();

struct DeviceStats {
  uint64_t commands = 0;       // popped by the proxies
  uint64_t writes_posted = 0;  // fi_writedata calls that succeeded
  uint64_t bytes_posted = 0;
  uint64_t messages_received = 0;
  uint64_t peak_inflight_bytes = 0;       // the most posted, uncompleted bytes one channel had at once
  std::vector<uint64_t> bytes_posted_to;  // per peer rank: what crossed to it (to other nodes: the network)
};

class Device {
 public:
  Device(const Config& config, uint32_t rank, uint32_t num_ranks, int ordinal);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  uint32_t rank() const { return rank_; }
  uint32_t num_ranks() const { return num_ranks_; }
  int ordinal() const { return ordinal_; }
  int num_channels() const { return config_.num_channels; }
  double timeout_s() const { return config_.timeout_s; }
  uint32_t max_write_bytes() const { return config_.max_write_bytes; }
  // Whether this device failed on an abort a peer sent (rather than on a failure of its own).
  bool aborted_by_peer() const { return aborted_by_peer_.load(std::memory_order_acquire); }
  const std::string& provider() const { return fabric_->provider(); }
  const std::vector<std::string>& peer_shm_names() const { return fabric_->peer_shm_names(); }
  char* buffer() { return buffer_; }
  size_t buffer_bytes() const { return config_.buffer_bytes; }
  // Bytes of one send or receive region, and their offsets.
  size_t region_bytes() const { return region_bytes_; }
  size_t send_offset(uint32_t peer) const { return kScratchBytes + size_t(peer) * region_bytes_; }
  size_t recv_offset(uint32_t peer) const { return kScratchBytes + size_t(num_ranks_ + peer) * region_bytes_; }

  EndpointInfo local_info() const { return fabric_->local_info(); }
  void connect(const std::vector<EndpointInfo>& peers);
  // Stops and joins the proxy threads; the endpoints stay open until the Device is destroyed. A thread that
  // does not stop within `seconds` (stuck in libfabric on a lock a dead peer held) is left behind, and so are
  // the endpoints and buffer it may still touch; returns false then.
  bool stop(double seconds);

  // Producer side (one producer per device at a time: take op_mutex()).
  // Sends bytes [local_offset, +length) of this buffer to [remote_offset, +length) of peer's, as one message.
  void post_message(int channel, uint32_t peer, uint64_t local_offset, uint64_t remote_offset, uint64_t length,
                    const char* op);
  // Waits for (and consumes) the next message from `peer` on `channel`.
  void wait_message(int channel, uint32_t peer, const char* op);
  // Waits until every command pushed so far has completed locally (at most `seconds`, default the timeout).
  void quiet(const char* op, double seconds = -1);
  // For producers and consumers that are not host threads (GPU kernels): the words the proxies publish, in
  // host_alloc'd memory: messages from `peer` on `channel` whose every write has landed (a consumer waits for
  // its next count), and commands of `channel`'s ring completed locally (a quiet waits for the ring's head).
  const uint64_t* released_word(uint32_t peer, int channel) const {
    return released_->word(size_t(peer) * config_.num_channels + channel);
  }
  const uint64_t* retired_word(int channel) const { return retired_->word(size_t(channel)); }
  // Messages from `peer` on `channel` that wait_message() has consumed (a consumer that is not a host thread waits
  // for the released word to pass it, then calls wait_message() to keep the count in step). Guarded by op_mutex().
  uint64_t consumed(uint32_t peer, int channel) const {
    return consumed_[size_t(peer) * config_.num_channels + channel];
  }
  CommandRing& ring(int channel) { return *rings_[channel]; }
  // After an error that left this rank out of step with its peers: fail every later op here, and tell `peers`
  // so that they fail at once (naming this rank and `reason`) instead of waiting for their deadline.
  void abort(const std::vector<uint32_t>& peers, const std::string& reason);
  // Throws if an earlier failure left this device out of step; initialize() again to recover.
  void check_usable(const char* op);
  std::mutex& op_mutex() { return op_mutex_; }
  // Consumer-side protocol state: whether this rank still waits for `peer` to acknowledge (free its receive
  // region after) the last message sent to it. Guarded by op_mutex().
  bool& awaiting_ack(uint32_t peer) { return awaiting_ack_[peer]; }
  // A slot for whatever the device's user keeps between calls, opaque here; it lives and dies with the device.
  // Guarded by op_mutex().
  std::any& op_state() { return op_state_; }
  const std::any& op_state() const { return op_state_; }
  DeviceStats stats() const;
  // For timeout messages naming a peer in this process: host rounds (op halves) this device entered, and the
  // messages it handed its rings for `peer` on `channel`.
  void note_round_entered() { rounds_entered_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t rounds_entered() const { return rounds_entered_.load(std::memory_order_relaxed); }
  uint64_t messages_posted(uint32_t peer, int channel) const {
    return posted_[size_t(peer) * config_.num_channels + channel].load(std::memory_order_relaxed);
  }

 private:
  struct WriteContext {
    fi_context2 fi_ctx;  // first member: the provider's scratch space
    uint32_t peer;
    uint32_t index;
    uint32_t length;
  };
  struct Pending {
    Command cmd;
    uint32_t age;
  };
  void push(int channel, const Command& cmd, const Deadline& deadline, const char* op);
  // The one wait loop: backs off until done(), fails fast on a recorded failure (naming `peer`), and throws
  // TimeoutError(timeout_message()) past the deadline (plus a short grace for a peer's abort naming the cause).
  template <class Done, class Message>
  void wait_until(const Deadline& deadline, uint32_t peer, const char* op, Done&& done, Message&& timeout_message);
  void proxy_loop(int channel);
  // Sleeps until the doorbell rings (or a short timeout, to drain what peers sent meanwhile) unless a host thread
  // waits or the ring holds commands; returns whether it slept.
  bool park(int channel);
  void ring_doorbell();
  void post(int channel, const Command& cmd, std::vector<WriteContext>& contexts, std::vector<uint32_t>& free_list);
  int drain_completions(int channel, std::vector<WriteContext>& contexts, std::vector<uint32_t>& free_list);
  void fail(uint32_t peer, const std::string& message);
  // For a timeout's message: the peers whose process is gone (shm), or "".
  std::string exited_peers_note() const;
  // For a timeout's message: how far `peer` got, when it runs in this process, or "".
  std::string local_peer_note(uint32_t peer, int channel) const;
  void check_failed(uint32_t peer, const char* op);

  Config config_;
  const ProxyTestModes test_modes_;
  uint32_t rank_, num_ranks_;
  int ordinal_;
  char* buffer_ = nullptr;
  size_t region_bytes_ = 0;
  std::unique_ptr<FabricDevice> fabric_;
  std::vector<std::unique_ptr<CommandRing>> rings_;
  std::vector<std::thread> threads_;
  std::atomic<bool> running_{false};
  // The parked proxies' doorbell (a futex word), how many are parked, and how many host threads wait in
  // wait_until (the proxies stay awake for them).
  std::atomic<uint32_t> doorbell_{0};
  std::atomic<int> parked_{0}, host_waiters_{0};
  std::unique_ptr<std::atomic<bool>[]> exited_;             // per proxy thread
  bool abandoned_ = false;                                  // a proxy thread was left behind by stop()
  std::unique_ptr<std::atomic<int64_t>[]> inflight_;        // posted, uncompleted writes per peer
  std::unique_ptr<std::atomic<uint64_t>[]> stat_bytes_to_;  // posted bytes per peer
  std::unique_ptr<std::atomic<int64_t>[]> posting_;  // per channel: 1 + the peer of a write not yet posted, else 0
  std::unique_ptr<uint64_t[]> inflight_bytes_;       // posted, uncompleted bytes per channel (its proxy's own)
  std::unique_ptr<std::atomic<uint64_t>[]> peak_inflight_bytes_;  // per channel
  std::mutex op_mutex_;

  // Receive side: released_ is written by the proxy of each channel, read by consumers.
  std::unique_ptr<HostCounters> released_;  // [num_ranks * num_channels]
  std::vector<uint64_t> consumed_;          // consumer-owned, same shape
  std::unique_ptr<bool[]> awaiting_ack_;    // consumer-owned, [num_ranks]
  std::any op_state_;
  std::unique_ptr<HostCounters> retired_;     // commands completed, per channel
  std::vector<MessageSequencer> sequencers_;  // proxy-owned, [num_ranks * num_channels]
  std::vector<ArrivalCounter> arrivals_;      // proxy-owned, same shape

  std::atomic<bool> failed_{false};
  std::atomic<bool> aborted_by_peer_{false};
  mutable std::mutex failure_mutex_;
  std::vector<std::string> peer_failure_;  // per rank; "" when fine
  std::string failure_;                    // not tied to one peer

  std::atomic<uint64_t> stat_commands_{0}, stat_writes_{0}, stat_messages_{0};
  std::atomic<uint64_t> rounds_entered_{0};
  std::unique_ptr<std::atomic<uint64_t>[]> posted_;  // [num_ranks * num_channels]
};

// Process-global registry of the local devices. Handlers take `lock_shared()` for the duration of an op;
// shutdown takes the lock exclusively, so no op runs against freed state.
class Runtime {
 public:
  static Runtime& get();

  // Creates the local devices. `local` holds (device ordinal, global rank) pairs.
  void start(const Config& config, uint32_t num_ranks, const std::vector<std::pair<int, uint32_t>>& local);
  std::vector<std::vector<uint8_t>> local_infos();
  void connect(const std::vector<std::vector<uint8_t>>& all_infos);  // indexed by rank
  // Waits (at most `seconds`) for every local device's queued writes to complete; errors are ignored.
  void quiesce(double seconds);
  void shutdown();
  bool initialized() const { return initialized_.load(std::memory_order_acquire); }
  // Ranks of the job (0 before start()).
  uint32_t num_ranks() const { return num_ranks_.load(std::memory_order_acquire); }

  std::shared_mutex& lifetime_mutex() { return lifetime_; }
  // Looks up the device of an XLA device ordinal; throws with a clear message before initialize().
  Device& device_by_ordinal(int ordinal);
  Device& device_by_rank(uint32_t rank);
  // The device of `rank` if this process drives it, else null (callers hold lifetime_mutex()).
  const Device* local_device(uint32_t rank) const;

 private:
  std::shared_mutex lifetime_;
  std::atomic<bool> initialized_{false};
  std::atomic<uint32_t> num_ranks_{0};
  std::vector<std::unique_ptr<Device>> devices_;
};

}  // namespace uccl_ep
