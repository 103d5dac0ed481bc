// FFI handler symbols for platform "cpu" (cpu_handlers.cpp, registered from Python), and, in CUDA builds, the
// host-staged handlers the CUDA handlers run for Path::kStaged.
#pragma once
#include "common.hpp"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLayoutCpu);
#define UCCL_EP_DECLARE_CPU(stem, name, signature) XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEp##stem##Cpu);
UCCL_EP_FFI_OPS(UCCL_EP_DECLARE_CPU)
#undef UCCL_EP_DECLARE_CPU

#ifdef UCCL_EP_WITH_CUDA
namespace uccl_ep::ffi_cpu {
#define UCCL_EP_DECLARE_STAGED(stem, name, signature) XLA_FFI_Error* Staged##stem(XLA_FFI_CallFrame* frame);
UCCL_EP_FFI_OPS(UCCL_EP_DECLARE_STAGED)
#undef UCCL_EP_DECLARE_STAGED
}  // namespace uccl_ep::ffi_cpu
#endif
