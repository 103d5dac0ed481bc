// A GPU warp as the producer of a proxy command ring (proxy/ring.hpp), the first piece of the GPU proxy path:
// kernels write compact commands into pinned, mapped host memory and the proxy threads post them.
//
// One warp owns a ring (single producer). Lanes write up to 32 commands into consecutive slots with two 16-byte
// stores each, every 8-byte word tagged with the slot's lap (proxy/ring.hpp), so the proxy takes a slot once it
// landed whole and nothing orders the slots before the head: lane 0 publishes the head with a plain store, for
// counting. A full ring makes the warp wait for the proxy's tail (it never overwrites), up to a deadline on the
// GPU's global timer. A push does not order what the warp wrote before it (a payload a write command sends):
// fence that first (__threadfence_system), as push_messages and proxy_put do.
#pragma once
#include <cstdint>
#include <cstring>

#include "../../proxy/command.hpp"
#include "../../proxy/ring.hpp"
#include "device_common.cuh"
#include "sync.cuh"

namespace uccl_ep::nvl {

// Device view of a CommandRing (addresses valid on the GPU: mapped host memory).
struct DeviceRing {
  RingSlot* slots;
  uint64_t* head;
  const uint64_t* tail;
  uint32_t mask;   // capacity - 1
  uint32_t shift;  // capacity = 2^shift
};

namespace {
// The device view of a ring the host made (its memory pinned and mapped).
inline DeviceRing device_ring(CommandRing& ring) {
  return DeviceRing{device_view(ring.slots()), device_view(ring.head_word()),
                    device_view(const_cast<uint64_t*>(ring.tail_word())), ring.capacity() - 1, ring.shift()};
}
}  // namespace

// Every lane of the warp calls it; lanes [0, count) each give one command (count <= 32). `head` is the warp's
// own copy of the ring's head, `tail_seen` its last view of the consumer's tail; both stay in step on all lanes.
// Returns false (on every lane, nothing published) if the ring stayed full until `deadline_ns`.
__device__ __forceinline__ bool warp_push(const DeviceRing& ring, const Command& cmd, int count, uint64_t& head,
                                          uint64_t& tail_seen, uint64_t deadline_ns) {
  const int lane = threadIdx.x % 32;
  int ok = 1;
  if (lane == 0) {
    // The proxy reads the tail across PCIe from the GPU's point of view: read it only when the cached view says
    // the ring may be full.
    while (head + uint64_t(count) - tail_seen > uint64_t(ring.mask) + 1) {
      tail_seen = load_acquire_sys(ring.tail);
      if (head + uint64_t(count) - tail_seen <= uint64_t(ring.mask) + 1) break;
      if (global_ns() > deadline_ns) {
        ok = 0;
        break;
      }
    }
  }
  ok = __shfl_sync(0xffffffffu, ok, 0);
  tail_seen = __shfl_sync(0xffffffffu, tail_seen, 0);
  if (!ok) return false;
  if (lane < count) {
    const uint64_t position = head + uint64_t(lane);
    uint64_t w[4];
    encode_slot(cmd, lap_tag(position, ring.shift), w);
    // Slots are 32 bytes apart from a page-aligned base: two 16-byte stores, each landing as whole 8-byte words.
    ulonglong2* dst = reinterpret_cast<ulonglong2*>(ring.slots[position & ring.mask].words);
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(dst), "l"(w[0]), "l"(w[1]) : "memory");
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(dst + 1), "l"(w[2]), "l"(w[3]) : "memory");
  }
  __syncwarp();
  if (lane == 0) store_relaxed_sys(ring.head, head + uint64_t(count));
  head += uint64_t(count);
  return true;
}

// Every lane of the warp: the ring's head and tail as the host left them, to push from (no other producer may push
// while the warp does).
__device__ __forceinline__ void ring_position(const DeviceRing& ring, uint64_t& head, uint64_t& tail_seen) {
  if (threadIdx.x % 32 == 0) {
    head = load_acquire_sys(ring.head);
    tail_seen = load_acquire_sys(ring.tail);
  }
  head = __shfl_sync(0xffffffffu, head, 0);
  tail_seen = __shfl_sync(0xffffffffu, tail_seen, 0);
}

// One thread: waits until `*word` (a count a proxy publishes in mapped host memory) reaches `target`: a device
// quiet is the channel's retired-command count reaching the ring's head after our pushes; an arrival is a peer's
// released-message count reaching the next message. False if it did not by `deadline_ns`.
__device__ __forceinline__ bool wait_count(const uint64_t* word, uint64_t target, uint64_t deadline_ns) {
  while (load_acquire_sys(word) < target)
    if (global_ns() > deadline_ns) return false;
  return true;
}

}  // namespace uccl_ep::nvl
