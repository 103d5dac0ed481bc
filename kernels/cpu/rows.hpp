// Small helpers the CPU ops share: row padding, float32 <-> bfloat16 (values and rows), and the check of expert
// indices.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../contract.hpp"
#include "../fp8.hpp"

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

// n float32 values stored as type t at out (bfloat16 rounded to nearest even), the type's loop chosen once.
inline void store_as(const float* values, size_t n, void* out, FloatType t) {
  if (t == FloatType::kF32) {
    std::memcpy(out, values, n * 4);
    return;
  }
  uint16_t* o = static_cast<uint16_t*>(out);
  for (size_t i = 0; i < n; ++i) o[i] = f32_to_bf16(values[i]);
}

// acc[h] += weight * row[h] over a row of n values of type t (the type's loop chosen once per row).
inline void add_row(float* acc, const void* row, size_t n, FloatType t, float weight = 1.f) {
  if (t == FloatType::kF32) {
    const float* v = static_cast<const float*>(row);
    for (size_t h = 0; h < n; ++h) acc[h] += weight * v[h];
    return;
  }
  const uint16_t* v = static_cast<const uint16_t*>(row);
  for (size_t h = 0; h < n; ++h) acc[h] += weight * bf16_to_f32(v[h]);
}

// float32 -> float8_e4m3fn bits, round to nearest even, finite values past 448 saturated (as the GPU's
// conversion with satfinite), NaN -> 0x7F.
inline uint8_t f32_to_e4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (std::isnan(f)) return 0x7F;
  if (a >= 448.f) return sign | 0x7E;
  if (a < 0x1p-6f) return sign | uint8_t(std::nearbyint(a * 0x1p9f));  // subnormals; 8 is the smallest normal
  int e = 0;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1): the unbiased exponent is e - 1
  int q = int(std::nearbyint((std::ldexp(a, 1 - e) - 1.f) * 8.f));
  if (q == 8) q = 0, ++e;
  const int biased = e - 1 + 7;
  if (biased > 15 || (biased == 15 && q == 7)) return sign | 0x7E;
  return sign | uint8_t(biased << 3 | q);
}

// One token's row [hidden] (float32 or bfloat16) cast to FP8 (hidden bytes) with a float32 scale per 128
// channels (hidden / 128 of them, unaligned bytes), by the rule in kernels/fp8.hpp.
inline void cast_row_to_fp8(const uint8_t* row, bool bf16, int hidden, Fp8Cast cast, uint8_t* out, uint8_t* scales) {
  auto value = [&](int c) {
    if (!bf16) {
      float f;
      std::memcpy(&f, row + size_t(c) * 4, 4);
      return f;
    }
    uint16_t v;
    std::memcpy(&v, row + size_t(c) * 2, 2);
    return bf16_to_f32(v);
  };
  for (int b = 0; b < hidden / kFp8Block; ++b) {
    float amax = 0.f;
    for (int c = b * kFp8Block; c < (b + 1) * kFp8Block; ++c) amax = nan_max(amax, std::fabs(value(c)));
    const float scale = fp8_scale(amax, cast), inverse = 1.f / scale;
    std::memcpy(scales + size_t(b) * 4, &scale, 4);
    for (int c = b * kFp8Block; c < (b + 1) * kFp8Block; ++c) out[c] = f32_to_e4m3(value(c) * inverse);
  }
}

// "" when every index is in [-1, num_experts), else a message naming the first bad one.
inline std::string check_topk(const int32_t* topk_idx, int num_tokens, int topk, int num_experts) {
  for (int t = 0; t < num_tokens; ++t)
    for (int k = 0; k < topk; ++k) {
      int32_t e = topk_idx[size_t(t) * topk + k];
      if (e < -1 || e >= num_experts)
        return "topk_idx[" + std::to_string(t) + ", " + std::to_string(k) + "] = " + std::to_string(e) +
               " is outside [-1, num_experts=" + std::to_string(num_experts) + ") (row " + std::to_string(t) +
               " of that rank's own tokens)";
    }
  return "";
}

}  // namespace uccl_ep::cpu
