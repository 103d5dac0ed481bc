// FFI handler symbols for platform "CUDA" (cuda_handlers.cpp; built only with CUDA), and the host-staged
// handlers (cpu_handlers.cpp, CUDA builds) they route to on the proxy runtime.
#pragma once
#include "common.hpp"
#include "xla/ffi/api/ffi.h"

#define UCCL_EP_DECLARE_CUDA(stem, name, signature)       \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEp##stem##Cuda);     \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEp##stem##Staged);
UCCL_EP_FFI_OPS(UCCL_EP_DECLARE_CUDA)
#undef UCCL_EP_DECLARE_CUDA

// The levels of two-level routing (normal mode): within a node over NVLink, across nodes through the proxies.
#define UCCL_EP_DECLARE_LEVELS(stem, name, signature)    \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEp##stem##Node);     \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEp##stem##Proxy);
UCCL_EP_FFI_NORMAL_OPS(UCCL_EP_DECLARE_LEVELS)
#undef UCCL_EP_DECLARE_LEVELS
