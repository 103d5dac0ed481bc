#include "low_latency.hpp"

#include "rows.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace uccl_ep::cpu {
namespace {

// (token, slot) pairs of this rank's tokens for each global expert, in token then slot order.
std::vector<std::vector<std::pair<int, int>>> slots_by_expert(const int32_t* topk_idx, int num_tokens, int topk,
                                                              int num_experts) {
  std::vector<std::vector<std::pair<int, int>>> out(num_experts);
  for (int t = 0; t < num_tokens; ++t)
    for (int k = 0; k < topk; ++k) {
      int32_t e = topk_idx[size_t(t) * topk + k];
      if (e >= 0 && e < num_experts) out[e].push_back({t, k});
    }
  return out;
}

}  // namespace

namespace {

// Row: x | scales | local expert (int32) | slot on the source, token * K + k (int32) | router weight (float32, 0
// without topk_weights) | padding.
uint64_t dispatch_meta_offset(const LowLatencyDispatchArgs& a) { return a.x_row_bytes + a.scale_row_bytes; }
constexpr uint64_t kDispatchMetaBytes = 12;
uint64_t dispatch_row_bytes(uint64_t x_row_bytes, uint64_t scale_row_bytes) {
  return round_up16(x_row_bytes + scale_row_bytes + kDispatchMetaBytes);
}
uint64_t dispatch_row_bytes(const LowLatencyDispatchArgs& a) {
  return dispatch_row_bytes(a.x_row_bytes, a.scale_row_bytes);
}
uint64_t dispatch_shape_tag(const LowLatencyDispatchArgs& a) {
  return (uint64_t(a.max_tokens_per_rank) << 40) ^ (uint64_t(a.num_experts) << 20) ^ a.x_row_bytes ^
         (uint64_t(a.scale_row_bytes) << 52);
}
uint64_t combine_row_bytes(const LowLatencyCombineArgs& a) {
  return uint64_t(a.hidden) * uint64_t(float_bytes(a.dtype));
}
uint64_t combine_shape_tag(const LowLatencyCombineArgs& a) {
  return (uint64_t(a.max_tokens_per_rank) << 40) ^ (uint64_t(a.num_experts) << 20) ^ combine_row_bytes(a);
}

}  // namespace

namespace {

// Builds the send side of a dispatch round (plan and packer) and hands it to `run`.
template <class Run>
void with_dispatch_send(Device& dev, const Group& group, const LowLatencyDispatchArgs& a, Run&& run) {
  const int R = group.size, L = a.num_experts / R, N = a.max_tokens_per_rank;
  ExchangePlan plan{
      OpKind::kLowLatencyDispatch, a.op_index, dispatch_row_bytes(a),
      dispatch_shape_tag(a),       {},         check_topk(a.topk_idx, a.num_tokens, a.topk, a.num_experts)};
  if (plan.local_error.empty() && a.num_tokens > N)
    plan.local_error = "rank " + std::to_string(dev.rank()) + " has " + std::to_string(a.num_tokens) +
                       " tokens, more than max_tokens_per_rank=" + std::to_string(N);
  auto slots = slots_by_expert(a.topk_idx, a.num_tokens, a.topk, a.num_experts);
  // A row goes per slot, and an expert holds N rows from each rank: only a token naming an expert in more than one
  // slot can pass that. Refused here, on every rank before any row moves, rather than where the rows land.
  for (int e = 0; e < a.num_experts && plan.local_error.empty(); ++e) {
    if (int(slots[e].size()) <= N) continue;
    int repeated = 0;  // a token that names e twice (slots are in token order)
    for (size_t i = 1; i < slots[e].size(); ++i)
      if (slots[e][i].first == slots[e][i - 1].first) {
        repeated = slots[e][i].first;
        break;
      }
    plan.local_error =
        "rank " + std::to_string(dev.rank()) + " sends " + expert_rows_past_n(e, int64_t(slots[e].size()), N, repeated);
  }
  // Message to member d: for each of its local experts, the tokens that chose it.
  for (int d = 0; d < R; ++d) {
    uint32_t rows = 0;
    for (int l = 0; l < L; ++l) rows += uint32_t(slots[d * L + l].size());
    plan.rows_to.push_back(rows);
  }
  const uint64_t meta = dispatch_meta_offset(a);
  PackRow pack = [&](int d, uint32_t i, uint8_t* out) {
    int l = 0;
    while (i >= slots[d * L + l].size()) i -= uint32_t(slots[d * L + l++].size());
    const auto [t, k] = slots[d * L + l][i];
    if (a.cast != Fp8Cast::kNone)
      cast_row_to_fp8(bytes_of(a.x) + size_t(t) * a.x_row_bytes * (a.x_bf16 ? 2 : 4), a.x_bf16, int(a.x_row_bytes),
                      a.cast, out, out + a.x_row_bytes);
    else {
      std::memcpy(out, bytes_of(a.x) + size_t(t) * a.x_row_bytes, a.x_row_bytes);
      if (a.scale_row_bytes)
        std::memcpy(out + a.x_row_bytes, bytes_of(a.scales) + size_t(t) * a.scale_row_bytes, a.scale_row_bytes);
    }
    const int32_t lt[2] = {l, t * a.topk + k};
    const float weight = a.topk_weights ? a.topk_weights[size_t(t) * a.topk + k] : 0.f;
    std::memcpy(out + meta, lt, 8);
    std::memcpy(out + meta + 8, &weight, 4);
  };
  run(plan, pack);
}

// Builds the receive side of a dispatch round (unpacker into the outputs), hands it to `run`, then finishes the
// outputs (padding, counts).
template <class Run>
void with_dispatch_receive(Device& dev, const Group& group, const LowLatencyDispatchArgs& a, Run&& run) {
  const int R = group.size, L = a.num_experts / R, N = a.max_tokens_per_rank;
  const uint64_t meta = dispatch_meta_offset(a), row_bytes = dispatch_row_bytes(a);
  const size_t slab = size_t(R) * N;  // rows per local expert
  std::vector<int32_t> fill(L, 0);
  std::memset(a.layout, 0, sizeof(int32_t) * L * R);
  std::string bad;
  UnpackRows unpack = [&](int s, uint32_t count, const uint8_t* rows) {
    for (uint32_t j = 0; j < count; ++j) {
      const uint8_t* in = rows + uint64_t(j) * row_bytes;
      int32_t lt[2];
      std::memcpy(lt, in + meta, 8);
      if (lt[0] < 0 || lt[0] >= L || fill[lt[0]] >= int32_t(slab)) {
        if (bad.empty())
          bad = "rank " + std::to_string(group.ranks[s]) + " sent a row for local expert " + std::to_string(lt[0]) +
                " that does not fit";
        continue;
      }
      size_t o = size_t(lt[0]) * slab + size_t(fill[lt[0]]++);
      std::memcpy(bytes_of(a.recv_x) + o * a.x_row_bytes, in, a.x_row_bytes);
      if (a.scale_row_bytes)
        std::memcpy(bytes_of(a.recv_scales) + o * a.scale_row_bytes, in + a.x_row_bytes, a.scale_row_bytes);
      a.src_slot[o] = lt[1];
      std::memcpy(&a.recv_weights[o], in + meta + 8, 4);
      ++a.layout[size_t(lt[0]) * R + s];
    }
  };
  run(unpack);
  if (!bad.empty()) abort_group(dev, group, "uccl_ep low_latency_dispatch: " + bad);
  // Padding rows are defined: zeros, no source token.
  for (int l = 0; l < L; ++l) {
    a.recv_count[l] = fill[l];
    size_t first = size_t(l) * slab + size_t(fill[l]), pad = slab - size_t(fill[l]);
    std::memset(bytes_of(a.recv_x) + first * a.x_row_bytes, 0, pad * a.x_row_bytes);
    if (a.scale_row_bytes) std::memset(bytes_of(a.recv_scales) + first * a.scale_row_bytes, 0, pad * a.scale_row_bytes);
    for (size_t i = 0; i < pad; ++i) {
      a.src_slot[first + i] = -1;
      a.recv_weights[first + i] = 0.f;
    }
  }
}

// Where the dispatch carried the router weights: source s's rows as one row per token, the sum of the token's rows
// here weighted (float32, then y's dtype), in the order the source reads them with its topk_idx holding only each
// rank's first slot (with_combine_receive): by the local expert of the token's first slot here, then token.
struct TokenSums {
  int hidden = 0;
  std::vector<float> sums;   // [tokens here, hidden], in the order the tokens were met
  std::vector<int> message;  // the message's rows: indices into sums
  const float* row(uint32_t i) const { return sums.data() + size_t(message[i]) * hidden; }
};
TokenSums sums_for_source(const LowLatencyCombineArgs& a, int s, int R, int L, const std::vector<int32_t>& begin) {
  const size_t slab = size_t(R) * a.max_tokens_per_rank;
  TokenSums out;
  out.hidden = a.hidden;
  std::vector<int> index(size_t(a.max_tokens_per_rank), -1);  // token -> its sum
  std::vector<int> token, first, expert;                      // by sum: the token, its first slot here and its expert
  size_t rows = 0;
  for (int l = 0; l < L; ++l) rows += size_t(std::max(0, a.layout[size_t(l) * R + s]));
  out.sums.reserve(std::min(rows, size_t(a.max_tokens_per_rank)) * size_t(a.hidden));
  for (int l = 0; l < L; ++l)
    for (int i = 0; i < a.layout[size_t(l) * R + s]; ++i) {
      const size_t o = size_t(l) * slab + size_t(begin[size_t(l) * R + s]) + size_t(i);
      const int j = a.src_slot[o], t = j / a.topk, k = j % a.topk;
      if (j < 0 || t >= a.max_tokens_per_rank) continue;  // no source slot (stale handle): the source's count check
      int& at = index[size_t(t)];
      if (at < 0) {
        at = int(token.size());
        token.push_back(t), first.push_back(k), expert.push_back(l);
        out.sums.resize(out.sums.size() + size_t(a.hidden), 0.f);
      } else if (k < first[size_t(at)]) {
        first[size_t(at)] = k, expert[size_t(at)] = l;
      }
      add_row(out.sums.data() + size_t(at) * a.hidden, bytes_of(a.y) + o * combine_row_bytes(a), size_t(a.hidden),
              a.dtype, a.row_weights[o]);
    }
  out.message.resize(token.size());
  for (size_t i = 0; i < token.size(); ++i) out.message[i] = int(i);
  std::sort(out.message.begin(), out.message.end(), [&](int x, int y) {
    return std::tie(expert[size_t(x)], token[size_t(x)]) < std::tie(expert[size_t(y)], token[size_t(y)]);
  });
  return out;
}

template <class Run>
void with_combine_send(const Group& group, const LowLatencyCombineArgs& a, Run&& run) {
  const int R = group.size, L = a.num_experts / R, N = a.max_tokens_per_rank;
  const uint64_t row_bytes = combine_row_bytes(a);
  const size_t slab = size_t(R) * N;
  // Rows from source s of local expert l sit at [begin[l][s], + layout[l][s]) of y[l].
  std::vector<int32_t> begin(size_t(L) * R, 0);
  ExchangePlan plan{OpKind::kLowLatencyCombine, a.op_index, round_up16(row_bytes), combine_shape_tag(a), {}, ""};
  for (int s = 0; s < R; ++s) {
    uint32_t rows = 0;
    for (int l = 0; l < L; ++l) {
      int32_t n = a.layout[size_t(l) * R + s];
      begin[size_t(l) * R + s] = s == 0 ? 0 : begin[size_t(l) * R + s - 1] + a.layout[size_t(l) * R + s - 1];
      if (n < 0 || begin[size_t(l) * R + s] + n > int64_t(slab))
        plan.local_error = "the handle's layout does not fit y";
      rows += uint32_t(std::max(0, n));
    }
    plan.rows_to.push_back(rows);
  }
  // The fused op holds this rank's routing too: a bad index fails the round on every rank, which stay in step.
  if (plan.local_error.empty() && a.topk_idx)
    plan.local_error = check_topk(a.topk_idx, a.num_tokens, a.topk, a.num_experts);
  std::vector<TokenSums> sums;
  if (!plan.local_error.empty()) {
    plan.rows_to.assign(R, 0);
  } else if (a.row_weights) {
    for (int s = 0; s < R; ++s) {
      sums.push_back(sums_for_source(a, s, R, L, begin));
      plan.rows_to[s] = uint32_t(sums.back().message.size());
    }
  }
  PackRow pack = [&](int s, uint32_t i, uint8_t* out) {
    if (a.row_weights) {
      const float* sum = sums[size_t(s)].row(i);
      store_as(sum, size_t(a.hidden), out, a.dtype);
      return;
    }
    int l = 0;
    while (i >= uint32_t(a.layout[size_t(l) * R + s])) i -= uint32_t(a.layout[size_t(l++) * R + s]);
    size_t row = size_t(l) * slab + size_t(begin[size_t(l) * R + s]) + i;
    std::memcpy(out, bytes_of(a.y) + row * row_bytes, row_bytes);
  };
  run(plan, pack);
}

template <class Run>
void with_combine_receive(Device& dev, const Group& group, const LowLatencyCombineArgs& a, Run&& run) {
  const int L = a.num_experts / group.size;
  const uint64_t row_bytes = round_up16(combine_row_bytes(a));
  std::string bad_input = check_topk(a.topk_idx, a.num_tokens, a.topk, a.num_experts);
  auto slots = slots_by_expert(a.topk_idx, a.num_tokens, a.topk, a.num_experts);
  const size_t values = size_t(a.num_tokens) * a.hidden;
  float* acc = zeroed_accumulator(values);
  std::string mismatch;
  UnpackRows unpack = [&](int r, uint32_t count, const uint8_t* rows) {
    uint32_t expected = 0;
    for (int l = 0; l < L; ++l) expected += uint32_t(slots[r * L + l].size());
    if (count != expected) {
      if (mismatch.empty())
        mismatch = "rank " + std::to_string(group.ranks[r]) + " returned " + std::to_string(count) +
                   " rows where this rank sent it " + std::to_string(expected);
      return;
    }
    uint32_t j = 0;
    for (int l = 0; l < L; ++l)
      for (auto [t, k] : slots[r * L + l]) {
        const uint8_t* in = rows + uint64_t(j++) * row_bytes;
        const float w = a.topk_weights[size_t(t) * a.topk + k];
        add_row(acc + size_t(t) * a.hidden, in, size_t(a.hidden), a.dtype, w);
      }
  };
  run(unpack);
  // A bad index reaches here only in the receive half (the fused op refuses it in its round): the round is done and
  // the peers' results do not depend on this rank's routing, so this rank alone raises and all stay in step. Other
  // routing than the dispatch's shows as a row-count mismatch.
  if (!bad_input.empty()) throw InvalidArgument("uccl_ep low_latency_combine: " + bad_input);
  if (!mismatch.empty()) abort_group(dev, group, "uccl_ep low_latency_combine: " + mismatch + " (stale handle?)");
  store_as(acc, values, bytes_of(a.out), a.dtype);
}

}  // namespace

uint64_t largest_low_latency_message_bytes(int num_ranks, int num_experts, int max_tokens_per_rank, int topk,
                                           uint64_t x_row_bytes, uint64_t scale_row_bytes, uint64_t combine_row_bytes) {
  // A rank sends a member a row per slot naming one of its experts, and an expert takes at most
  // max_tokens_per_rank rows from a rank; combine returns as many (or, with the weights carried, a sum per token).
  const int local_experts = num_experts / std::max(1, num_ranks);
  const uint64_t rows =
      uint64_t(std::max(0, max_tokens_per_rank)) * uint64_t(std::max(0, std::min(topk, local_experts)));
  return message_bytes(rows, std::max(dispatch_row_bytes(x_row_bytes, scale_row_bytes), round_up16(combine_row_bytes)));
}

void low_latency_dispatch(Device& dev, const Group& group, const LowLatencyDispatchArgs& a) {
  with_dispatch_send(dev, group, a, [&](const ExchangePlan& plan, const PackRow& pack) {
    with_dispatch_receive(dev, group, a, [&](const UnpackRows& unpack) { exchange(dev, group, plan, pack, unpack); });
  });
}

void low_latency_dispatch_send(Device& dev, const Group& group, const LowLatencyDispatchArgs& a) {
  with_dispatch_send(dev, group, a,
                     [&](const ExchangePlan& plan, const PackRow& pack) { exchange_send(dev, group, plan, pack); });
}

void low_latency_dispatch_receive(Device& dev, const Group& group, const LowLatencyDispatchArgs& a) {
  with_dispatch_receive(dev, group, a, [&](const UnpackRows& unpack) {
    exchange_receive(dev, group, OpKind::kLowLatencyDispatch, unpack);
  });
}

void low_latency_combine(Device& dev, const Group& group, const LowLatencyCombineArgs& a) {
  with_combine_send(group, a, [&](const ExchangePlan& plan, const PackRow& pack) {
    with_combine_receive(dev, group, a, [&](const UnpackRows& unpack) { exchange(dev, group, plan, pack, unpack); });
  });
}

void low_latency_combine_send(Device& dev, const Group& group, const LowLatencyCombineArgs& a) {
  with_combine_send(group, a,
                    [&](const ExchangePlan& plan, const PackRow& pack) { exchange_send(dev, group, plan, pack); });
}

void low_latency_combine_receive(Device& dev, const Group& group, const LowLatencyCombineArgs& a) {
  with_combine_receive(dev, group, a, [&](const UnpackRows& unpack) {
    exchange_receive(dev, group, OpKind::kLowLatencyCombine, unpack);
  });
}

}  // namespace uccl_ep::cpu
