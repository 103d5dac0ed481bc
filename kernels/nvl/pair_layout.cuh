// dispatch(layout="expert")'s pair layout on the GPU, where the receive writes the pair buffer: the pair buffer's
// slots (the contract's PairBuffer rule, which kernels/cpu/pairs.cpp and jax_uccl_ep/_pairs.py follow too), laid out
// after the routing scan has placed the rows and before any row moves, so that the receive copies each row straight
// into its slots. Two passes over units of blockDim.x received rows: count each unit's pairs of each local expert,
// then, once every unit is counted, give each pair its slot (its expert's offset, then every earlier unit's pairs of
// that expert, then the earlier rows' of its unit, in row order, a row's slots in k order). The NVLink path's launch
// (pulled or sent, with bulk copies) runs both passes with hand-overs between them (normal_nvlink.cu: lay_out_pairs);
// the proxy path runs them as kernels of their own (normal_proxy.cu). The buffer holds every top-k slot of every row
// (the callers check), so every received row is kept. Included by those two .cu files only (anonymous namespace).
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../contract.hpp"
#include "api.hpp"
#include "bulk.cuh"
#include "device_common.cuh"
#include "normal_scan.cuh"

namespace uccl_ep::nvl {
namespace {

constexpr int kMaxPairGroups = 256;  // local experts
constexpr int kMaxPairTopk = 32;     // a row's slots, one lane each where a warp reads them

// The tables' bytes in a block's dynamic shared memory: [G] offsets, totals and the unit's bases, [warps, G] each
// warp's first slot and lane mask of each expert, [threads, K] each row's local experts.
__host__ __device__ constexpr size_t pair_tables_bytes(int groups, int topk, int threads) {
  return (size_t(3) + size_t(2) * size_t(threads / kWarp)) * size_t(groups) * 4 + size_t(threads) * size_t(topk) * 4;
}
// The NVLink launch lays the pairs out in the shared memory its stages take later.
static_assert(pair_tables_bytes(kMaxPairGroups, kMaxPairTopk, kTransferThreads) <= kBulkSharedBytes / 2,
              "the pair layout's tables must fit a block's stages");

struct PairLayout {
  PairBuffer out;  // the op's outputs; out.stats[0] is the scan's rows kept
  int64_t x_row_bytes, scale_row_bytes;
  int32_t* unit_counts;  // scratch [units, G]: each unit's pairs of each expert
  int groups, units;     // units of blockDim.x received rows
};

// dispatch_pairs' preconditions on every path whose receive writes the pairs (`where`: the path, for the message):
// a buffer of every top-k slot of every row the group can send, which no routing overflows.
inline void check_pair_buffer(const char* op, const DispatchArgs& a, int group_size, const PairBuffer& p,
                              const char* where) {
  const int K = a.topk, G = a.num_experts / group_size, C = p.rows;
  const int64_t every_slot = int64_t(C) * K + int64_t(p.alignment - 1) * G;  // every top-k slot of every row
  if (G > kMaxPairGroups || K > kMaxPairTopk || p.capacity < every_slot || C != group_size * a.num_tokens)
    throw std::invalid_argument(std::string("uccl_ep ") + op + " " + where + " writes the pair buffer for at most " +
                                std::to_string(kMaxPairGroups) + " local experts, top-" + std::to_string(kMaxPairTopk) +
                                ", a buffer no routing overflows (" + std::to_string(every_slot) +
                                " rows) and every row the group can send; got " + std::to_string(G) + ", top-" +
                                std::to_string(K) + ", " + std::to_string(p.capacity) + " and " + std::to_string(C) +
                                " (jax_uccl_ep lays such pairs out after token rows)");
}

// The token-row dispatch's arguments with the pair buffer for outputs: every row the group can send is kept, its
// rows go to their slots (the receive's pair_of), and no expert index is localized.
inline DispatchArgs pair_dispatch_args(DispatchArgs a, const PairBuffer& p) {
  a.capacity = p.rows;
  a.overflow = Overflow::kError;
  a.recv_x = p.x;
  a.recv_scales = a.scale_row_bytes ? p.scales : nullptr;
  a.recv_topk_idx = nullptr;
  a.recv_topk_weights = nullptr;
  a.recv_num_tokens = p.stats;  // rows kept: stats[0]
  a.num_tokens_per_expert = p.pairs_per_expert;
  return a;
}

// Units of the received rows, and the scratch bytes of their counts.
inline int pair_units(const PairBuffer& p) { return scan_units(p.rows, kTransferThreads); }
inline size_t pair_scratch_bytes(const PairBuffer& p, int groups) {
  return align16(size_t(pair_units(p)) * size_t(groups) * 4);
}
inline PairLayout pair_layout(const DispatchArgs& a, const PairBuffer& p, int groups, void* unit_counts) {
  PairLayout l{};
  l.out = p;
  l.out.weights = a.topk_weights ? p.weights : nullptr;
  l.x_row_bytes = a.x_row_bytes;
  l.scale_row_bytes = a.scale_row_bytes;
  l.unit_counts = static_cast<int32_t*>(unit_counts);
  l.groups = groups;
  l.units = pair_units(p);
  return l;
}

struct PairTables {
  int* offs;           // [G] each expert's first slot
  int* total;          // [G] each expert's pairs
  int* base;           // [G] the unit's first slot of each expert
  int* warp_first;     // [warps, G] each warp's first slot of each expert
  uint32_t* lanes_of;  // [warps, G] the warp's lanes with a pair of each expert
  int* experts;        // [threads, K] each row's local experts, -1 for none
};

__device__ inline PairTables pair_tables(char* smem, int groups) {
  const int warps = int(blockDim.x) / kWarp;
  PairTables t;
  t.offs = reinterpret_cast<int*>(smem);
  t.total = t.offs + groups;
  t.base = t.total + groups;
  t.warp_first = t.base + groups;
  t.lanes_of = reinterpret_cast<uint32_t*>(t.warp_first + warps * groups);
  t.experts = reinterpret_cast<int*>(t.lanes_of + warps * groups);
  return t;
}

// Received row r's local experts k0 .. k0 + kPairSlotsAtOnce - 1 (-1: none, or past K), loaded together from the
// source's routing (over NVLink where the launch pulls): one round trip a chunk.
constexpr int kPairSlotsAtOnce = 8;
__device__ __forceinline__ void local_experts_of(const ScanArgs& scan, int groups, int r, int k0,
                                                 int (&e)[kPairSlotsAtOnce]) {
  const int K = scan.topk, first = scan.self * groups;
  const int2 st = scan.row_map[r];
  const int32_t* idx = scan.src.topk_idx[st.x] + int64_t(st.y) * K;
#pragma unroll
  for (int q = 0; q < kPairSlotsAtOnce; ++q) e[q] = k0 + q < K ? idx[k0 + q] - first : -1;
#pragma unroll
  for (int q = 0; q < kPairSlotsAtOnce; ++q) e[q] = e[q] >= 0 && e[q] < groups ? e[q] : -1;
}

// Pass 1, unit v (the whole block): its pairs of each local expert, into p.unit_counts.
__device__ void count_unit_pairs(const PairLayout& p, const ScanArgs& scan, const PairTables& t, int v) {
  const int K = scan.topk, G = p.groups, tid = int(threadIdx.x), threads = int(blockDim.x);
  const int kept = *scan.recv_num_tokens;
  for (int e = tid; e < G; e += threads) t.total[e] = 0;
  block_sync();
  const int r = v * threads + tid;
  for (int k0 = 0; r < kept && k0 < K; k0 += kPairSlotsAtOnce) {
    int e[kPairSlotsAtOnce];
    local_experts_of(scan, G, r, k0, e);
#pragma unroll
    for (int q = 0; q < kPairSlotsAtOnce; ++q)
      if (e[q] >= 0) atomicAdd(t.total + e[q], 1);
  }
  block_sync();
  for (int e = tid; e < G; e += threads) p.unit_counts[int64_t(v) * G + e] = t.total[e];
  block_sync();
}

// Once every unit is counted (the whole block): each expert's pairs and first slot into the tables; `writes`
// (one block of the grid) writes them, and the slots every pair would need, to the outputs.
__device__ void pair_offsets(const PairLayout& p, const PairTables& t, bool writes) {
  const PairBuffer& o = p.out;
  const int G = p.groups, tid = int(threadIdx.x), threads = int(blockDim.x);
  __shared__ int needed;
  for (int e = tid; e < G; e += threads) {
    int n = 0;
    for (int v = 0; v < p.units; ++v) n += p.unit_counts[int64_t(v) * G + e];
    t.total[e] = n;
  }
  block_sync();
  if (tid == 0) {
    int at = 0;
    for (int e = 0; e < G; ++e) {
      t.offs[e] = at;
      at += (t.total[e] + o.alignment - 1) / o.alignment * o.alignment;
    }
    needed = at;
  }
  block_sync();
  if (writes) {
    for (int e = tid; e < G; e += threads) {
      o.expert_offsets[e] = t.offs[e];
      o.pairs_per_expert[e] = t.total[e];
    }
    if (tid == 0) {
      o.stats[1] = 0;
      o.stats[2] = needed;
    }
  }
}

// Pass 2, unit v (the whole block, after pair_offsets): each of its pairs' slot, row and weight, and each of its
// rows' slots (pair_of), the buffer's capacity for none.
__device__ void place_unit_pairs(const PairLayout& p, const ScanArgs& scan, const PairTables& t, int v) {
  const PairBuffer& o = p.out;
  const int K = scan.topk, G = p.groups, M = o.capacity;
  const int tid = int(threadIdx.x), threads = int(blockDim.x), warp = tid / kWarp, warps = threads / kWarp;
  const int lane = tid % kWarp, kept = *scan.recv_num_tokens;
  for (int e = tid; e < G; e += threads) {
    int b = t.offs[e];
    for (int u = 0; u < v; ++u) b += p.unit_counts[int64_t(u) * G + e];
    t.base[e] = b;
  }
  for (int i = tid; i < warps * G; i += threads) t.warp_first[i] = 0, t.lanes_of[i] = 0;
  block_sync();
  const int r = v * threads + tid;
  bool repeats = false;  // this row names one local expert twice
  for (int k0 = 0; k0 < K; k0 += kPairSlotsAtOnce) {
    int e[kPairSlotsAtOnce];
    if (r < kept)
      local_experts_of(scan, G, r, k0, e);
    else
      for (int& each : e) each = -1;
#pragma unroll
    for (int q = 0; q < kPairSlotsAtOnce; ++q) {
      if (k0 + q >= K) break;
      t.experts[tid * K + k0 + q] = e[q];
      if (e[q] >= 0) {
        atomicAdd(t.warp_first + warp * G + e[q], 1);
        repeats |= (atomicOr(t.lanes_of + warp * G + e[q], 1u << lane) >> lane & 1u) != 0;
      }
    }
  }
  // Where no row of the warp repeats an expert, a lane's earlier pairs of e are its earlier lanes with e: a
  // popcount, where the general count reads every earlier lane's K experts (~K * 32 shared loads a slot).
  const bool one_pair_a_lane = !__any_sync(0xffffffffu, repeats);
  block_sync();
  for (int e = tid; e < G; e += threads)
    for (int w = 0, at = t.base[e]; w < warps; ++w) {
      const int n = t.warp_first[w * G + e];
      t.warp_first[w * G + e] = at;
      at += n;
    }
  block_sync();
  for (int k0 = 0; r < o.rows && k0 < K; k0 += kPairSlotsAtOnce) {
    float w[kPairSlotsAtOnce] = {};  // the chunk's router weights, loaded together as the experts were
    if (o.weights && r < kept) {
      const int2 st = scan.row_map[r];
      const float* src = scan.src.weights[st.x] + int64_t(st.y) * K;
#pragma unroll
      for (int q = 0; q < kPairSlotsAtOnce; ++q) w[q] = k0 + q < K ? src[k0 + q] : 0.f;
    }
#pragma unroll
    for (int q = 0; q < kPairSlotsAtOnce; ++q) {
      if (k0 + q >= K) break;
      const int k = k0 + q, e = t.experts[tid * K + k];
      int slot = M;
      if (e >= 0) {
        int at = t.warp_first[warp * G + e];  // then the warp's earlier rows' pairs of e, and this row's
        if (one_pair_a_lane) {
          at += __popc(t.lanes_of[warp * G + e] & ((1u << lane) - 1u));
        } else {
          for (int i = warp * kWarp; i < tid; ++i)
            for (int j = 0; j < K; ++j) at += t.experts[i * K + j] == e;
          for (int j = 0; j < k; ++j) at += t.experts[tid * K + j] == e;
        }
        if (at < M) {
          slot = at;
          o.pair_row[slot] = r;
          if (o.weights) o.weights[slot] = w[q];
        }
      }
      o.pair_of[int64_t(r) * K + k] = slot;
    }
  }
  block_sync();
}

// The slots outside the groups (block `block` of `blocks`' share, after pair_offsets): no row, weight 0, and zeros
// with zero_padding (a warp a slot). Nothing in a launch reads them.
__device__ void mark_pairs_outside(const PairLayout& p, const PairTables& t, int block, int blocks) {
  const PairBuffer& o = p.out;
  const int G = p.groups, M = o.capacity;
  const int tid = int(threadIdx.x), threads = int(blockDim.x), warp = tid / kWarp, warps = threads / kWarp;
  const auto outside = [&](int j) {
    const int e = group_of(t.offs, G, j);  // the last expert whose offset is <= j
    return G == 0 || j < t.offs[e] || j >= t.offs[e] + t.total[e];
  };
  for (int j = block * threads + tid; j < M; j += blocks * threads)
    if (outside(j)) {
      o.pair_row[j] = o.rows;
      if (o.weights) o.weights[j] = 0.f;
    }
  if (o.zero_padding) {
    const int lane = tid % kWarp;
    for (int j = block * warps + warp; j < M; j += blocks * warps)
      if (outside(j)) {
        warp_zero(static_cast<char*>(o.x) + int64_t(j) * p.x_row_bytes, p.x_row_bytes, lane);
        if (p.scale_row_bytes)
          warp_zero(static_cast<char*>(o.scales) + int64_t(j) * p.scale_row_bytes, p.scale_row_bytes, lane);
      }
  }
}

}  // namespace
}  // namespace uccl_ep::nvl
