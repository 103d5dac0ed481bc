// Ordering emulation with 32-bit immediates (the seeds' core idea).
//
// Two RMA writes may land in any order, so a receiver cannot take "a later write arrived" as proof that an
// earlier one did. Every write therefore carries an immediate naming its sender and its epoch (the message it
// belongs to); the write that ends a message (a fence) also carries how many data writes the message holds.
// The receiving proxy counts arrivals per (sender, channel, epoch) and publishes a message only when its fence
// and all of its data writes have landed, in epoch order. Nothing depends on the order of arrival.
//
// Immediate layout (fits EFA's and verbs' 4 bytes of CQ data):
//   bit 31      kind: 0 data, 1 fence
//   bits 30..21 sender rank (up to 1024 ranks)
//   bits 20..11 epoch modulo 1024 (messages in flight per sender and channel stay far below that)
//   bits 10..0  fence: data writes in the message (up to 2047); data: 0, or 2047 for an abort
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace uccl_ep {

constexpr uint32_t kMaxRanks = 1024;
constexpr uint32_t kEpochWindow = 1024;
constexpr uint32_t kMaxWritesPerMessage = 2047;
constexpr uint32_t kAbortMark = 0x7FF;  // in the count field of a data immediate

struct Immediate {
  bool fence;
  uint32_t sender;
  uint32_t epoch;  // modulo kEpochWindow
  uint32_t count;  // fence only

  uint32_t encode() const {
    return (uint32_t(fence) << 31) | ((sender & 0x3FFu) << 21) | ((epoch & 0x3FFu) << 11) | (count & 0x7FFu);
  }
  bool is_abort() const { return !fence && count == kAbortMark; }
  static Immediate abort(uint32_t sender) { return Immediate{false, sender, 0, kAbortMark}; }
  static Immediate decode(uint32_t v) {
    return Immediate{bool(v >> 31), (v >> 21) & 0x3FFu, (v >> 11) & 0x3FFu, v & 0x7FFu};
  }
};

// Sender side, one per (peer, channel): numbers messages and counts the writes in the open one.
class MessageSequencer {
 public:
  uint32_t data_imm(uint32_t self) {
    if (writes_ >= kMaxWritesPerMessage)
      throw std::runtime_error("uccl_ep: more than 2047 writes in one message; use larger writes");
    ++writes_;
    return Immediate{false, self, uint32_t(epoch_ % kEpochWindow), 0}.encode();
  }
  uint32_t fence_imm(uint32_t self) {
    uint32_t imm = Immediate{true, self, uint32_t(epoch_ % kEpochWindow), writes_}.encode();
    ++epoch_;
    writes_ = 0;
    return imm;
  }

 private:
  uint64_t epoch_ = 0;
  uint32_t writes_ = 0;
};

// Receiver side, one per (sender, channel), written by one proxy thread only. The words are atomics (relaxed,
// single writer) only so that a waiter that timed out may read them for its message.
class ArrivalCounter {
 public:
  ArrivalCounter() {
    for (auto& e : expected_) e.store(-1, std::memory_order_relaxed);
    for (auto& l : landed_) l.store(0, std::memory_order_relaxed);
  }

  void on_data(uint32_t epoch) { bump(landed_[epoch % kEpochWindow]); }
  void on_fence(uint32_t epoch, uint32_t count) {
    std::atomic<int32_t>& e = expected_[epoch % kEpochWindow];
    if (e.load(std::memory_order_relaxed) >= 0)
      throw std::runtime_error("uccl_ep: two fences for one epoch (more than 1024 messages in flight?)");
    e.store(int32_t(count), std::memory_order_relaxed);
  }
  // Releases every complete message in epoch order; returns how many were released.
  uint32_t release() {
    uint32_t n = 0;
    for (;;) {
      const uint64_t next = next_.load(std::memory_order_relaxed);
      const uint32_t slot = next % kEpochWindow;
      const int32_t expected = expected_[slot].load(std::memory_order_relaxed);
      const uint32_t landed = landed_[slot].load(std::memory_order_relaxed);
      if (expected < 0 || landed < uint32_t(expected)) break;
      if (landed > uint32_t(expected))
        throw std::runtime_error("uccl_ep: more data writes landed than the fence announced (epoch " +
                                 std::to_string(slot) + ")");
      expected_[slot].store(-1, std::memory_order_relaxed);
      landed_[slot].store(0, std::memory_order_relaxed);
      next_.store(next + 1, std::memory_order_relaxed);
      ++n;
    }
    return n;
  }
  // For a timeout's message (read from another thread: a snapshot, maybe torn): the oldest unreleased message and
  // what of it landed, which tells a lost fence from lost data writes from nothing sent.
  std::string describe() const {
    const uint64_t next = next_.load(std::memory_order_relaxed);
    const int32_t expected = expected_[next % kEpochWindow].load(std::memory_order_relaxed);
    const uint32_t landed = landed_[next % kEpochWindow].load(std::memory_order_relaxed);
    const uint32_t later = landed_[(next + 1) % kEpochWindow].load(std::memory_order_relaxed);
    return "message " + std::to_string(next + 1) + ": " +
           (expected < 0 ? std::string("no fence yet") : "fence announcing " + std::to_string(expected) + " writes") +
           ", " + std::to_string(landed) + " data writes landed (" + std::to_string(later) + " of the next message)";
  }

 private:
  static void bump(std::atomic<uint32_t>& w) {
    w.store(w.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  std::array<std::atomic<int32_t>, kEpochWindow> expected_;
  std::array<std::atomic<uint32_t>, kEpochWindow> landed_;
  std::atomic<uint64_t> next_{0};
};

}  // namespace uccl_ep
