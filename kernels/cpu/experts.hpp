// The experts' elementwise step between their grouped matmuls on the host (kernels/contract.hpp, SwigluArgs).
#pragma once

#include "../contract.hpp"

namespace uccl_ep::cpu {

// SwigluArgs on the host: the forward without dh, else the backward.
void swiglu(const SwigluArgs& a);

}  // namespace uccl_ep::cpu
