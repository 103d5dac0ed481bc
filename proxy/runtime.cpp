#include "runtime.hpp"

#include <sched.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <thread>

namespace uccl_ep {

void Backoff::pause() {
  ++spins_;
  if (spins_ < 64) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  } else if (spins_ < 256) {
    sched_yield();
  } else {
    timespec ts{0, 20000};  // 20 us: cheap enough for CPU peers, frees the core for the proxies
    nanosleep(&ts, nullptr);
  }
}

namespace {

// A parked proxy wakes this often anyway, to drain completions and peers' writes (an abort among them) that arrived
// while no host thread waited.
constexpr long kParkTimeoutNs = 5'000'000;

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen) {
#if defined(__linux__)
  timespec ts{0, kParkTimeoutNs};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, seen, &ts, nullptr, 0);
#else
  (void)word;
  (void)seen;
  timespec ts{0, kParkTimeoutNs};
  nanosleep(&ts, nullptr);
#endif
}

void futex_wake_all(std::atomic<uint32_t>* word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

}  // namespace

ProxyTestModes& proxy_test_modes() {
  static ProxyTestModes modes;
  return modes;
}

Device::Device(const Config& config, uint32_t rank, uint32_t num_ranks, int ordinal)
    : config_(config), test_modes_(proxy_test_modes()), rank_(rank), num_ranks_(num_ranks), ordinal_(ordinal) {
  if (num_ranks == 0 || num_ranks > kMaxRanks)
    throw InvalidArgument("uccl_ep: number of ranks must be in [1, " + std::to_string(kMaxRanks) + "], got " +
                          std::to_string(num_ranks));
  if (config_.num_channels < 1 || config_.num_channels > 64)
    throw InvalidArgument("uccl_ep: UCCL_EP_NUM_PROXY_THREADS must be in [1, 64]");
  if (config_.buffer_bytes > kOffsetMask)  // offsets travel through the rings in 48 bits
    throw InvalidArgument("uccl_ep: UCCL_EP_BUFFER_BYTES=" + std::to_string(config_.buffer_bytes) +
                          " is above 2^48 bytes");
  if (config_.buffer_bytes < buffer_bytes_for_region(1, num_ranks))
    throw InvalidArgument("uccl_ep: UCCL_EP_BUFFER_BYTES=" + std::to_string(config_.buffer_bytes) +
                          " is too small for " + std::to_string(num_ranks) + " ranks");
  const size_t page = kRegionPage;
  region_bytes_ = ((config_.buffer_bytes - kScratchBytes) / (2 * size_t(num_ranks))) / page * page;
  buffer_ = static_cast<char*>(host_alloc((config_.buffer_bytes + page - 1) / page * page));
  std::memset(buffer_, 0, config_.buffer_bytes);
  try {
    fabric_ =
        std::make_unique<FabricDevice>(config_.providers, rank, buffer_, config_.buffer_bytes, config_.num_channels);
  } catch (...) {
    host_free(buffer_);
    throw;
  }
  size_t slots = size_t(num_ranks) * config_.num_channels;
  released_ = std::make_unique<HostCounters>(slots);
  consumed_.assign(slots, 0);
  awaiting_ack_.reset(new bool[num_ranks]());
  inflight_.reset(new std::atomic<int64_t>[num_ranks]);
  for (uint32_t p = 0; p < num_ranks; ++p) inflight_[p].store(0);
  stat_bytes_to_.reset(new std::atomic<uint64_t>[num_ranks]);
  for (uint32_t p = 0; p < num_ranks; ++p) stat_bytes_to_[p].store(0);
  posting_.reset(new std::atomic<int64_t>[config_.num_channels]);
  for (int c = 0; c < config_.num_channels; ++c) posting_[c].store(0);
  exited_.reset(new std::atomic<bool>[config_.num_channels]);
  for (int c = 0; c < config_.num_channels; ++c) exited_[c].store(false);
  retired_ = std::make_unique<HostCounters>(size_t(config_.num_channels));
  inflight_bytes_.reset(new uint64_t[config_.num_channels]());
  peak_inflight_bytes_.reset(new std::atomic<uint64_t>[config_.num_channels]);
  for (int c = 0; c < config_.num_channels; ++c) peak_inflight_bytes_[c].store(0);
  posted_.reset(new std::atomic<uint64_t>[slots]);
  for (size_t i = 0; i < slots; ++i) posted_[i].store(0);
  sequencers_.resize(slots);
  arrivals_ = std::vector<ArrivalCounter>(slots);  // not movable: built in place
  peer_failure_.assign(num_ranks, "");
  for (int c = 0; c < config_.num_channels; ++c) rings_.push_back(std::make_unique<CommandRing>(config_.ring_capacity));
}

bool Device::stop(double seconds) {
  running_.store(false);
  ring_doorbell();
  Deadline deadline(seconds);
  Backoff backoff;
  for (size_t c = 0; c < threads_.size(); ++c) {
    while (!exited_[c].load(std::memory_order_acquire) && !deadline.expired()) backoff.pause();
    if (exited_[c].load(std::memory_order_acquire)) {
      threads_[c].join();
    } else {
      threads_[c].detach();
      abandoned_ = true;
    }
  }
  threads_.clear();
  return !abandoned_;
}

Device::~Device() {
  stop(config_.timeout_s);
  if (abandoned_) return;  // a stuck proxy may still use the endpoints and the buffer: leak them, do not hang
  fabric_.reset();
  host_free(buffer_);
}

void Device::connect(const std::vector<EndpointInfo>& peers) {
  fabric_->connect(peers);
  running_.store(true);
  for (int c = 0; c < config_.num_channels; ++c) threads_.emplace_back([this, c] { proxy_loop(c); });
}

template <class Done, class Message>
void Device::wait_until(const Deadline& deadline, uint32_t peer, const char* op, Done&& done,
                        Message&& timeout_message) {
  // The proxies stay awake while a host thread waits (its commands, its peers' messages, its writes' completions).
  struct Waiting {
    Device& device;
    explicit Waiting(Device& d) : device(d) {
      device.host_waiters_.fetch_add(1);
      device.ring_doorbell();
    }
    ~Waiting() { device.host_waiters_.fetch_sub(1); }
  } waiting{*this};
  Backoff backoff;
  std::optional<Deadline> grace;
  while (!done()) {
    if (failed_.load(std::memory_order_relaxed)) check_failed(peer, op);
    if (deadline.expired()) {
      // `peer` may itself be stuck on the rank that actually died, a moment from telling us so (its abort names
      // that rank): give its notice a short grace before blaming `peer`.
      if (!grace) grace.emplace(std::min(1.0, deadline.seconds() / 5));
      if (grace->expired()) throw TimeoutError(timeout_message() + exited_peers_note());
    }
    backoff.pause();
  }
}

std::string Device::local_peer_note(uint32_t peer, int channel) const {
  const Device* d = Runtime::get().local_device(peer);
  if (!d) return "";
  return "; rank " + std::to_string(peer) + " runs in this process: it entered " + std::to_string(d->rounds_entered()) +
         " host rounds (this rank " + std::to_string(rounds_entered()) + ") and handed its proxy " +
         std::to_string(d->messages_posted(rank_, channel)) + " messages for this rank on this channel";
}

std::string Device::exited_peers_note() const {
  // A peer stuck on the rank that died (waiting for its rows, or a proxy spinning on the dead process's shm lock)
  // may be the one that did not answer: name the rank whose process is gone too, where we can see it (one host).
  std::string ranks;
  for (uint32_t r : fabric_->exited_local_peers()) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  return ranks.empty() ? "" : "; rank(s) " + ranks + " exited (process gone), likely the cause";
}

void Device::push(int channel, const Command& cmd, const Deadline& deadline, const char* op) {
  wait_until(
      deadline, cmd.peer, op, [&] { return rings_[channel]->try_push(cmd); },
      [&] {
        return std::string("uccl_ep ") + op + ": rank " + std::to_string(rank_) + " timed out after " +
               std::to_string(deadline.seconds()) + " s with the command ring of channel " + std::to_string(channel) +
               " full (rank " + std::to_string(cmd.peer) + " is not draining writes; UCCL_EP_TIMEOUT_S)";
      });
}

void Device::post_message(int channel, uint32_t peer, uint64_t local_offset, uint64_t remote_offset, uint64_t length,
                          const char* op) {
  if (peer >= num_ranks_) throw InvalidArgument(std::string("uccl_ep ") + op + ": no rank " + std::to_string(peer));
  if (channel < 0 || channel >= config_.num_channels)
    throw InvalidArgument(std::string("uccl_ep ") + op + ": no channel " + std::to_string(channel));
  if (local_offset + length > config_.buffer_bytes || remote_offset + length > config_.buffer_bytes)
    throw InvalidArgument(std::string("uccl_ep ") + op + ": message of " + std::to_string(length) +
                          " bytes does not fit the communication buffer");
  if (peer == rank_) {
    // To self: a copy, published the same way an incoming message is.
    std::memmove(buffer_ + remote_offset, buffer_ + local_offset, length);
    (*released_)[size_t(peer) * config_.num_channels + channel].fetch_add(1, std::memory_order_release);
    return;
  }
  Deadline deadline(config_.timeout_s);
  uint64_t chunk =
      std::max<uint64_t>(config_.max_write_bytes, (length + kMaxWritesPerMessage - 2) / (kMaxWritesPerMessage - 1));
  for (uint64_t done = 0; done < length; done += chunk) {
    uint32_t n = uint32_t(std::min(chunk, length - done));
    push(channel, Command{Op::kWrite, 0, 0, peer, local_offset + done, remote_offset + done, n, 0}, deadline, op);
  }
  push(channel, message_fence(peer), deadline, op);
  posted_[size_t(peer) * config_.num_channels + channel].fetch_add(1, std::memory_order_relaxed);
}

void Device::wait_message(int channel, uint32_t peer, const char* op) {
  size_t slot = size_t(peer) * config_.num_channels + channel;
  uint64_t want = consumed_[slot] + 1;
  Deadline deadline(config_.timeout_s);
  wait_until(
      deadline, peer, op, [&] { return (*released_)[slot].load(std::memory_order_acquire) >= want; },
      [&] {
        return std::string("uccl_ep ") + op + ": rank " + std::to_string(rank_) + " timed out after " +
               std::to_string(deadline.seconds()) + " s waiting for rank " + std::to_string(peer) + " (channel " +
               std::to_string(channel) +
               "): the peer did not arrive (dead, hung, or running a different op; UCCL_EP_TIMEOUT_S) [waiting for "
               "its " +
               arrivals_[slot].describe() + "]" + local_peer_note(peer, channel);
      });
  consumed_[slot] = want;
}

void Device::quiet(const char* op, double seconds) {
  Deadline deadline(seconds < 0 ? config_.timeout_s : seconds);
  for (int c = 0; c < config_.num_channels; ++c) {
    wait_until(
        deadline, rank_, op, [&] { return (*retired_)[c].load(std::memory_order_acquire) >= rings_[c]->pushed(); },
        [&] {
          std::string peers;
          for (uint32_t p = 0; p < num_ranks_; ++p)
            if (inflight_[p].load() > 0) peers += (peers.empty() ? "" : ", ") + std::to_string(p);
          // Nothing posted and uncompleted: the proxy may still be trying to post to a peer that went away.
          const int64_t posting = posting_[c].load();
          if (peers.empty() && posting > 0) peers = std::to_string(posting - 1);
          return std::string("uccl_ep ") + op + ": rank " + std::to_string(rank_) + " timed out after " +
                 std::to_string(deadline.seconds()) + " s waiting for its writes on channel " + std::to_string(c) +
                 " to complete; rank(s) " + (peers.empty() ? "?" : peers) +
                 " did not take them (dead or hung; UCCL_EP_TIMEOUT_S)";
        });
  }
}

void Device::abort(const std::vector<uint32_t>& peers, const std::string& reason) {
  fail(num_ranks_, reason);
  // [author rank: 4 bytes][text, NUL-terminated]: every sender writes the same slot of a peer, so the reader names
  // the rank that wrote the text it finds (another abort may have landed over the one its immediate announced).
  size_t n = std::min(reason.size(), kAbortReasonBytes - 5);
  std::memcpy(buffer_ + kAbortOutOffset, &rank_, 4);
  std::memcpy(buffer_ + kAbortOutOffset + 4, reason.data(), n);
  buffer_[kAbortOutOffset + 4 + n] = '\0';
  n += 4;
  Deadline deadline(1.0);  // best effort: a full ring to a dead peer must not delay the error
  for (uint32_t peer : peers) {
    if (peer == rank_ || peer >= num_ranks_) continue;
    Command cmd{Op::kAbort, 0, 0, peer, kAbortOutOffset, kAbortInOffset, uint32_t(n + 1), 0};
    Backoff backoff;
    while (!rings_[0]->try_push(cmd) && !deadline.expired()) backoff.pause();
  }
  ring_doorbell();
}

void Device::ring_doorbell() {
  // Sequentially consistent with park(): either a parking proxy sees the count move (or a waiter, or the command)
  // and does not sleep, or this sees it parked and wakes it.
  doorbell_.fetch_add(1);
  if (parked_.load() > 0) futex_wake_all(&doorbell_);
}

bool Device::park(int channel) {
  parked_.fetch_add(1);
  const uint32_t seen = doorbell_.load();
  const bool sleeps = host_waiters_.load() == 0 && rings_[channel]->empty() && running_.load();
  if (sleeps) futex_wait(&doorbell_, seen);
  parked_.fetch_sub(1);
  return sleeps;
}

void Device::check_usable(const char* op) {
  if (!failed_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(failure_mutex_);
  std::string cause = failure_;
  for (uint32_t p = 0; cause.empty() && p < num_ranks_; ++p)
    if (!peer_failure_[p].empty()) cause = "transport error with rank " + std::to_string(p) + ": " + peer_failure_[p];
  throw Error(std::string("uccl_ep ") + op + ": rank " + std::to_string(rank_) +
              " is out of step with its peers after an earlier failure (" + cause +
              "); call jax_uccl_ep.shutdown() and jax_uccl_ep.initialize() to reset");
}

void Device::fail(uint32_t peer, const std::string& message) {
  std::lock_guard<std::mutex> lock(failure_mutex_);
  if (peer < num_ranks_) {
    if (peer_failure_[peer].empty()) peer_failure_[peer] = message;
  } else if (failure_.empty()) {
    failure_ = message;
  }
  failed_.store(true, std::memory_order_release);
}

void Device::check_failed(uint32_t peer, const char* op) {
  std::lock_guard<std::mutex> lock(failure_mutex_);
  std::string prefix = std::string("uccl_ep ") + op + ": rank " + std::to_string(rank_) + ": ";
  if (peer < num_ranks_ && !peer_failure_[peer].empty())
    throw Error(prefix + "transport error with rank " + std::to_string(peer) + ": " + peer_failure_[peer]);
  if (!failure_.empty()) throw Error(prefix + failure_);
}

DeviceStats Device::stats() const {
  uint64_t peak = 0;
  for (int c = 0; c < config_.num_channels; ++c) peak = std::max(peak, peak_inflight_bytes_[c].load());
  DeviceStats s{stat_commands_.load(), stat_writes_.load(), 0, stat_messages_.load(), peak, {}};
  for (uint32_t p = 0; p < num_ranks_; ++p) {
    s.bytes_posted_to.push_back(stat_bytes_to_[p].load());
    s.bytes_posted += s.bytes_posted_to.back();
  }
  return s;
}

void Device::post(int channel, const Command& cmd, std::vector<WriteContext>& contexts,
                  std::vector<uint32_t>& free_list) {
  Backoff backoff;
  posting_[channel].store(int64_t(cmd.peer) + 1, std::memory_order_relaxed);
  struct Posted {
    std::atomic<int64_t>& word;
    ~Posted() { word.store(0, std::memory_order_relaxed); }
  } posted{posting_[channel]};
  uint64_t& inflight_bytes = inflight_bytes_[channel];
  const uint64_t cap = config_.max_inflight_bytes;
  // A provider that keeps refusing one write (FI_EAGAIN) is stuck below us, not slow: say so once on stderr, since
  // the peers only see a message that never arrives.
  std::optional<Deadline> refused;
  bool warned = false;
  uint32_t slow_retries = 0;
  for (;;) {
    // Under the byte cap (UCCL_EP_MAX_INFLIGHT_BYTES), or nothing in flight: a write larger than the cap still goes.
    const bool room = cap == 0 || inflight_bytes == 0 || inflight_bytes + cmd.length <= cap;
    if (room && !free_list.empty()) {
      WriteContext& ctx = contexts[free_list.back()];
      ctx.peer = cmd.peer;
      ctx.length = cmd.length;
      if (fabric_->post_write(channel, cmd.peer, cmd.local_offset, cmd.remote_offset, cmd.length, cmd.imm, &ctx)) {
        free_list.pop_back();
        inflight_bytes += cmd.length;
        if (inflight_bytes > peak_inflight_bytes_[channel].load(std::memory_order_relaxed))
          peak_inflight_bytes_[channel].store(inflight_bytes, std::memory_order_relaxed);
        inflight_[cmd.peer].fetch_add(1, std::memory_order_relaxed);
        stat_writes_.fetch_add(1, std::memory_order_relaxed);
        stat_bytes_to_[cmd.peer].fetch_add(cmd.length, std::memory_order_relaxed);
        if (warned)
          std::fprintf(stderr, "uccl_ep: rank %u, proxy thread of channel %d: the write to rank %u went through\n",
                       rank_, channel, cmd.peer);
        return;
      }
      if (!refused) refused.emplace(std::min(10.0, config_.timeout_s / 4));
      if (!warned && refused->expired()) {
        warned = true;
        std::fprintf(stderr,
                     "uccl_ep: rank %u, proxy thread of channel %d: %s has refused a %u-byte write to rank %u "
                     "(FI_EAGAIN) for %.1f s; still retrying\n",
                     rank_, channel, fabric_->provider().c_str(), cmd.length, cmd.peer, refused->seconds());
      }
    }
    // Out of contexts or bytes, or the provider asked to retry: make progress, then try again. A write refused
    // for long waits for the peer's proxy to drain its queue: past ~1000 retries, retry every 0.5 ms instead of
    // spinning (two such threads were seen using both cores of a 2-core machine while the peer process's proxy
    // threads, runnable, got ~1 ms of CPU in 20 s; see docs/RELIABILITY.md).
    if (drain_completions(channel, contexts, free_list) == 0) {
      if (refused && ++slow_retries > 1000)
        std::this_thread::sleep_for(std::chrono::microseconds(500));
      else
        backoff.pause();
    }
    if (!running_.load(std::memory_order_relaxed)) return;
  }
}

int Device::drain_completions(int channel, std::vector<WriteContext>& contexts, std::vector<uint32_t>& free_list) {
  Completion comps[64];
  std::string error;
  void* error_ctx = nullptr;
  int n = fabric_->poll(channel, comps, 64, &error, &error_ctx);
  if (n < 0) {
    // Contexts are ours only when they point into our table.
    auto* ctx = static_cast<WriteContext*>(error_ctx);
    bool ours = ctx >= contexts.data() && ctx < contexts.data() + contexts.size();
    fail(ours ? ctx->peer : num_ranks_, ours ? error
                                             : "transport error on channel " + std::to_string(channel) +
                                                   " (the failed operation names no peer): " + error +
                                                   exited_peers_note());
    if (ours) {
      free_list.push_back(ctx->index);
      inflight_bytes_[channel] -= ctx->length;
      inflight_[ctx->peer].fetch_sub(1, std::memory_order_relaxed);
      (*retired_)[channel].fetch_add(1, std::memory_order_release);
    }
    return 1;
  }
  for (int i = 0; i < n; ++i) {
    if (comps[i].remote_data) {
      Immediate imm = Immediate::decode(comps[i].imm);
      if (imm.sender >= num_ranks_) {
        fail(num_ranks_, "immediate names rank " + std::to_string(imm.sender) + " of " + std::to_string(num_ranks_));
        continue;
      }
      if (imm.is_abort()) {
        uint32_t author;
        std::memcpy(&author, buffer_ + kAbortInOffset, 4);
        const char* text = buffer_ + kAbortInOffset + 4;
        aborted_by_peer_.store(true, std::memory_order_release);
        fail(num_ranks_, "rank " + std::to_string(author < num_ranks_ ? author : imm.sender) +
                             " aborted: " + std::string(text, strnlen(text, kAbortReasonBytes - 4)));
        continue;
      }
      size_t slot = size_t(imm.sender) * config_.num_channels + channel;
      try {
        if (imm.fence)
          arrivals_[slot].on_fence(imm.epoch, imm.count);
        else
          arrivals_[slot].on_data(imm.epoch);
        uint32_t released = arrivals_[slot].release();
        if (released) {
          (*released_)[slot].fetch_add(released, std::memory_order_release);
          stat_messages_.fetch_add(released, std::memory_order_relaxed);
        }
      } catch (const std::exception& e) {
        fail(imm.sender, e.what());
      }
    } else if (comps[i].context) {
      auto* ctx = static_cast<WriteContext*>(comps[i].context);
      free_list.push_back(ctx->index);
      inflight_bytes_[channel] -= ctx->length;
      inflight_[ctx->peer].fetch_sub(1, std::memory_order_relaxed);
      (*retired_)[channel].fetch_add(1, std::memory_order_release);
    }
  }
  return n;
}

void Device::proxy_loop(int channel) {
  std::vector<WriteContext> contexts(config_.max_inflight_writes);
  std::vector<uint32_t> free_list;
  for (uint32_t i = 0; i < contexts.size(); ++i) {
    contexts[i].index = i;
    free_list.push_back(contexts.size() - 1 - i);
  }
  std::vector<Pending> held;  // reorder mode only
  std::mt19937 rng(1234567u + rank_ * 131u + channel);
  CommandRing& ring = *rings_[channel];
  Backoff idle;
  std::optional<Deadline> idle_for;  // since the last work, where parking is on
  try {
    while (running_.load(std::memory_order_relaxed)) {
      bool busy = false;
      Command cmd;
      for (int i = 0; i < 64 && ring.try_pop(&cmd); ++i) {
        busy = true;
        stat_commands_.fetch_add(1, std::memory_order_relaxed);
        // Immediates are assigned in ring order; only posting may be reordered.
        MessageSequencer& seq = sequencers_[size_t(cmd.peer) * config_.num_channels + channel];
        if (cmd.op == Op::kAbort)
          cmd.imm = Immediate::abort(rank_).encode();
        else
          cmd.imm = cmd.op == Op::kFence ? seq.fence_imm(rank_) : seq.data_imm(rank_);
        if (test_modes_.reorder)
          held.push_back(Pending{cmd, 0});
        else
          post(channel, cmd, contexts, free_list);
      }
      if (!held.empty()) {
        // Test mode: post a random subset in random order; hold the rest a few rounds longer.
        std::shuffle(held.begin(), held.end(), rng);
        std::vector<Pending> keep;
        for (auto& p : held) {
          if (p.age >= 4 || (rng() & 1))
            post(channel, p.cmd, contexts, free_list);
          else
            keep.push_back(Pending{p.cmd, p.age + 1});
        }
        held.swap(keep);
        busy = true;
      }
      if (drain_completions(channel, contexts, free_list) > 0) busy = true;
      if (busy) {
        idle.reset();
        idle_for.reset();
      } else {
        if (config_.park_after_idle_s > 0 && !idle_for) idle_for.emplace(config_.park_after_idle_s);
        if (!(idle_for && idle_for->expired() && park(channel))) idle.pause();  // parks only where it may sleep
      }
    }
  } catch (const std::exception& e) {
    fail(num_ranks_, std::string("proxy thread of channel ") + std::to_string(channel) + " stopped: " + e.what());
  }
  // Test mode: behave like a thread stuck in libfabric after a peer died, still touching the device now and then,
  // so that shutdown's abandon path runs (tests/test_reliability.py).
  if (test_modes_.stuck_proxy)
    for (;;) {
      volatile uint64_t seen = ring.slots()[0].words[0];  // the slots are freed with the ring
      (void)seen;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  exited_[channel].store(true, std::memory_order_release);
}

Runtime& Runtime::get() {
  static Runtime* runtime = new Runtime();  // never destroyed: handlers may outlive static destructors
  return *runtime;
}

void Runtime::start(const Config& config, uint32_t num_ranks, const std::vector<std::pair<int, uint32_t>>& local) {
  std::unique_lock<std::shared_mutex> lock(lifetime_);
  if (initialized_.load() || !devices_.empty()) throw Error("uccl_ep: runtime already started");
  if (config.providers.find("shm") != std::string::npos) remove_stale_shm_segments();  // none of ours is open now
  std::vector<std::unique_ptr<Device>> devices;
  for (auto [ordinal, rank] : local) devices.push_back(std::make_unique<Device>(config, rank, num_ranks, ordinal));
  devices_ = std::move(devices);
  num_ranks_.store(num_ranks, std::memory_order_release);
}

std::vector<std::vector<uint8_t>> Runtime::local_infos() {
  std::shared_lock<std::shared_mutex> lock(lifetime_);
  std::vector<std::vector<uint8_t>> out;
  for (auto& d : devices_) out.push_back(d->local_info().serialize());
  return out;
}

void Runtime::connect(const std::vector<std::vector<uint8_t>>& all_infos) {
  std::unique_lock<std::shared_mutex> lock(lifetime_);
  std::vector<EndpointInfo> peers;
  for (size_t r = 0; r < all_infos.size(); ++r) {
    peers.push_back(EndpointInfo::deserialize(all_infos[r]));
    if (peers.back().rank != r) throw Error("uccl_ep bootstrap: endpoint info out of rank order");
  }
  for (auto& d : devices_) {
    if (peers.size() != d->num_ranks()) throw Error("uccl_ep bootstrap: wrong number of endpoint infos");
    d->connect(peers);
  }
  initialized_.store(true, std::memory_order_release);
}

void Runtime::quiesce(double seconds) {
  std::shared_lock<std::shared_mutex> lock(lifetime_);
  for (auto& d : devices_) {
    try {
      std::lock_guard<std::mutex> op_lock(d->op_mutex());
      d->quiet("shutdown", std::min(d->timeout_s(), seconds));
    } catch (const std::exception&) {
      // A dead peer's writes never complete; shut down regardless.
    }
  }
}

void Runtime::shutdown() {
  // Three phases, because devices write into each other's endpoints: let queued writes (the last acks)
  // finish, stop every proxy, and only then close endpoints and free buffers.
  quiesce(5.0);
  std::unique_lock<std::shared_mutex> lock(lifetime_);
  initialized_.store(false, std::memory_order_release);
  std::vector<std::string> peer_shm_names;
  for (auto& d : devices_)
    peer_shm_names.insert(peer_shm_names.end(), d->peer_shm_names().begin(), d->peer_shm_names().end());
  bool abandoned = false;
  for (auto& d : devices_)
    if (!d->stop(std::min(d->timeout_s(), 5.0))) {
      std::fprintf(stderr,
                   "uccl_ep shutdown: a proxy thread of rank %u did not stop (stuck in libfabric, most likely on a "
                   "lock a dead peer held); it and its endpoints are left behind\n",
                   d->rank());
      // The stuck thread still uses the whole device (rings, endpoints, buffer): destroying any of it would let
      // that thread touch freed memory, and closing the endpoints can block on the same lock. Leak it whole.
      (void)d.release();
      abandoned = true;
    }
  devices_.clear();
  // Leaked endpoints are never closed, so libfabric would not unlink their shared-memory names: unlink them (the
  // mappings stay valid for the stuck thread).
  if (abandoned) remove_stale_shm_segments();
  // A peer that was killed never unlinked its names either.
  remove_dead_peers_shm_segments(peer_shm_names);
}

Device& Runtime::device_by_ordinal(int ordinal) {
  if (!initialized()) throw Error("uccl_ep: the runtime is not initialized; call jax_uccl_ep.initialize() first");
  for (auto& d : devices_)
    if (d->ordinal() == ordinal) return *d;
  throw Error("uccl_ep: no runtime state for local device ordinal " + std::to_string(ordinal));
}

const Device* Runtime::local_device(uint32_t rank) const {
  for (const auto& d : devices_)
    if (d->rank() == rank) return d.get();
  return nullptr;
}

Device& Runtime::device_by_rank(uint32_t rank) {
  if (!initialized()) throw Error("uccl_ep: the runtime is not initialized; call jax_uccl_ep.initialize() first");
  for (auto& d : devices_)
    if (d->rank() == rank) return *d;
  throw Error("uccl_ep: rank " + std::to_string(rank) + " is not a local device of this process");
}

}  // namespace uccl_ep
