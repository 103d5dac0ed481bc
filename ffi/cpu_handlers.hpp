// FFI handler symbols for platform "cpu" (defined in cpu_handlers.cpp, registered from Python).
#pragma once
#include "xla/ffi/api/ffi.h"

#include "common.hpp"

XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEpLayoutCpu);
#define UCCL_EP_DECLARE_CPU(stem, name, signature) XLA_FFI_DECLARE_HANDLER_SYMBOL(UcclEp##stem##Cpu);
UCCL_EP_FFI_OPS(UCCL_EP_DECLARE_CPU)
#undef UCCL_EP_DECLARE_CPU
