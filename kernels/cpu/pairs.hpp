// dispatch(layout="expert") on CPU devices: the receive writes the pair buffer (kernels/contract.hpp, PairBuffer),
// combine sums each received row's pairs before its rows go back, and combine's backward writes the pair slots.
// Each runs the token-row op of normal.hpp into a scratch of the C received rows: the host receives every source's
// message before any row's slot is known (a slot's offset counts the pairs of all sources), so the rows are copied
// once more here than a count round ahead would need, and one round fewer runs.
#pragma once
#include <cstdint>
#include <string>

#include "exchange.hpp"

namespace uccl_ep::cpu {

// What a rank whose pairs need more than the buffer's `capacity` slots raises (this file's dispatch and, on the
// paths that lay out pairs in XLA, the FFI's check of the agreed numbers).
std::string pair_overflow_message(const std::string& rank, int64_t needed, int64_t capacity);

// `rows`: the token dispatch's arguments, its received-row outputs unset (capacity: the C rows, which never drop);
// is_token_in_rank and recv_counts are written (the handle). Under Overflow::kError (rows.overflow) a routing whose
// pairs may not fit ends with a round of verdicts: every rank raises the overflow in the op.
void dispatch_pairs(Device& dev, const Group& group, DispatchArgs rows, const PairBuffer& pairs);

// ExpandPairsArgs on the host.
void expand_pairs(const ExpandPairsArgs& a);

// SumPairsArgs on the host.
void sum_pairs(const SumPairsArgs& a);

// Sends x by the handle's routing and writes each received row to its pair slots: out [num_pairs, row_bytes], zeros
// where pair_row (C outside the groups) names no row. `rows`: cached dispatch's arguments, recv_x unset, capacity C.
void cached_dispatch_pairs(Device& dev, const Group& group, CachedDispatchArgs rows, const int32_t* pair_row,
                           int num_pairs, void* out);

// Sums each received row's pairs (sum_pairs: pair_of [C, topk], slots past num_pairs are none), the sums in the
// pairs' type, and combines those rows. `rows`: combine's arguments, y unset, capacity C.
void combine_pairs(Device& dev, const Group& group, CombineArgs rows, const void* pair_y, int num_pairs,
                   const int32_t* pair_of, int topk);

}  // namespace uccl_ep::cpu
