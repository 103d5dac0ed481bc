// FFI handler symbols for platform "CUDA" (cuda_handlers.cpp; built only with CUDA): one per op, which runs the
// path the lowering chose (the `path` attribute).
#pragma once
#include "common.hpp"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLayoutCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpPairCapacityCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpExpandPairsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpSumPairsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpSwigluCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpSwigluGradCuda);
#define UCCL_EP_DECLARE_CUDA(stem, name, signature) XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEp##stem##Cuda);
UCCL_EP_FFI_OPS(UCCL_EP_DECLARE_CUDA)
UCCL_EP_FFI_PAIR_OPS(UCCL_EP_DECLARE_CUDA)
#undef UCCL_EP_DECLARE_CUDA
