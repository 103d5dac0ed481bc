// Errors the runtime raises. The FFI layer maps TimeoutError to DEADLINE_EXCEEDED, the rest to INTERNAL or
// INVALID_ARGUMENT; Python sees the message unchanged, so every message names the operation and the rank.
#pragma once
#include <chrono>
#include <stdexcept>
#include <string>

namespace uccl_ep {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct InvalidArgument : Error {
  using Error::Error;
};
struct TimeoutError : Error {
  using Error::Error;
};
// Every rank of the group raises it in the same op (bad input is announced to all peers), so the ranks stay
// in step and the runtime remains usable afterwards.
struct CollectiveError : InvalidArgument {
  using InvalidArgument::InvalidArgument;
};

// A wait with a deadline: every loop that waits on a peer or a ring checks one of these.
class Deadline {
 public:
  explicit Deadline(double seconds)
      : seconds_(seconds),
        end_(std::chrono::steady_clock::now() +
             std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds))) {}
  bool expired() const { return std::chrono::steady_clock::now() >= end_; }
  double seconds() const { return seconds_; }

 private:
  double seconds_;
  std::chrono::steady_clock::time_point end_;
};

// Spin briefly, then yield, then sleep: waiters must not starve the proxy threads on small machines.
class Backoff {
 public:
  void pause();
  void reset() { spins_ = 0; }

 private:
  uint32_t spins_ = 0;
};

}  // namespace uccl_ep
