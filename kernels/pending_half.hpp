// Split low-latency ops (a send half now, its receive half later) keep their pending half in the proxy device's
// opaque op slot, host rounds (kernels/cpu) and GPU-initiated ones (kernels/nvl) alike: one at most per device,
// and no other round may run there in between.
#pragma once
#include <string>

#include "../proxy/runtime.hpp"

namespace uccl_ep {

// Throws Error if a send half still waits for its receive half on `dev` (call with its op lock held).
inline void check_no_pending_half(const Device& dev, const char* op) {
  if (dev.op_state().has_value())
    throw Error(std::string("uccl_ep ") + op +
                ": the send half of a low-latency op still waits for its receive half on this device; run the "
                "receive first");
}

}  // namespace uccl_ep
