#include "pairs.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "normal.hpp"
#include "rows.hpp"

namespace uccl_ep::cpu {
namespace {

int64_t aligned(int64_t n, int alignment) { return (n + alignment - 1) / alignment * alignment; }

// The slots of the received rows' pairs (PairBuffer's rule): fills pair_of, pair_row, the offsets, the counts and the
// stats; returns the (row * K + slot) of each pair slot, -1 outside the groups.
std::vector<int64_t> lay_out(const int32_t* expert, int valid_rows, int K, int groups, const PairBuffer& p) {
  const int C = p.rows, M = p.capacity;
  std::vector<int64_t> through(groups, 0), kept;  // pairs of each expert in the rows so far; in the kept rows
  int64_t needed = 0, pairs = 0;                  // aligned slots of the rows so far, valid pairs of all rows
  int rows_kept = 0;
  auto local = [&](int row, int k) {
    const int32_t e = expert[int64_t(row) * K + k];
    return e >= 0 && e < groups ? e : -1;
  };
  for (int r = 0; r < valid_rows; ++r) {
    for (int k = 0; k < K; ++k)
      if (const int e = local(r, k); e >= 0) {
        needed += aligned(through[e] + 1, p.alignment) - aligned(through[e], p.alignment);
        ++through[e];
        ++pairs;
      }
    // A row is kept while every row up to it fits: the aligned total only grows, so the kept rows are a prefix.
    if (rows_kept < r) continue;
    if (needed <= M) {
      ++rows_kept;
      continue;
    }
    kept = through;  // the first row that does not fit: the counts before it
    for (int k = 0; k < K; ++k)
      if (const int e = local(r, k); e >= 0) --kept[e];
  }
  if (rows_kept == valid_rows) kept = through;
  int64_t offset = 0, placed = 0;
  std::vector<int64_t> cursor(groups);
  for (int e = 0; e < groups; ++e) {
    p.expert_offsets[e] = int32_t(offset);
    p.pairs_per_expert[e] = int32_t(kept[e]);
    cursor[e] = offset;
    offset += aligned(kept[e], p.alignment);
    placed += kept[e];
  }
  std::vector<int64_t> source(M, -1);
  std::fill(p.pair_row, p.pair_row + M, C);
  for (int r = 0; r < C; ++r)
    for (int k = 0; k < K; ++k) {
      const int e = r < rows_kept ? local(r, k) : -1;
      int32_t slot = M;
      if (e >= 0) {
        slot = int32_t(cursor[e]++);
        p.pair_row[slot] = r;
        source[slot] = int64_t(r) * K + k;
      }
      p.pair_of[int64_t(r) * K + k] = slot;
    }
  p.stats[0] = rows_kept;
  p.stats[1] = int32_t(pairs - placed);
  p.stats[2] = int32_t(needed);
  return source;
}

}  // namespace

std::string pair_overflow_message(const std::string& rank, int64_t needed, int64_t capacity) {
  return "rank " + rank + " received pairs that need " + std::to_string(needed) +
         " rows (each expert's rounded up to expert_alignment) but capacity is " + std::to_string(capacity) +
         "; pass a capacity of at least that (the default holds every pair only where each token names an expert at "
         "most once; the layer: a larger MoEConfig.capacity_factor) or overflow='drop'";
}

void dispatch_pairs(Device& dev, const Group& group, DispatchArgs rows, const PairBuffer& pairs) {
  const int C = rows.capacity, K = rows.topk, M = pairs.capacity;
  const int groups = rows.num_experts / group.size;
  std::vector<uint8_t> x(size_t(C) * rows.x_row_bytes), scales(size_t(C) * rows.scale_row_bytes);
  std::vector<int32_t> expert(size_t(C) * K), per_expert(groups);
  std::vector<float> weights(rows.topk_weights ? size_t(C) * K : 0);
  int32_t received = 0;
  rows.recv_x = x.data();
  rows.recv_scales = scales.data();
  rows.recv_topk_idx = expert.data();
  rows.recv_topk_weights = rows.topk_weights ? weights.data() : nullptr;
  rows.recv_num_tokens = &received;
  rows.num_tokens_per_expert = per_expert.data();
  const Overflow pair_overflow = rows.overflow;
  rows.overflow = Overflow::kError;  // C rows hold every row the group can send
  dispatch(dev, group, rows);

  const auto source = lay_out(expert.data(), received, K, groups, pairs);
  const int64_t every_slot = int64_t(C) * K + int64_t(pairs.alignment - 1) * groups;
  if (pair_overflow == Overflow::kError && M < every_slot)
    raise_if_any_rank_needs_more(dev, group, rows.op_index, uint64_t(M), rows.overflow_status_over_job,
                                 uint64_t(pairs.stats[2]), [&](uint32_t member, uint64_t needed) {
                                   const std::string of_axis = rows.overflow_status_over_job ? "" : " of the EP axis";
                                   return pair_overflow_message(std::to_string(member) + of_axis, int64_t(needed), M);
                                 });
  for (int s = 0; s < M; ++s) {
    const int64_t from = source[s];
    uint8_t* out_x = bytes_of(pairs.x) + size_t(s) * rows.x_row_bytes;
    uint8_t* out_scales = bytes_of(pairs.scales) + size_t(s) * rows.scale_row_bytes;
    if (from < 0) {
      if (pairs.zero_padding) {
        std::memset(out_x, 0, rows.x_row_bytes);
        std::memset(out_scales, 0, rows.scale_row_bytes);
      }
      if (pairs.weights) pairs.weights[s] = 0.0f;
      continue;
    }
    const size_t row = size_t(from / K);
    std::memcpy(out_x, x.data() + row * rows.x_row_bytes, rows.x_row_bytes);
    std::memcpy(out_scales, scales.data() + row * rows.scale_row_bytes, rows.scale_row_bytes);
    if (pairs.weights) pairs.weights[s] = weights[size_t(from)];
  }
}

void cached_dispatch_pairs(Device& dev, const Group& group, CachedDispatchArgs rows, const int32_t* pair_row,
                           int num_pairs, void* out) {
  const int C = rows.capacity;
  std::vector<uint8_t> received(size_t(C) * rows.row_bytes);
  rows.recv_x = received.data();
  cached_dispatch(dev, group, rows);
  expand_pairs({received.data(), C, rows.row_bytes, pair_row, num_pairs, out, true});
}

void expand_pairs(const ExpandPairsArgs& a) {
  for (int64_t s = 0; s < a.num_slots; ++s) {
    uint8_t* o = bytes_of(a.pairs) + size_t(s) * a.row_bytes;
    const int32_t r = a.pair_row[s];
    if (r >= 0 && r < a.num_rows)
      std::memcpy(o, bytes_of(a.rows) + size_t(r) * a.row_bytes, a.row_bytes);
    else if (a.zero_padding)
      std::memset(o, 0, a.row_bytes);
  }
}

void sum_pairs(const SumPairsArgs& a) {
  const int64_t H = a.hidden;
  std::vector<float> acc(size_t(std::max<int64_t>(H, 1)));
  for (int64_t r = 0; r < a.num_rows; ++r) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < a.topk; ++k) {
      const int32_t s = a.pair_of[r * a.topk + k];
      if (s < 0 || s >= a.num_slots) continue;
      add_row(acc.data(), static_cast<const uint8_t*>(a.pairs) + s * H * float_bytes(a.pairs_dtype), size_t(H),
              a.pairs_dtype);
    }
    store_as(acc.data(), size_t(H), static_cast<uint8_t*>(a.rows) + r * H * float_bytes(a.rows_dtype), a.rows_dtype);
  }
}

void combine_pairs(Device& dev, const Group& group, CombineArgs rows, const void* pair_y, int num_pairs,
                   const int32_t* pair_of, int topk) {
  const int C = rows.capacity, H = rows.hidden;
  std::vector<uint8_t> sums(size_t(C) * H * float_bytes(rows.dtype));
  sum_pairs({pair_y, rows.dtype, num_pairs, H, pair_of, C, topk, sums.data(), rows.dtype});
  rows.y = sums.data();
  combine(dev, group, rows);
}

}  // namespace uccl_ep::cpu
