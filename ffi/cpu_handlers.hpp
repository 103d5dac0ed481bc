// FFI handler symbols for platform "cpu" (defined in cpu_handlers.cpp, registered from Python).
#pragma once
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLayoutCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpDispatchCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpCachedDispatchCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpCombineCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLowLatencyDispatchCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLowLatencyCombineCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLowLatencyDispatchSendCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLowLatencyDispatchRecvCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLowLatencyCombineSendCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLowLatencyCombineRecvCpu);
