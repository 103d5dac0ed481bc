#include "normal.hpp"

#include "rows.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

namespace uccl_ep::cpu {
namespace {

// Tokens each member receives, ascending, from a [num_tokens, group size] mask.
std::vector<std::vector<uint32_t>> tokens_by_member(const bool* mask, int num_tokens, int members) {
  std::vector<std::vector<uint32_t>> out(members);
  for (int t = 0; t < num_tokens; ++t)
    for (int d = 0; d < members; ++d)
      if (mask[size_t(t) * members + d]) out[d].push_back(uint32_t(t));
  return out;
}

// Tokens each node's members receive (any of its `per_node` consecutive members), ascending, from a
// [num_tokens, nodes * per_node] mask.
std::vector<std::vector<uint32_t>> tokens_by_node(const bool* mask, int num_tokens, int nodes, int per_node) {
  std::vector<std::vector<uint32_t>> out(nodes);
  const size_t members = size_t(nodes) * per_node;
  for (int t = 0; t < num_tokens; ++t)
    for (int n = 0; n < nodes; ++n) {
      const bool* row = mask + size_t(t) * members + size_t(n) * per_node;
      if (std::any_of(row, row + per_node, [](bool x) { return x; })) out[n].push_back(uint32_t(t));
    }
  return out;
}

std::vector<uint32_t> sizes(const std::vector<std::vector<uint32_t>>& lists) {
  std::vector<uint32_t> out;
  for (auto& l : lists) out.push_back(uint32_t(l.size()));
  return out;
}

// Bookkeeping of received rows against the output capacity: rows past it are counted, never written.
struct RowSink {
  int capacity;
  uint64_t total = 0;
  int64_t claim(uint32_t count) {
    int64_t first = int64_t(total);
    total += count;
    return first;
  }
  bool overflowed() const { return total > uint64_t(capacity); }
};

std::string overflow_message(uint32_t rank, uint64_t rows, int capacity) {
  return "rank " + std::to_string(rank) + " received " + std::to_string(rows) + " tokens but capacity is " +
         std::to_string(capacity) +
         "; pass a larger capacity (the default, group size * tokens per rank, never drops) or overflow='drop'";
}

// Under Overflow::kError a dispatch whose rows may exceed some rank's capacity ends with a round of the ranks'
// counts, so that every rank raises the neediest rank's overflow in the same op.
void check_capacity_everywhere(Device& dev, const Group& group, const DispatchArgs& a, const RowSink& sink) {
  const uint64_t most_rows = uint64_t(group.size) * uint64_t(a.num_tokens);  // every member sends all its tokens
  if (a.overflow != Overflow::kError || most_rows <= uint64_t(a.capacity)) return;
  raise_if_any_rank_needs_more(
      dev, group, a.op_index, uint64_t(a.capacity), a.overflow_status_over_job, sink.total,
      [&](uint32_t member, uint64_t rows) { return overflow_message(member, rows, a.capacity); });
}

// A group whose members fall into nodes as equal blocks of `per_node` consecutive members (member s = node *
// per_node + local, every block one node; the plan checked that, jax_uccl_ep/_plan.py): dispatch then sends a token
// once to each node that needs it, and the rank with the same local index there passes it on within the node.
struct NodeBlocks {
  int nodes = 1, per_node = 1, node = 0, local = 0;
  std::vector<int32_t> across;  // ranks (n, local) for every node n
  std::vector<int32_t> within;  // ranks (node, l) for every l
};
// The nodes of a group of `size` ranks, `per_node` a node, or 1 where its rounds are flat (one node, a node size
// of 0 or 1, or one that does not divide the group).
int nodes_of(int size, int per_node) {
  return per_node <= 1 || per_node >= size || size % per_node != 0 ? 1 : size / per_node;
}
// The blocks of `g` for the plan's node size (0 or 1: flat, no rounds).
std::optional<NodeBlocks> node_blocks(const Group& g, int per_node) {
  if (nodes_of(g.size, per_node) == 1) return std::nullopt;
  NodeBlocks b;
  b.per_node = per_node;
  b.nodes = g.size / per_node;
  b.node = g.self / per_node;
  b.local = g.self % per_node;
  for (int n = 0; n < b.nodes; ++n) b.across.push_back(g.ranks[n * per_node + b.local]);
  for (int l = 0; l < per_node; ++l) b.within.push_back(g.ranks[b.node * per_node + l]);
  return b;
}

// Runs the rounds of one op over subgroups of `group`, in order. A round that finds bad input somewhere (a
// CollectiveError: its ranks stay in step) does not stop the later ones: they run with the error as this rank's
// status (`error`), so every rank of the group learns of it through the alternating subgroups; then it is
// raised. An error that first shows in the last round reaches only that round's subgroup: a message past a region
// there (RegionTooSmall) aborts the whole group, whose other ranks finished the op and would wait for these in the
// next one (combine's stale rows do the same where it finds them). Anything else (a timeout, a corrupt row) left
// this rank out of step: it aborts the whole group, not only the round's subgroup, so every peer fails fast
// instead of waiting for its deadline.
void in_rounds(Device& dev, const Group& group, std::initializer_list<std::function<void(const std::string&)>> rounds) {
  std::string error;
  size_t ran = 0;
  for (const auto& round : rounds) {
    ++ran;
    try {
      round(error);
    } catch (const RegionTooSmall& e) {
      if (error.empty() && ran == rounds.size()) abort_group(dev, group, e.what());
      if (error.empty()) error = e.what();
    } catch (const CollectiveError& e) {
      if (error.empty()) error = e.what();
    } catch (const std::exception& e) {
      {
        std::lock_guard<std::mutex> lock(dev.op_mutex());
        dev.abort(group_peers(group), e.what());
      }
      throw;
    }
  }
  if (!error.empty()) throw CollectiveError(error);
}

// Sends this rank's tokens by `mask` ([T, R] of group members) in two rounds: to the rank with this local index on
// every node, the tokens that node needs (round 1, across nodes); each rank then passes the rows it got on to the
// ranks of its node whose byte in the row is set (round 2, within the node). `pack_row(t, out)` writes a token's
// payload; the route rides behind it at `tag_off`: (token, source node, one byte per rank of the target node).
// Returns the rows each source member sent this rank, in its token order (rows of route_row_bytes()).
uint64_t route_row_bytes(uint64_t tag_off, int per_node) { return round_up16(tag_off + 8 + uint64_t(per_node)); }
// A row of `payload` bytes as a round moves it: padded to 16 bytes, and across nodes with the route behind it.
uint64_t travelling_row_bytes(uint64_t payload, int per_node, bool across_nodes) {
  return across_nodes ? route_row_bytes(payload, per_node) : round_up16(payload);
}
// A dispatch row's payload: x | scales | topk_idx (global) | topk_weights.
uint64_t dispatch_payload_bytes(uint64_t x_row_bytes, uint64_t scale_row_bytes, int topk, bool weights) {
  return x_row_bytes + scale_row_bytes + 4ull * topk + (weights ? 4ull * topk : 0);
}

template <class PackRow>
std::vector<std::vector<uint8_t>> route_by_node(Device& dev, const Group& group, const NodeBlocks& b,
                                                OpKind across_kind, OpKind within_kind, const ExchangePlan& flat,
                                                const bool* mask, int num_tokens, PackRow&& pack_row,
                                                uint64_t tag_off) {
  const int R = group.size, P = b.per_node;
  const uint64_t row_bytes = route_row_bytes(tag_off, P);
  const char* op = op_name(within_kind);
  const Group across = make_group(dev, b.across.data(), b.nodes, op);
  const Group within = make_group(dev, b.within.data(), P, op);

  const auto to_node = tokens_by_node(mask, num_tokens, b.nodes, P);  // tokens each node needs
  std::vector<std::vector<uint8_t>> from_node(b.nodes);               // round 1's rows, by source node
  std::vector<std::vector<const uint8_t*>> forward(P);                // round 2's rows for each rank of this node
  std::vector<std::vector<uint8_t>> by_source(R);
  in_rounds(
      dev, group,
      {[&](const std::string&) {
         ExchangePlan plan{across_kind, flat.op_index, row_bytes, flat.shape_tag, sizes(to_node), flat.local_error};
         exchange(
             dev, across, plan,
             [&](int n, uint32_t i, uint8_t* out) {
               const uint32_t t = to_node[n][i];
               pack_row(t, out);
               const int32_t tag[2] = {int32_t(t), b.node};
               std::memcpy(out + tag_off, tag, 8);
               for (int l = 0; l < P; ++l) out[tag_off + 8 + l] = mask[size_t(t) * R + n * P + l];
             },
             [&](int n, uint32_t count, const uint8_t* rows) {
               from_node[n].assign(rows, rows + uint64_t(count) * row_bytes);
             });
       },
       [&](const std::string& error) {
         for (int n = 0; n < b.nodes && error.empty(); ++n)
           for (size_t j = 0; j < from_node[n].size() / row_bytes; ++j) {
             const uint8_t* row = from_node[n].data() + j * row_bytes;
             for (int l = 0; l < P; ++l)
               if (row[tag_off + 8 + l]) forward[l].push_back(row);
           }
         std::vector<uint32_t> rows_to(P);
         for (int l = 0; l < P; ++l) rows_to[l] = uint32_t(forward[l].size());
         ExchangePlan plan{within_kind, flat.op_index, row_bytes, flat.shape_tag, rows_to, error};
         exchange(
             dev, within, plan, [&](int l, uint32_t i, uint8_t* out) { std::memcpy(out, forward[l][i], row_bytes); },
             [&](int l, uint32_t count, const uint8_t* rows) {
               for (uint32_t j = 0; j < count; ++j) {
                 const uint8_t* row = rows + uint64_t(j) * row_bytes;
                 int32_t node;
                 std::memcpy(&node, row + tag_off + 4, 4);
                 if (node < 0 || node >= b.nodes)
                   throw Error(std::string("uccl_ep ") + op + ": a forwarded row names node " + std::to_string(node));
                 auto& dst = by_source[node * P + l];
                 dst.insert(dst.end(), row, row + row_bytes);
               }
             });
       }});
  return by_source;
}

// The rows of combine's three rounds across nodes (below), for y rows of `y_bytes`.
struct NodeCombineRows {
  uint64_t route;    // round 1: a token index and a byte per rank of the node
  uint64_t tagged;   // round 2: a y row, then its source node
  uint64_t partial;  // round 3: a partial sum, in y's type (BF16 sums cross back as DeepEP's do)
};
NodeCombineRows node_combine_rows(uint64_t y_bytes, int per_node) {
  return {round_up16(4 + uint64_t(per_node)), round_up16(y_bytes + 4), round_up16(y_bytes)};
}

// Combine in three rounds, the reverse of route_by_node: (1) each source tells the rank with its local index
// on every node which of its tokens that node's ranks hold (a token index and a byte per rank there); (2) every
// rank returns its rows to the rank of its node that forwarded them, which sums the rows of each token in float32;
// (3) that rank sends one partial sum per token back to the source, in y's type (BF16 sums halve the bytes that
// cross nodes, at one more rounding per node), and the source adds them into `acc` ([T, H]) in float32.
// Rows that do not match the routes (a stale handle) found by a forwarder fail the sources it serves with a
// collective error; returns such a mismatch found by this rank as a source (then out of step), or "".
template <class CopyYRow, class AddRow>
std::string combine_by_node(Device& dev, const Group& group, const NodeBlocks& b, const ExchangePlan& flat,
                            const CombineArgs& a, CopyYRow&& copy_y_row, AddRow&& add_y_row, float* acc) {
  const int R = group.size, P = b.per_node, H = a.hidden;
  const Group across = make_group(dev, b.across.data(), b.nodes, "combine");
  const Group within = make_group(dev, b.within.data(), P, "combine");
  const uint64_t y_bytes = uint64_t(H) * uint64_t(float_bytes(a.dtype));
  const NodeCombineRows row = node_combine_rows(y_bytes, P);
  const uint64_t route_bytes = row.route, partial_bytes = row.partial, tagged_bytes = row.tagged;
  std::string mismatch, abort_after;
  auto note = [&](const std::string& what) {
    if (mismatch.empty()) mismatch = what;
  };

  const auto to_node = tokens_by_node(a.is_token_in_rank, a.num_tokens, b.nodes, P);  // this rank's, per node
  std::vector<std::vector<uint8_t>> routes(b.nodes);                                  // round 1's rows, by source node
  std::vector<std::vector<float>> partial(b.nodes);       // [tokens of routes[n], H] sums for source node n
  std::vector<std::vector<uint32_t>> slots(b.nodes * P);  // [n * P + l]: route rows of source node n that rank l holds
  try {
    in_rounds(dev, group,
              {[&](const std::string&) {
                 ExchangePlan plan{OpKind::kCombineRoutesAcrossNodes,
                                   flat.op_index,
                                   route_bytes,
                                   flat.shape_tag,
                                   sizes(to_node),
                                   flat.local_error};
                 exchange(
                     dev, across, plan,
                     [&](int n, uint32_t i, uint8_t* out) {
                       const uint32_t t = to_node[n][i];
                       std::memcpy(out, &t, 4);
                       for (int l = 0; l < P; ++l) out[4 + l] = a.is_token_in_rank[size_t(t) * R + n * P + l];
                     },
                     [&](int n, uint32_t count, const uint8_t* rows) {
                       routes[n].assign(rows, rows + uint64_t(count) * route_bytes);
                     });
               },
               [&](const std::string& error) {
                 for (int n = 0; n < b.nodes; ++n) {
                   const size_t count = routes[n].size() / route_bytes;
                   partial[n].assign(count * H, 0.0f);
                   for (size_t i = 0; i < count; ++i)
                     for (int l = 0; l < P; ++l)
                       if (routes[n][i * route_bytes + 4 + l]) slots[n * P + l].push_back(uint32_t(i));
                 }
                 // To the rank of this node with local index l: the rows of sources (n, l), node by node.
                 std::vector<uint32_t> rows_to(P, 0);
                 for (int l = 0; l < P; ++l)
                   for (int n = 0; n < b.nodes; ++n) rows_to[l] += uint32_t(std::max(0, a.recv_counts[n * P + l]));
                 ExchangePlan plan{OpKind::kCombineWithinNode,
                                   flat.op_index,
                                   tagged_bytes,
                                   flat.shape_tag,
                                   rows_to,
                                   error.empty() ? flat.local_error : error};
                 exchange(
                     dev, within, plan,
                     [&](int l, uint32_t i, uint8_t* out) {
                       int32_t n = 0;
                       for (uint32_t c; i >= (c = uint32_t(std::max(0, a.recv_counts[n * P + l]))); ++n) i -= c;
                       copy_y_row(n * P + l, i, out);
                       std::memcpy(out + y_bytes, &n, 4);
                     },
                     [&](int l, uint32_t count, const uint8_t* rows) {
                       // The rows of each source node must be exactly the ones its routes give rank l.
                       size_t expected = 0;
                       for (int n = 0; n < b.nodes; ++n) expected += slots[n * P + l].size();
                       bool match = count == expected;
                       for (int n = 0, j = 0; n < b.nodes && match; ++n)
                         for (size_t k = 0; k < slots[n * P + l].size() && match; ++k, ++j) {
                           int32_t node;
                           std::memcpy(&node, rows + uint64_t(j) * tagged_bytes + y_bytes, 4);
                           match = node == n;
                         }
                       if (!match) {
                         note("rank " + std::to_string(b.within[l]) + " returned " + std::to_string(count) +
                              " rows that do not match the " + std::to_string(expected) +
                              " its sources' routes give it");
                         return;
                       }
                       for (int n = 0; n < b.nodes; ++n)
                         for (uint32_t slot : slots[n * P + l]) {
                           add_y_row(partial[n].data() + size_t(slot) * H, rows);
                           rows += tagged_bytes;
                         }
                     });
               },
               [&](const std::string& error) {
                 std::vector<uint32_t> rows_to(b.nodes);
                 for (int n = 0; n < b.nodes; ++n) rows_to[n] = uint32_t(routes[n].size() / route_bytes);
                 // Rows that did not match the routes make the sums wrong: the sources learn it here, as a collective
                 // error (every rank stays in step and usable), instead of receiving them.
                 std::string status = error;
                 if (status.empty() && !mismatch.empty()) {
                   status = std::string("uccl_ep ") + op_name(OpKind::kCombineWithinNode) + ": rank " +
                            std::to_string(dev.rank()) + ": " + mismatch + " (stale handle?)";
                   abort_after = status;
                 }
                 mismatch.clear();
                 ExchangePlan plan{
                     OpKind::kCombineAcrossNodes, flat.op_index, partial_bytes, flat.shape_tag, rows_to, status};
                 exchange(
                     dev, across, plan,
                     [&](int n, uint32_t i, uint8_t* out) {
                       store_as(partial[n].data() + size_t(i) * H, size_t(H), out, a.dtype);
                     },
                     [&](int n, uint32_t count, const uint8_t* rows) {
                       if (count != to_node[n].size()) {
                         note("rank " + std::to_string(b.across[n]) + " returned " + std::to_string(count) +
                              " sums where this rank sent its node " + std::to_string(to_node[n].size()) + " tokens");
                         return;
                       }
                       for (uint32_t j = 0; j < count; ++j) {
                         add_y_row(acc + size_t(to_node[n][j]) * H, rows + uint64_t(j) * partial_bytes);
                       }
                     });
               }});
  } catch (const CollectiveError&) {
    // This rank's sources learned of the stale rows in the last round; the rest of the group learns by an abort,
    // as from the flat combine.
    if (!abort_after.empty()) abort_group(dev, group, abort_after);
    throw;
  }
  return mismatch;
}

}  // namespace

uint64_t largest_message_bytes(const NormalShapes& s) {
  const uint64_t T = uint64_t(std::max(0, s.num_tokens));
  const int nodes = nodes_of(s.num_ranks, s.node_size);
  const bool across_nodes = nodes > 1;
  // cached_dispatch moves rows of x (and scales), or in combine's backward pass the rows combine returned.
  const uint64_t sent_row =
      std::max(travelling_row_bytes(dispatch_payload_bytes(s.x_row_bytes, s.scale_row_bytes, s.topk, s.weights),
                                    s.node_size, across_nodes),
               travelling_row_bytes(std::max(s.x_row_bytes + s.scale_row_bytes, s.combine_row_bytes), s.node_size,
                                    across_nodes));
  // Flat: a rank sends a member at most its T tokens, and combine returns a source at most the T rows it sent.
  if (!across_nodes) return message_bytes(T, std::max(sent_row, round_up16(s.combine_row_bytes)));
  // Across nodes a rank sends each node at most T rows; within its node it passes one rank the rows of every node's
  // rank of its local index (at most nodes x T), and combine's rounds mirror that.
  const NodeCombineRows row = node_combine_rows(s.combine_row_bytes, s.node_size);
  return std::max({message_bytes(uint64_t(nodes) * T, std::max(sent_row, row.tagged)),
                   message_bytes(T, std::max(row.route, row.partial))});
}

void get_dispatch_layout(const int32_t* topk_idx, int num_tokens, int topk, int num_experts, int num_ranks,
                         int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert, bool* is_token_in_rank) {
  std::string err = check_topk(topk_idx, num_tokens, topk, num_experts);
  if (!err.empty()) throw InvalidArgument("uccl_ep get_dispatch_layout: " + err);
  const int per_rank = num_experts / num_ranks;
  std::memset(num_tokens_per_rank, 0, sizeof(int32_t) * num_ranks);
  std::memset(num_tokens_per_expert, 0, sizeof(int32_t) * num_experts);
  std::memset(is_token_in_rank, 0, size_t(num_tokens) * num_ranks);
  for (int t = 0; t < num_tokens; ++t) {
    bool* row = is_token_in_rank + size_t(t) * num_ranks;
    for (int k = 0; k < topk; ++k) {
      int32_t e = topk_idx[size_t(t) * topk + k];
      if (e < 0) continue;
      ++num_tokens_per_expert[e];
      row[e / per_rank] = true;
    }
    for (int r = 0; r < num_ranks; ++r) num_tokens_per_rank[r] += row[r];
  }
}

void dispatch(Device& dev, const Group& group, const DispatchArgs& a) {
  const int R = group.size, K = a.topk;
  const int local_experts = a.num_experts / R;
  const int32_t first_expert = group.self * local_experts;

  ExchangePlan plan{OpKind::kDispatch, a.op_index, 0, 0, {}, check_topk(a.topk_idx, a.num_tokens, K, a.num_experts)};
  std::vector<int32_t> per_rank(R);
  std::vector<int32_t> per_expert(a.num_experts);
  if (plan.local_error.empty())
    get_dispatch_layout(a.topk_idx, a.num_tokens, K, a.num_experts, R, per_rank.data(), per_expert.data(),
                        a.is_token_in_rank);
  else
    std::memset(a.is_token_in_rank, 0, size_t(a.num_tokens) * R);

  // Row: x | scales | topk_idx (global) | topk_weights | padding to 16 bytes (| the route, across nodes).
  const uint64_t idx_off = a.x_row_bytes + a.scale_row_bytes;
  const uint64_t w_off = idx_off + 4ull * K;
  const uint64_t tag_off = dispatch_payload_bytes(a.x_row_bytes, a.scale_row_bytes, K, a.topk_weights != nullptr);
  const auto nodes = node_blocks(group, a.node_size);
  plan.row_bytes = travelling_row_bytes(tag_off, a.node_size, nodes.has_value());
  plan.shape_tag = (uint64_t(K) << 48) ^ (uint64_t(a.num_experts) << 24) ^ uint64_t(a.x_row_bytes) ^
                   (uint64_t(a.topk_weights != nullptr) << 62);
  auto pack_token = [&](uint32_t t, uint8_t* out) {
    std::memcpy(out, bytes_of(a.x) + size_t(t) * a.x_row_bytes, a.x_row_bytes);
    if (a.scale_row_bytes)
      std::memcpy(out + a.x_row_bytes, bytes_of(a.scales) + size_t(t) * a.scale_row_bytes, a.scale_row_bytes);
    std::memcpy(out + idx_off, a.topk_idx + size_t(t) * K, 4ull * K);
    if (a.topk_weights) std::memcpy(out + w_off, a.topk_weights + size_t(t) * K, 4ull * K);
  };

  RowSink sink{a.capacity};
  std::memset(a.num_tokens_per_expert, 0, sizeof(int32_t) * local_experts);
  // Rows from one source member, in its token order, into the next output rows.
  auto place = [&](int s, uint32_t count, const uint8_t* rows) {
    int64_t first = sink.claim(count);
    for (uint32_t j = 0; j < count && first + j < a.capacity; ++j) {
      const uint8_t* in = rows + uint64_t(j) * plan.row_bytes;
      size_t o = size_t(first + j);
      std::memcpy(bytes_of(a.recv_x) + o * a.x_row_bytes, in, a.x_row_bytes);
      if (a.scale_row_bytes)
        std::memcpy(bytes_of(a.recv_scales) + o * a.scale_row_bytes, in + a.x_row_bytes, a.scale_row_bytes);
      for (int k = 0; k < K; ++k) {
        int32_t e;
        std::memcpy(&e, in + idx_off + 4ull * k, 4);
        bool mine = e >= first_expert && e < first_expert + local_experts;
        a.recv_topk_idx[o * K + k] = mine ? e - first_expert : -1;
        if (mine) ++a.num_tokens_per_expert[e - first_expert];
        if (a.topk_weights) {
          float w;
          std::memcpy(&w, in + w_off + 4ull * k, 4);
          a.recv_topk_weights[o * K + k] = mine ? w : 0.0f;
        }
      }
    }
    a.recv_counts[s] = int32_t(count);
  };

  if (nodes) {
    auto by_source = route_by_node(dev, group, *nodes, OpKind::kDispatchAcrossNodes, OpKind::kDispatchWithinNode, plan,
                                   a.is_token_in_rank, a.num_tokens, pack_token, tag_off);
    for (int s = 0; s < R; ++s) place(s, uint32_t(by_source[s].size() / plan.row_bytes), by_source[s].data());
  } else {
    auto tokens_to = tokens_by_member(a.is_token_in_rank, a.num_tokens, R);
    plan.rows_to = sizes(tokens_to);
    exchange(dev, group, plan, [&](int d, uint32_t i, uint8_t* out) { pack_token(tokens_to[d][i], out); }, place);
  }
  check_capacity_everywhere(dev, group, a, sink);

  // Padding rows are defined: zeros, no expert.
  size_t valid = std::min(size_t(sink.total), size_t(a.capacity));
  size_t pad = size_t(a.capacity) - valid;
  std::memset(bytes_of(a.recv_x) + valid * a.x_row_bytes, 0, pad * a.x_row_bytes);
  if (a.scale_row_bytes) std::memset(bytes_of(a.recv_scales) + valid * a.scale_row_bytes, 0, pad * a.scale_row_bytes);
  for (size_t i = valid * K; i < size_t(a.capacity) * K; ++i) a.recv_topk_idx[i] = -1;
  if (a.topk_weights) std::memset(a.recv_topk_weights + valid * K, 0, pad * K * 4);
  *a.recv_num_tokens = int32_t(valid);
}

void cached_dispatch(Device& dev, const Group& group, const CachedDispatchArgs& a) {
  const int R = group.size;
  const auto nodes = node_blocks(group, a.node_size);
  const uint64_t row_bytes = travelling_row_bytes(uint64_t(a.row_bytes), a.node_size, nodes.has_value());
  ExchangePlan plan{OpKind::kCachedDispatch, a.op_index, row_bytes, uint64_t(a.row_bytes), {}, ""};
  RowSink sink{a.capacity};
  std::string mismatch;
  auto place = [&](int s, uint32_t count, const uint8_t* rows) {
    if (int32_t(count) != a.recv_counts[s] && mismatch.empty())
      mismatch = "rank " + std::to_string(group.ranks[s]) + " sent " + std::to_string(count) +
                 " rows where the handle records " + std::to_string(a.recv_counts[s]);
    int64_t first = sink.claim(count);
    for (uint32_t j = 0; j < count && first + j < a.capacity; ++j)
      std::memcpy(bytes_of(a.recv_x) + size_t(first + j) * a.row_bytes, rows + uint64_t(j) * row_bytes, a.row_bytes);
  };
  auto pack_token = [&](uint32_t t, uint8_t* out) {
    std::memcpy(out, bytes_of(a.x) + size_t(t) * a.row_bytes, a.row_bytes);
  };
  if (nodes) {
    auto by_source =
        route_by_node(dev, group, *nodes, OpKind::kCachedDispatchAcrossNodes, OpKind::kCachedDispatchWithinNode, plan,
                      a.is_token_in_rank, a.num_tokens, pack_token, a.row_bytes);
    for (int s = 0; s < R; ++s) place(s, uint32_t(by_source[s].size() / row_bytes), by_source[s].data());
  } else {
    auto tokens_to = tokens_by_member(a.is_token_in_rank, a.num_tokens, R);
    plan.rows_to = sizes(tokens_to);
    exchange(dev, group, plan, [&](int d, uint32_t i, uint8_t* out) { pack_token(tokens_to[d][i], out); }, place);
  }
  if (!mismatch.empty()) abort_group(dev, group, "uccl_ep cached_dispatch: " + mismatch + " (stale handle?)");
  // Rows past the capacity: dropped by a dropping dispatch's handle; otherwise its dispatch would have failed.
  if (sink.overflowed() && a.overflow != Overflow::kDrop)
    abort_group(
        dev, group,
        "uccl_ep cached_dispatch: " + overflow_message(dev.rank(), sink.total, a.capacity) + " (stale handle?)");
  size_t valid = std::min(size_t(sink.total), size_t(a.capacity));
  std::memset(bytes_of(a.recv_x) + valid * a.row_bytes, 0, (size_t(a.capacity) - valid) * a.row_bytes);
}

void combine(Device& dev, const Group& group, const CombineArgs& a) {
  const int R = group.size, H = a.hidden;
  const uint64_t row_bytes = uint64_t(H) * uint64_t(float_bytes(a.dtype));

  // Rows received from member s sit at [offset[s], offset[s] + recv_counts[s]) of y, in dispatch order.
  std::vector<uint64_t> offset(R + 1, 0);
  for (int s = 0; s < R; ++s) offset[s + 1] = offset[s] + uint64_t(std::max(0, a.recv_counts[s]));
  ExchangePlan plan{OpKind::kCombine, a.op_index, round_up16(row_bytes), row_bytes, {}, ""};
  for (int s = 0; s < R; ++s) plan.rows_to.push_back(uint32_t(std::max(0, a.recv_counts[s])));
  if (offset[R] > uint64_t(a.capacity) && a.overflow != Overflow::kDrop) {
    plan.local_error = "the handle records " + std::to_string(offset[R]) + " received rows but y has " +
                       std::to_string(a.capacity) + " (stale handle?)";
    plan.rows_to.assign(R, 0);
  }
  // Row i from member s, or zeros for a row its dispatch dropped past y's end.
  auto copy_y_row = [&](int s, uint32_t i, uint8_t* out) {
    const uint64_t row = offset[s] + i;
    if (row < uint64_t(a.capacity))
      std::memcpy(out, bytes_of(a.y) + row * row_bytes, row_bytes);
    else
      std::memset(out, 0, row_bytes);
  };
  auto add_y_row = [&](float* dst, const uint8_t* in) { add_row(dst, in, size_t(H), a.dtype); };

  const size_t values = size_t(a.num_tokens) * H;
  float* acc = zeroed_accumulator(values);
  std::string mismatch;
  if (auto nodes = node_blocks(group, a.node_size)) {
    mismatch = combine_by_node(dev, group, *nodes, plan, a, copy_y_row, add_y_row, acc);
  } else {
    auto tokens_from = tokens_by_member(a.is_token_in_rank, a.num_tokens, R);
    exchange(
        dev, group, plan, [&](int d, uint32_t i, uint8_t* out) { copy_y_row(d, i, out); },
        [&](int s, uint32_t count, const uint8_t* rows) {
          if (count != tokens_from[s].size()) {
            if (mismatch.empty())
              mismatch = "rank " + std::to_string(group.ranks[s]) + " returned " + std::to_string(count) +
                         " rows where this rank sent it " + std::to_string(tokens_from[s].size()) + " tokens";
            return;
          }
          for (uint32_t j = 0; j < count; ++j)
            add_y_row(acc + size_t(tokens_from[s][j]) * H, rows + uint64_t(j) * plan.row_bytes);
        });
  }
  if (!mismatch.empty()) abort_group(dev, group, "uccl_ep combine: " + mismatch + " (stale handle?)");
  store_as(acc, values, a.out, a.dtype);
}

}  // namespace uccl_ep::cpu
