// Lock-free single-producer/single-consumer ring of Commands.
// The producer owns `head`, the consumer owns `tail`; each publishes its index with release
// semantics and reads the other's with acquire, so a popped slot is always fully written.
// Slots and both indices live in host_alloc'd memory (pinned and mapped into the GPUs when a CUDA build installed
// that allocator), so the producer may be a GPU warp: slots(), head_word() and tail_word() are plain addresses,
// and a device producer follows the same protocol (write slots, fence, publish head; read tail before reuse).
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
    void* words = host_alloc(sizeof(Indices));
    if (!slots_ || !words) {
      if (slots_) host_free(slots_);
      if (words) host_free(words);
      throw std::bad_alloc();
    }
    indices_ = new (words) Indices();
  }
  ~CommandRing() {
    indices_->~Indices();
    host_free(indices_);
    host_free(slots_);
  }
  CommandRing(const CommandRing&) = delete;
  CommandRing& operator=(const CommandRing&) = delete;

  uint32_t capacity() const { return mask_ + 1; }
  // For device producers: the slot array and the two 64-bit indices, in mapped host memory.
  Command* slots() const { return slots_; }
  uint64_t* head_word() const { return reinterpret_cast<uint64_t*>(&indices_->head); }
  const uint64_t* tail_word() const { return reinterpret_cast<const uint64_t*>(&indices_->tail); }

  // Producer side. Returns false when full: the caller backs off, it never overwrites.
  bool try_push(const Command& cmd) {
    uint64_t head = indices_->head.load(std::memory_order_relaxed);
    if (head - tail_cache_ > mask_) {
      tail_cache_ = indices_->tail.load(std::memory_order_acquire);
      if (head - tail_cache_ > mask_) return false;
    }
    slots_[head & mask_] = cmd;
    indices_->head.store(head + 1, std::memory_order_release);
    return true;
  }

  // Consumer side. Returns false when empty.
  bool try_pop(Command* out) {
    uint64_t tail = indices_->tail.load(std::memory_order_relaxed);
    if (tail == head_cache_) {
      head_cache_ = indices_->head.load(std::memory_order_acquire);
      if (tail == head_cache_) return false;
    }
    *out = slots_[tail & mask_];
    indices_->tail.store(tail + 1, std::memory_order_release);
    return true;
  }

  bool empty() const {
    return indices_->head.load(std::memory_order_acquire) == indices_->tail.load(std::memory_order_acquire);
  }
  uint64_t pushed() const { return indices_->head.load(std::memory_order_acquire); }
  uint64_t popped() const { return indices_->tail.load(std::memory_order_acquire); }

 private:
  struct Indices {
    alignas(64) std::atomic<uint64_t> head{0};
    alignas(64) std::atomic<uint64_t> tail{0};
  };
  static_assert(sizeof(std::atomic<uint64_t>) == 8, "ring indices must be plain 64-bit words");
  const uint32_t mask_;
  Command* slots_ = nullptr;
  Indices* indices_ = nullptr;
  uint64_t tail_cache_ = 0;  // producer's view of tail
  uint64_t head_cache_ = 0;  // consumer's view of head
};

}  // namespace uccl_ep
