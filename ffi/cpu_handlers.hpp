// FFI handler symbols for platform "cpu" (cpu_handlers.cpp, registered from Python), and, in CUDA builds, the
// host-staged path the CUDA handlers run for Path::kStaged.
#pragma once
#include "common.hpp"
#include "xla/ffi/api/ffi.h"
#ifdef UCCL_EP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLayoutCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpPairCapacityCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpExpandPairsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpSumPairsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpSwigluCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpSwigluGradCpu);
#define UCCL_EP_DECLARE_CPU(stem, name, signature) XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEp##stem##Cpu);
UCCL_EP_FFI_OPS(UCCL_EP_DECLARE_CPU)
UCCL_EP_FFI_PAIR_OPS(UCCL_EP_DECLARE_CPU)
#undef UCCL_EP_DECLARE_CPU

#ifdef UCCL_EP_WITH_CUDA
namespace uccl_ep::ffi_cpu {
// Op `Op` (ffi_common::DispatchOp, ...) host-staged: its CPU implementation on host copies of the buffers
// (staged.hpp), called with the CUDA handler's arguments. `Impl` is that implementation's type, ffi::Error(int32_t
// ordinal, Args...), whose Args are the CUDA handler's after its stream: cpu_handlers.cpp instantiates one per op from
// its implementations, so a CUDA handler whose arguments differ leaves libuccl_ep_core with an undefined symbol, and
// the extension fails to load.
template <class Op, class Impl>
struct StagedOp;
template <class Op, class... Args>
struct StagedOp<Op, xla::ffi::Error(int32_t, Args...)> {
  static xla::ffi::Error call(cudaStream_t stream, int32_t ordinal, Args... args);
};
}  // namespace uccl_ep::ffi_cpu
#endif
