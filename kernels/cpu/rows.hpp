// Small helpers the CPU ops share: row padding, float32 <-> bfloat16, and the check of expert indices.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace uccl_ep::cpu {

inline uint64_t round_up16(uint64_t n) { return (n + 15) / 16 * 16; }

// A zeroed float32 accumulator of n values, reused by the calling thread from op to op: a fresh vector per op
// spent a fifth of a large combine faulting its pages in. Each thread that runs combines keeps its largest one
// (T x H floats) until it exits; valid until the thread's next call.
inline float* zeroed_accumulator(size_t n) {
  thread_local std::vector<float> acc;
  if (acc.size() < std::max<size_t>(n, 1)) acc.resize(std::max<size_t>(n, 1));  // never null
  std::fill_n(acc.data(), n, 0.0f);
  return acc.data();
}

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFFu)) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// "" when every index is in [-1, num_experts), else a message naming the first bad one.
inline std::string check_topk(const int32_t* topk_idx, int num_tokens, int topk, int num_experts) {
  for (int t = 0; t < num_tokens; ++t)
    for (int k = 0; k < topk; ++k) {
      int32_t e = topk_idx[size_t(t) * topk + k];
      if (e < -1 || e >= num_experts)
        return "topk_idx[" + std::to_string(t) + ", " + std::to_string(k) + "] = " + std::to_string(e) +
               " is outside [-1, num_experts=" + std::to_string(num_experts) + ")";
    }
  return "";
}

}  // namespace uccl_ep::cpu
