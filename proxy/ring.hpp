// Lock-free single-producer/single-consumer ring of Commands.
// The producer owns `head`, the consumer owns `tail`; each publishes its index with release
// semantics and reads the other's with acquire, so a popped slot is always fully written.
// The storage may live in pinned host memory that a GPU writes (the layout is plain).
#pragma once
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <stdexcept>

#include "command.hpp"
#include "host_memory.hpp"

namespace uccl_ep {

class CommandRing {
 public:
  explicit CommandRing(uint32_t capacity_pow2) : mask_(capacity_pow2 - 1) {
    if (capacity_pow2 == 0 || (capacity_pow2 & mask_) != 0)
      throw std::invalid_argument("CommandRing capacity must be a power of two");
    slots_ = static_cast<Command*>(host_alloc(sizeof(Command) * capacity_pow2));
  }
  ~CommandRing() { host_free(slots_); }
  CommandRing(const CommandRing&) = delete;
  CommandRing& operator=(const CommandRing&) = delete;

  uint32_t capacity() const { return mask_ + 1; }

  // Producer side. Returns false when full: the caller backs off, it never overwrites.
  bool try_push(const Command& cmd) {
    uint64_t head = head_.load(std::memory_order_relaxed);
    if (head - tail_cache_ > mask_) {
      tail_cache_ = tail_.load(std::memory_order_acquire);
      if (head - tail_cache_ > mask_) return false;
    }
    slots_[head & mask_] = cmd;
    head_.store(head + 1, std::memory_order_release);
    return true;
  }

  // Consumer side. Returns false when empty.
  bool try_pop(Command* out) {
    uint64_t tail = tail_.load(std::memory_order_relaxed);
    if (tail == head_cache_) {
      head_cache_ = head_.load(std::memory_order_acquire);
      if (tail == head_cache_) return false;
    }
    *out = slots_[tail & mask_];
    tail_.store(tail + 1, std::memory_order_release);
    return true;
  }

  bool empty() const {
    return head_.load(std::memory_order_acquire) == tail_.load(std::memory_order_acquire);
  }
  uint64_t pushed() const { return head_.load(std::memory_order_acquire); }
  uint64_t popped() const { return tail_.load(std::memory_order_acquire); }

 private:
  const uint32_t mask_;
  Command* slots_ = nullptr;
  alignas(64) std::atomic<uint64_t> head_{0};
  uint64_t tail_cache_ = 0;  // producer's view of tail
  alignas(64) std::atomic<uint64_t> tail_{0};
  uint64_t head_cache_ = 0;  // consumer's view of head
};

}  // namespace uccl_ep
