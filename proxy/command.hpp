// Commands that producers (CPU ops, GPU kernels) push into a ring for a proxy thread to post.
// Plain data, 32 bytes: a GPU warp can write one with two 16-byte stores.
#pragma once
#include <cstdint>

namespace uccl_ep {

enum class Op : uint8_t {
  kNop = 0,
  kWrite = 1,  // RDMA write of `length` bytes, local offset -> peer's remote offset, tagged as data.
  kFence = 2,  // Ends a message: the peer publishes it once every write it covers has landed.
  kAbort = 3,  // Tells the peer this rank failed out of step; carries the reason as its payload.
};

struct Command {
  Op op;
  uint8_t reserved0;
  uint16_t reserved1;      // not carried by a ring (its slots hold their lap tag there: ring.hpp)
  uint32_t peer;           // global rank (device index in the runtime's peer table)
  uint64_t local_offset;   // bytes into this device's registered buffer (below 2^48: ring.hpp)
  uint64_t remote_offset;  // bytes into the peer's registered buffer (below 2^48)
  uint32_t length;         // bytes
  uint32_t imm;            // 32-bit immediate as posted; the proxy fills it in (see ordering.hpp), a ring drops it
};
static_assert(sizeof(Command) == 32, "Command must stay 32 bytes");

// The command that ends a message to `peer` (an 8-byte write between the scratch words, tagged as the fence).
// constexpr: GPU producers build it too (nvcc --expt-relaxed-constexpr).
constexpr Command message_fence(uint32_t peer) { return Command{Op::kFence, 0, 0, peer, 0, 8, 8, 0}; }

}  // namespace uccl_ep
