// Lock-free single-producer/single-consumer ring of Commands.
// The producer owns `head`, the consumer owns `tail`. A slot is valid by its own content: every 8-byte word of it
// carries the slot's lap tag (ring position / capacity, see encode_slot), so the consumer polls the slot at its
// tail and takes it once all four words show this lap. No ordering between the slot's stores and the head is
// needed (a GPU producer's release store of the head waits for the slot's stores to cross PCIe, on the path to the
// proxy); the head is still kept, for counting (quiet) and for the next
// producer to start from. 8-byte stores land whole in host memory, as NCCL's LL protocol relies on too.
// Slots and both indices live in host_alloc'd memory (pinned and mapped into the GPUs when a CUDA build installed
// that allocator), so the producer may be a GPU warp: slots(), head_word() and tail_word() are plain addresses,
// and a device producer writes slots the same way (kernels/nvl/ring_producer.cuh). What a command points at (a
// payload the producer wrote) is not ordered by the ring: a producer fences its payload before pushing.
#pragma once
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <stdexcept>

#include "command.hpp"
#include "host_memory.hpp"

namespace uccl_ep {

// One slot as stored: a Command's 32 bytes with the lap tag in every 8-byte word (the command's reserved1, the top
// 16 bits of both offsets, the imm the proxy assigns anyway).
struct alignas(32) RingSlot {
  uint64_t words[4];
};
constexpr int kOffsetBits = 48;  // offsets a ring carries: registered buffers stay below 256 TiB
constexpr uint64_t kOffsetMask = (uint64_t(1) << kOffsetBits) - 1;

// The tag of ring position `position` in a ring of 2^shift slots: 1..65535, never 0 (fresh slots), and never the
// previous lap's.
constexpr uint64_t lap_tag(uint64_t position, uint32_t shift) { return (position >> shift) % 65535u + 1; }

// `shift` of a ring of `capacity_pow2` slots (capacity = 2^shift).
constexpr uint32_t ring_shift(uint32_t capacity_pow2) {
  uint32_t shift = 0;
  while ((uint64_t(1) << shift) < capacity_pow2) ++shift;
  return shift;
}

constexpr void encode_slot(const Command& c, uint64_t tag, uint64_t out[4]) {
  out[0] = uint64_t(uint8_t(c.op)) | uint64_t(c.reserved0) << 8 | tag << 16 | uint64_t(c.peer) << 32;
  out[1] = (c.local_offset & kOffsetMask) | tag << kOffsetBits;
  out[2] = (c.remote_offset & kOffsetMask) | tag << kOffsetBits;
  out[3] = uint64_t(c.length) | tag << 32;
}

// The command in `w` if every word carries `tag`, else false (not landed yet, or only partly).
constexpr bool decode_slot(const uint64_t w[4], uint64_t tag, Command* out) {
  if (((w[0] >> 16) & 0xFFFF) != tag || (w[1] >> kOffsetBits) != tag || (w[2] >> kOffsetBits) != tag ||
      (w[3] >> 32) != tag)
    return false;
  *out = Command{Op(uint8_t(w[0])),  uint8_t(w[0] >> 8), 0, uint32_t(w[0] >> 32), w[1] & kOffsetMask,
                 w[2] & kOffsetMask, uint32_t(w[3]),     0};
  return true;
}

class CommandRing {
 public:
  explicit CommandRing(uint32_t capacity_pow2) : mask_(capacity_pow2 - 1), shift_(ring_shift(capacity_pow2)) {
    if (capacity_pow2 == 0 || (capacity_pow2 & mask_) != 0)
      throw std::invalid_argument("CommandRing capacity must be a power of two");
    slots_ = static_cast<RingSlot*>(host_alloc(sizeof(RingSlot) * capacity_pow2));
    void* words = host_alloc(sizeof(Indices));
    if (!slots_ || !words) {
      if (slots_) host_free(slots_);
      if (words) host_free(words);
      throw std::bad_alloc();
    }
    indices_ = new (words) Indices();
    // Lap tags are never 0: a zeroed slot holds no command. (Memory an earlier ring held may come back with its
    // slots, which would read as this ring's.)
    for (uint32_t i = 0; i < capacity_pow2; ++i) slots_[i] = RingSlot{};
  }
  ~CommandRing() {
    indices_->~Indices();
    host_free(indices_);
    host_free(slots_);
  }
  CommandRing(const CommandRing&) = delete;
  CommandRing& operator=(const CommandRing&) = delete;

  uint32_t capacity() const { return mask_ + 1; }
  uint32_t shift() const { return shift_; }  // capacity = 2^shift
  // For device producers: the slot array and the two 64-bit indices, in mapped host memory.
  RingSlot* slots() const { return slots_; }
  uint64_t* head_word() const { return reinterpret_cast<uint64_t*>(&indices_->head); }
  const uint64_t* tail_word() const { return reinterpret_cast<const uint64_t*>(&indices_->tail); }

  // Producer side. Returns false when full: the caller backs off, it never overwrites.
  bool try_push(const Command& cmd) {
    uint64_t head = indices_->head.load(std::memory_order_relaxed);
    if (head - tail_cache_ > mask_) {
      tail_cache_ = indices_->tail.load(std::memory_order_acquire);
      if (head - tail_cache_ > mask_) return false;
    }
    uint64_t words[4] = {};
    encode_slot(cmd, lap_tag(head, shift_), words);
    uint64_t* slot = slots_[head & mask_].words;
    // Release: a consumer that sees a word of this slot also sees what the producer wrote before (the payload a
    // write command sends). GPU producers fence their payload instead (ring_producer.cuh).
    for (int i = 0; i < 4; ++i) __atomic_store_n(&slot[i], words[i], __ATOMIC_RELEASE);
    indices_->head.store(head + 1, std::memory_order_release);
    return true;
  }

  // Consumer side. Returns false while the slot at the tail does not hold this lap's command.
  bool try_pop(Command* out) {
    const uint64_t tail = indices_->tail.load(std::memory_order_relaxed);
    const uint64_t tag = lap_tag(tail, shift_);
    const uint64_t* slot = slots_[tail & mask_].words;
    uint64_t words[4];
    words[0] = __atomic_load_n(&slot[0], __ATOMIC_ACQUIRE);
    if (((words[0] >> 16) & 0xFFFF) != tag) return false;  // the common empty poll: one load
    for (int i = 1; i < 4; ++i) words[i] = __atomic_load_n(&slot[i], __ATOMIC_ACQUIRE);
    if (!decode_slot(words, tag, out)) return false;
    indices_->tail.store(tail + 1, std::memory_order_release);  // the producer may reuse the slot
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
  const uint32_t shift_;
  RingSlot* slots_ = nullptr;
  Indices* indices_ = nullptr;
  uint64_t tail_cache_ = 0;  // producer's view of tail
};

}  // namespace uccl_ep
