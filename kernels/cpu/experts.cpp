// The experts' elementwise step between their grouped matmuls on the host: a loop over the groups' rows.
#include "experts.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "rows.hpp"

namespace uccl_ep::cpu {
namespace {

float load(const void* p, int64_t i, bool bf16) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}
void store(void* p, int64_t i, float v, bool bf16) {
  if (bf16)
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  else
    static_cast<float*>(p)[i] = v;
}

}  // namespace

void swiglu(const SwigluArgs& a) {
  const bool bf16 = a.dtype == FloatType::kBF16;
  const int64_t F = a.features, n = std::clamp<int64_t>(*a.num_rows, 0, a.rows);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t gate_at = r * 2 * F, up_at = gate_at + F;
    const float w = a.weight[r];
    float dw = 0.0f;
    for (int64_t f = 0; f < F; ++f) {
      const float g = load(a.gate_up, gate_at + f, bf16), u = load(a.gate_up, up_at + f, bf16);
      const float sig = 1.0f / (1.0f + std::exp(-g)), silu = g * sig;
      if (!a.dh) {
        store(a.out, r * F + f, silu * u * w, bf16);
        continue;
      }
      const float dh = load(a.dh, r * F + f, bf16);
      dw += dh * silu * u;
      store(a.out, gate_at + f, dh * w * u * sig * (1.0f + g * (1.0f - sig)), bf16);
      store(a.out, up_at + f, dh * w * silu, bf16);
    }
    if (a.dh) a.d_weight[r] = dw;
  }
}

}  // namespace uccl_ep::cpu
