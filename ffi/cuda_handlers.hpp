// FFI handler symbols for platform "CUDA" (cuda_handlers.cpp; built only with CUDA).
#pragma once
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpDispatchCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpCachedDispatchCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpCombineCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLowLatencyDispatchCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLowLatencyCombineCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLowLatencyDispatchSendCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLowLatencyDispatchRecvCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLowLatencyCombineSendCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLowLatencyCombineRecvCuda);
