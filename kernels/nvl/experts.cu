// The experts' elementwise step between their grouped matmuls on GPUs (SwigluArgs), on XLA's stream: a block per
// row of the groups, each thread 16 bytes of gate and of up at a time.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "api.hpp"
#include "device_common.cuh"

namespace uccl_ep::nvl {
namespace {

constexpr int kSwigluThreads = 128;

// V consecutive elements, loaded and stored at once (16 bytes where V * sizeof(T) is).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};
template <typename T, int V>
__device__ __forceinline__ void load(const T* p, float (&out)[V]) {
  const Pack<T, V> x = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_float(x.v[i]);
}
template <typename T, int V>
__device__ __forceinline__ void store(T* p, const float (&in)[V]) {
  Pack<T, V> x;
#pragma unroll
  for (int i = 0; i < V; ++i) x.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, V>*>(p) = x;
}

// The block's sum of each thread's v (thread 0 gets it); the block's threads all call it.
__device__ float block_sum(float v) {
  __shared__ float warp_sums[kSwigluThreads / kWarp];
  for (int d = kWarp / 2; d > 0; d /= 2) v += __shfl_xor_sync(0xffffffffu, v, d);
  if (threadIdx.x % kWarp == 0) warp_sums[threadIdx.x / kWarp] = v;
  block_sync();
  float sum = 0.0f;
  if (threadIdx.x == 0)
    for (int w = 0; w < kSwigluThreads / kWarp; ++w) sum += warp_sums[w];
  block_sync();  // warp_sums is the next row's
  return sum;
}

template <typename T, int V>
__global__ void __launch_bounds__(kSwigluThreads) swiglu_kernel(SwigluArgs a) {
  const int64_t F = a.features, n = min(max(int64_t(*a.num_rows), int64_t(0)), a.rows);
  const bool backward = a.dh != nullptr;
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const T* gate = static_cast<const T*>(a.gate_up) + r * 2 * F;
    const T* up = gate + F;
    const float w = a.weight[r];
    float dw = 0.0f;
    for (int64_t f = int64_t(threadIdx.x) * V; f < F; f += int64_t(kSwigluThreads) * V) {
      float g[V], u[V], x[V], y[V];
      load<T, V>(gate + f, g);
      load<T, V>(up + f, u);
      if (!backward) {
#pragma unroll
        for (int i = 0; i < V; ++i) x[i] = g[i] / (1.0f + expf(-g[i])) * u[i] * w;
        store<T, V>(static_cast<T*>(a.out) + r * F + f, x);
        continue;
      }
      float dh[V];
      load<T, V>(static_cast<const T*>(a.dh) + r * F + f, dh);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float sig = 1.0f / (1.0f + expf(-g[i])), silu = g[i] * sig;
        dw += dh[i] * silu * u[i];
        x[i] = dh[i] * w * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
        y[i] = dh[i] * w * silu;
      }
      T* d_gate = static_cast<T*>(a.out) + r * 2 * F;
      store<T, V>(d_gate + f, x);
      store<T, V>(d_gate + F + f, y);
    }
    if (backward) {
      const float sum = block_sum(dw);
      if (threadIdx.x == 0) a.d_weight[r] = sum;
    }
  }
}

template <typename T>
void launch_swiglu(const SwigluArgs& a, cudaStream_t stream) {
  constexpr int kVector = 16 / sizeof(T);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vectors = a.features % kVector == 0 && aligned(a.gate_up) && aligned(a.out) && (!a.dh || aligned(a.dh));
  // A block per row, grid-stride: the rows in the groups are known only on the GPU, and the blocks past them return.
  const int blocks = int(std::min<int64_t>(a.rows, 8192));
  if (vectors)
    swiglu_kernel<T, kVector><<<blocks, kSwigluThreads, 0, stream>>>(a);
  else
    swiglu_kernel<T, 1><<<blocks, kSwigluThreads, 0, stream>>>(a);
  check(cudaGetLastError(), "swiglu kernel");
}

}  // namespace

void swiglu(const SwigluArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.features == 0) return;
  if (a.dtype == FloatType::kBF16)
    launch_swiglu<__nv_bfloat16>(a, stream);
  else
    launch_swiglu<float>(a, stream);
}

}  // namespace uccl_ep::nvl
