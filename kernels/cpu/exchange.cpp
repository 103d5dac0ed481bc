#include "exchange.hpp"

#include <algorithm>
#include <any>
#include <cstring>

#include "../pending_half.hpp"

namespace uccl_ep::cpu {
namespace {

constexpr uint32_t kMagic = 0x55455031;  // "UEP1"

struct Header {
  uint32_t magic;
  uint32_t kind;
  uint32_t sender;
  uint32_t rows;
  uint64_t row_bytes;
  uint64_t shape_tag;
  int32_t status;        // 0 fine, 1 the sender's input was bad, 2 a message of the sender's past a region
  uint32_t error_bytes;  // status 1: length of the sender's error text, which follows the header
  uint32_t op_index;     // the op's position in the sender's program
  uint32_t reserved0;
  uint64_t need_bytes;  // the sender's largest message of the round (header included), sent or not
  uint32_t reserved[2];
};
constexpr size_t kMaxErrorBytes = 1024;
static_assert(sizeof(Header) == kMessageHeaderBytes, "header size");

// Splits [0, bytes) into the channels' parts; part c goes over channel c.
std::pair<uint64_t, uint64_t> stripe(uint64_t bytes, int channels, int c) {
  uint64_t per = (bytes + channels - 1) / channels;
  per = (per + 63) / 64 * 64;
  uint64_t begin = std::min(bytes, per * c), end = std::min(bytes, per * (c + 1));
  return {begin, end - begin};
}

}  // namespace

const char* op_name(OpKind kind) {
  switch (kind) {
    case OpKind::kDispatch:
      return "dispatch";
    case OpKind::kCachedDispatch:
      return "cached_dispatch";
    case OpKind::kCombine:
      return "combine";
    case OpKind::kLowLatencyDispatch:
      return "low_latency_dispatch";
    case OpKind::kLowLatencyCombine:
      return "low_latency_combine";
    case OpKind::kDispatchAcrossNodes:
      return "dispatch (across nodes)";
    case OpKind::kDispatchWithinNode:
      return "dispatch (within the node)";
    case OpKind::kCombineRoutesAcrossNodes:
      return "combine (routes across nodes)";
    case OpKind::kCombineWithinNode:
      return "combine (within the node)";
    case OpKind::kCombineAcrossNodes:
      return "combine (across nodes)";
    case OpKind::kCachedDispatchAcrossNodes:
      return "cached_dispatch (across nodes)";
    case OpKind::kCachedDispatchWithinNode:
      return "cached_dispatch (within the node)";
    case OpKind::kCapacityCheck:
      return "dispatch (capacity check)";
  }
  return "unknown";
}

Group make_group(const Device& dev, const int32_t* ranks, int size, const char* op) {
  Group g{ranks, size, -1};
  for (int i = 0; i < size; ++i) {
    if (ranks[i] < 0 || uint32_t(ranks[i]) >= dev.num_ranks())
      throw InvalidArgument(std::string("uccl_ep ") + op + ": group member " + std::to_string(ranks[i]) +
                            " is not a rank of the runtime (" + std::to_string(dev.num_ranks()) + " ranks)");
    if (uint32_t(ranks[i]) == dev.rank()) {
      if (g.self >= 0) throw InvalidArgument(std::string("uccl_ep ") + op + ": rank appears twice in the group");
      g.self = i;
    }
  }
  if (g.self < 0)
    throw InvalidArgument(std::string("uccl_ep ") + op + ": rank " + std::to_string(dev.rank()) +
                          " is not in the group it runs for");
  return g;
}

std::vector<uint32_t> group_peers(const Group& group) {
  return std::vector<uint32_t>(group.ranks, group.ranks + group.size);
}

namespace {

// What the receive half of a round needs from its send half.
struct SentRound {
  OpKind kind;
  uint32_t op_index;
  uint64_t row_bytes, shape_tag;
  std::string input_error;  // non-empty: this rank's input was bad (ExchangePlan::local_error)
  uint64_t need_bytes;      // this rank's largest message of the round (0 with bad input)
  bool sent_status;         // this rank sent an error status (bad input or a message too large) instead of rows
};

// What a rank tells a caller whose messages outgrow a region of the buffer: the largest need of the round's ranks
// (each header carries its sender's), so that one restart with the advised buffer holds every rank's message of
// this round.
std::string buffer_advice(const Device& dev, uint64_t need_bytes, uint32_t needing_rank) {
  return "rank " + std::to_string(needing_rank) + " needs " + std::to_string(need_bytes) +
         " bytes for its largest message, but a buffer region holds " + std::to_string(dev.region_bytes()) +
         "; raise UCCL_EP_BUFFER_BYTES to at least " +
         std::to_string(buffer_bytes_for_region(need_bytes, dev.num_ranks())) +
         " (the most any rank of the group needs in this round; jax_uccl_ep.proxy_buffer_bytes sizes it for every op "
         "of a job's shapes)";
}

SentRound send_half(Device& dev, const Group& group, const ExchangePlan& plan, const PackRow& pack) {
  const char* op = op_name(plan.kind);
  const int channels = dev.num_channels();
  dev.quiet(op);  // send staging is free again only once earlier writes completed

  // Decide before sending anything: a rank that cannot send still takes part, with an error status (1: bad input,
  // its text follows the header; 2: a message past a region, the header's need_bytes says by how much).
  uint64_t need_bytes = 0;
  if (plan.local_error.empty())
    for (int d = 0; d < group.size; ++d)
      need_bytes = std::max(need_bytes, message_bytes(plan.rows_to[d], plan.row_bytes));
  const int32_t status = !plan.local_error.empty() ? 1 : need_bytes > dev.region_bytes() ? 2 : 0;
  const uint32_t error_bytes = status == 1 ? uint32_t(std::min(plan.local_error.size(), kMaxErrorBytes)) : 0;
  for (int d = 0; d < group.size; ++d) {
    uint32_t peer = uint32_t(group.ranks[d]);
    uint32_t rows = status ? 0 : plan.rows_to[d];
    uint64_t bytes = message_bytes(rows, plan.row_bytes) + error_bytes;
    // The peer must have read our previous message before we overwrite its region.
    if (dev.awaiting_ack(peer)) {
      dev.wait_message(0, peer, op);
      dev.awaiting_ack(peer) = false;
    }
    uint8_t* region = reinterpret_cast<uint8_t*>(dev.buffer() + dev.send_offset(peer));
    Header h{kMagic, uint32_t(plan.kind), dev.rank(),    rows, plan.row_bytes, plan.shape_tag,
             status, error_bytes,         plan.op_index, 0,    need_bytes,     {}};
    std::memcpy(region, &h, sizeof(h));
    // A rank with bad input sends its error text in place of rows, so every peer can report the cause.
    std::memcpy(region + kMessageHeaderBytes, plan.local_error.data(), error_bytes);
    for (uint32_t i = 0; i < rows; ++i) pack(d, i, region + kMessageHeaderBytes + uint64_t(i) * plan.row_bytes);
    for (int c = 0; c < channels; ++c) {
      auto [begin, len] = stripe(bytes, channels, c);
      dev.post_message(c, peer, dev.send_offset(peer) + begin, dev.recv_offset(dev.rank()) + begin, len, op);
    }
  }
  return SentRound{plan.kind, plan.op_index, plan.row_bytes, plan.shape_tag, plan.local_error, need_bytes, status != 0};
}

std::vector<uint32_t> receive_half(Device& dev, const Group& group, const SentRound& sent, const UnpackRows& unpack) {
  const char* op = op_name(sent.kind);
  const int channels = dev.num_channels();
  std::vector<uint32_t> received(group.size, 0);
  std::string out_of_step, peer_input;     // the first peer of each kind
  uint64_t most_needed = sent.need_bytes;  // the group's largest message, and whose
  uint32_t most_needing = dev.rank();
  for (int s = 0; s < group.size; ++s) {
    uint32_t peer = uint32_t(group.ranks[s]);
    for (int c = 0; c < channels; ++c) dev.wait_message(c, peer, op);
    const uint8_t* region = reinterpret_cast<const uint8_t*>(dev.buffer() + dev.recv_offset(peer));
    Header h;
    std::memcpy(&h, region, sizeof(h));
    std::string problem;
    if (h.magic != kMagic || h.sender != peer)
      problem = "sent a corrupt message header";
    else if (h.op_index != sent.op_index)
      problem = std::string("ran op #") + std::to_string(h.op_index) + " (" + op_name(OpKind(h.kind)) +
                ") of its program while this rank ran op #" + std::to_string(sent.op_index) + " (" + op +
                "): " + "op order differs across ranks (make one op depend on the other's output)";
    else if (h.kind != uint32_t(sent.kind) || h.row_bytes != sent.row_bytes || h.shape_tag != sent.shape_tag)
      problem = std::string("ran ") + op_name(OpKind(h.kind)) + " with " + std::to_string(h.row_bytes) +
                "-byte rows (shape tag " + std::to_string(h.shape_tag) + ") while this rank ran " + op + " with " +
                std::to_string(sent.row_bytes) + "-byte rows (shape tag " + std::to_string(sent.shape_tag) +
                "): shapes or op order differ across ranks";
    if (!problem.empty()) {
      if (out_of_step.empty()) out_of_step = "rank " + std::to_string(peer) + " " + problem;
      continue;
    }
    if (h.need_bytes > most_needed) {
      most_needed = h.need_bytes;
      most_needing = peer;
    }
    if (h.status == 1 && peer_input.empty())
      peer_input = "rank " + std::to_string(peer) + " reported invalid input: " +
                   std::string(reinterpret_cast<const char*>(region + kMessageHeaderBytes),
                               std::min<size_t>(h.error_bytes, kMaxErrorBytes));
    if (h.status == 0 && !sent.sent_status) {
      received[s] = h.rows;
      unpack(s, h.rows, region + kMessageHeaderBytes);
    }
  }
  // Region read: let every remote sender reuse it.
  for (int s = 0; s < group.size; ++s) {
    uint32_t peer = uint32_t(group.ranks[s]);
    if (peer != dev.rank()) dev.post_message(0, peer, 0, 0, 0, op);
  }
  for (int d = 0; d < group.size; ++d)
    if (uint32_t(group.ranks[d]) != dev.rank()) dev.awaiting_ack(uint32_t(group.ranks[d])) = true;

  // A peer out of step first (the caller aborts). Bad input and messages past a region are announced to every
  // peer, so all ranks fail here together, with the same words, and stay in step: the buffer to set (it needs a
  // restart), and the bad input too, so that the restart does not meet it next.
  std::string where = std::string("uccl_ep ") + op + ": rank " + std::to_string(dev.rank()) + ": ";
  if (!out_of_step.empty()) throw Error(where + out_of_step);
  const std::string& input = !sent.input_error.empty() ? sent.input_error : peer_input;
  if (most_needed > dev.region_bytes())
    throw RegionTooSmall(where + buffer_advice(dev, most_needed, most_needing) + (input.empty() ? "" : "; and ") +
                         input);
  if (!input.empty()) throw CollectiveError(where + input);
  return received;
}

// Runs `half` under the device's op lock; anything but a collective error leaves this rank out of step, so the
// peers are told at once.
template <class Half>
auto guarded_half(Device& dev, const Group& group, const char* op, Half&& half) {
  dev.note_round_entered();
  std::lock_guard<std::mutex> lock(dev.op_mutex());
  dev.check_usable(op);
  try {
    return half();
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& e) {
    dev.abort(group_peers(group), e.what());
    throw;
  }
}

// Low-latency rounds may be split: a send half whose receive half runs later, kept in the device's op state.
// One such round at most per device, and no other round in between. (Call with the op lock held.)
// Refusing leaves the waiting round's messages unread, so this is an out-of-step failure (peers are told).
void check_no_pending(Device& dev, const char* op) {
  if (const SentRound* sent = std::any_cast<SentRound>(&dev.op_state()))
    throw Error(std::string("uccl_ep ") + op + ": the send half of " + op_name(sent->kind) + " (op #" +
                std::to_string(sent->op_index) +
                ") still waits for its receive half on this device; run the receive first");
  check_no_pending_half(dev, op);  // a GPU-initiated one (kernels/nvl/low_latency.cu)
}

}  // namespace

std::vector<uint32_t> exchange(Device& dev, const Group& group, const ExchangePlan& plan, const PackRow& pack,
                               const UnpackRows& unpack) {
  return guarded_half(dev, group, op_name(plan.kind), [&] {
    check_no_pending(dev, op_name(plan.kind));
    SentRound sent = send_half(dev, group, plan, pack);
    return receive_half(dev, group, sent, unpack);
  });
}

void exchange_send(Device& dev, const Group& group, const ExchangePlan& plan, const PackRow& pack) {
  guarded_half(dev, group, op_name(plan.kind), [&] {
    check_no_pending(dev, op_name(plan.kind));
    dev.op_state() = send_half(dev, group, plan, pack);
  });
}

std::vector<uint32_t> exchange_receive(Device& dev, const Group& group, OpKind kind, const UnpackRows& unpack) {
  return guarded_half(dev, group, op_name(kind), [&] {
    const SentRound* pending = std::any_cast<SentRound>(&dev.op_state());
    if (!pending || pending->kind != kind)
      throw CollectiveError(std::string("uccl_ep ") + op_name(kind) + ": no send half of " + op_name(kind) +
                            " is waiting on this device");
    SentRound sent = *pending;
    dev.op_state().reset();
    return receive_half(dev, group, sent, unpack);
  });
}

void raise_if_any_rank_needs_more(Device& dev, const Group& group, uint32_t op_index, uint64_t capacity, bool over_job,
                                  uint64_t needed,
                                  const std::function<std::string(uint32_t member, uint64_t needed)>& message) {
  std::vector<int32_t> everyone;
  Group round = group;
  if (over_job) {
    for (uint32_t r = 0; r < dev.num_ranks(); ++r) everyone.push_back(int32_t(r));
    round = make_group(dev, everyone.data(), int(everyone.size()), "dispatch");
  }
  ExchangePlan plan{OpKind::kCapacityCheck, op_index, 16, capacity, std::vector<uint32_t>(round.size, 1), ""};
  uint64_t most = 0;
  uint32_t neediest = 0;
  exchange(
      dev, round, plan,
      [&](int, uint32_t, uint8_t* out) {
        std::memset(out, 0, 16);
        std::memcpy(out, &needed, 8);
      },
      [&](int s, uint32_t count, const uint8_t* rows) {
        uint64_t n = 0;
        if (count == 1) std::memcpy(&n, rows, 8);
        if (n > most) {
          most = n;
          neediest = uint32_t(s);
        }
      });
  if (most <= capacity) return;
  const std::string what = std::string("uccl_ep ") + op_name(OpKind::kCapacityCheck) + ": " + message(neediest, most);
  if (over_job) throw RaisedOnEveryRank(what);
  throw CollectiveError(what);
}

void abort_group(Device& dev, const Group& group, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(dev.op_mutex());
    dev.abort(group_peers(group), message);
  }
  throw InvalidArgument(message);
}

}  // namespace uccl_ep::cpu
