// One round of all-to-all messages among the ranks of an EP group, through the proxy runtime: the CPU
// counterpart of a dispatch or combine kernel. Each rank packs one message per destination into its send
// staging region, the proxies write it into the destination's receive region (striped over the channels), and
// the destination acknowledges once it has read the region, so the next round never overwrites unread data.
//
// Every message starts with a header that names the op and its row size, so ranks that run different ops or
// shapes fail with a message instead of reading garbage, and a rank with bad input still takes part (with an
// error status) so that its peers fail fast instead of timing out.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "../../proxy/runtime.hpp"
#include "../contract.hpp"

namespace uccl_ep::cpu {

// A collective error that every rank of the runtime raised in the same op (a status round over the whole job):
// nothing is out of step, so callers that abort the job on a level's failure let it pass.
struct RaisedOnEveryRank : CollectiveError {
  using CollectiveError::CollectiveError;
};

enum class OpKind : uint32_t {
  kDispatch = 1,
  kCachedDispatch = 2,
  kCombine = 3,
  kLowLatencyDispatch = 4,
  kLowLatencyCombine = 5,
  kDispatchAcrossNodes = 6,       // hierarchical dispatch: a token once to each node that needs it
  kDispatchWithinNode = 7,        // then on to the node's ranks that need it
  kCombineRoutesAcrossNodes = 8,  // hierarchical combine: which tokens each node's ranks hold, per source
  kCombineWithinNode = 9,         // the rows, to the rank that forwarded them, summed there
  kCombineAcrossNodes = 10,       // one partial sum per token and node, back to the source
  kCachedDispatchAcrossNodes = 11,
  kCachedDispatchWithinNode = 12,
  kCapacityCheck = 13,  // after a dispatch that may overflow under Overflow::kError: each rank's verdict, no rows
};
const char* op_name(OpKind kind);

// The contract's rows as bytes.
inline const uint8_t* bytes_of(const void* p) { return static_cast<const uint8_t*>(p); }
inline uint8_t* bytes_of(void* p) { return static_cast<uint8_t*>(p); }

using uccl_ep::CachedDispatchArgs;
using uccl_ep::CombineArgs;
using uccl_ep::DispatchArgs;
using uccl_ep::FloatType;
using uccl_ep::Group;
using uccl_ep::LowLatencyCombineArgs;
using uccl_ep::LowLatencyDispatchArgs;

// Checks the group against the device and finds this rank's index in it.
Group make_group(const Device& dev, const int32_t* ranks, int size, const char* op);
// The group's global ranks (the peers an abort tells).
std::vector<uint32_t> group_peers(const Group& group);

// A round in which some rank's message outgrows a region of the buffer: raised by every rank of the round (they
// stay in step), naming the UCCL_EP_BUFFER_BYTES that holds the round's largest message.
struct RegionTooSmall : CollectiveError {
  using CollectiveError::CollectiveError;
};

// A message of a round: a header, then its rows. What a region of the proxy's buffer must hold for it.
constexpr uint64_t kMessageHeaderBytes = 64;
inline uint64_t message_bytes(uint64_t rows, uint64_t row_bytes) { return kMessageHeaderBytes + rows * row_bytes; }

struct ExchangePlan {
  OpKind kind;
  uint32_t op_index;              // position in the program: the same on every rank
  uint64_t row_bytes;             // every row of every message
  uint64_t shape_tag;             // op-specific shape summary that must agree across ranks
  std::vector<uint32_t> rows_to;  // rows for each group member
  std::string local_error;        // non-empty: this rank's input is bad; it still takes part
};

// Packs row i of the message for group member `dst` at `out` (row_bytes bytes).
using PackRow = std::function<void(int dst, uint32_t i, uint8_t* out)>;
// Reads row i of the message from group member `src`.
using UnpackRows = std::function<void(int src, uint32_t count, const uint8_t* rows)>;

// Runs the round; returns the row count received from each member. Bad input on any rank raises
// CollectiveError on every rank (the runtime stays usable). Anything that leaves this rank out of step (a
// mismatched header, a timeout, a transport failure) aborts: the peers are told, and later ops fail until the
// runtime is initialized again.
std::vector<uint32_t> exchange(Device& dev, const Group& group, const ExchangePlan& plan, const PackRow& pack,
                               const UnpackRows& unpack);

// The same round in two halves, for ops that let the caller work between sending and receiving. At most one
// round may wait between its halves on a device, and no other round may run there meanwhile (both are errors).
void exchange_send(Device& dev, const Group& group, const ExchangePlan& plan, const PackRow& pack);
std::vector<uint32_t> exchange_receive(Device& dev, const Group& group, OpKind kind, const UnpackRows& unpack);

// After an op that may have overflowed a capacity under Overflow::kError: every rank sends every member what it
// needed (`needed`, in the capacity's units), and if any rank needed more than `capacity`, every rank raises
// `message(member, needed)` of the neediest (the first in order on a tie) in this op, so all stay in step and the
// runtime remains usable. Over the group, `member` the neediest's index in it (its position on the EP axis), or
// with `over_job` over every rank of the runtime (the node level of two-level routing, whose other nodes wait on
// this one), `member` its runtime rank: then the error is RaisedOnEveryRank.
void raise_if_any_rank_needs_more(Device& dev, const Group& group, uint32_t op_index, uint64_t capacity, bool over_job,
                                  uint64_t needed,
                                  const std::function<std::string(uint32_t member, uint64_t needed)>& message);

// For a failure found after a successful round on this rank only (capacity exceeded, a stale handle): aborts
// like above and throws InvalidArgument(message).
[[noreturn]] void abort_group(Device& dev, const Group& group, const std::string& message);

}  // namespace uccl_ep::cpu
