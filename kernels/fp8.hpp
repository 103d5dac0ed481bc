// The FP8 cast rule that every backend's low-latency dispatch applies (jax_uccl_ep/fp8.py holds the same rule in
// JAX): per token, each block of 128 channels is divided by its scale, max(amax(|block|), 1e-4) / 448, so the
// block's largest value lands on the largest finite float8_e4m3fn; with power-of-two scales (UE8M0) the scale is
// rounded up to a power of two. Values are multiplied by 1 / scale (a last-bit difference from dividing, so a
// value exactly between two FP8 numbers may land on the other one). Host and device code share the rule; the
// device converts with the hardware instruction.
#pragma once
#include <math.h>

#ifdef __CUDACC__
#define UCCL_EP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define UCCL_EP_HOST_DEVICE inline
#endif

namespace uccl_ep {

constexpr int kFp8Block = 128;    // channels that share one scale
constexpr float kFp8Max = 448.f;  // largest finite float8_e4m3fn

// How a low-latency dispatch sends x: as given, or cast to FP8 on the way (scales plain or powers of two).
enum class Fp8Cast : int { kNone = 0, kCast = 1, kCastPowerOfTwoScales = 2 };

// max that keeps a NaN (fmaxf drops it): a block with a NaN gets a NaN scale, as in JAX.
UCCL_EP_HOST_DEVICE float nan_max(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }

UCCL_EP_HOST_DEVICE float fp8_scale(float amax, Fp8Cast cast) {
  if (!(amax - amax == 0.f)) return amax;          // NaN or inf: the scale is it, as JAX's amax / 448 gives
  float s = fmaxf(amax, 1e-4f) * (1.f / kFp8Max);  // as XLA computes amax / 448 (a product with the reciprocal)
  if (cast == Fp8Cast::kCastPowerOfTwoScales) {    // 2^ceil(log2 s), exactly: s = m * 2^e with m in [0.5, 1)
    int e = 0;
    const float m = frexpf(s, &e);
    s = ldexpf(1.f, m == 0.5f ? e - 1 : e);
  }
  return s;
}

}  // namespace uccl_ep
