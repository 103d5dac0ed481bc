// The one op error log of the process (common.hpp).
#include "common.hpp"

namespace uccl_ep::ffi_common {

OpErrorLog& op_error_log() {
  static OpErrorLog log;
  return log;
}

}  // namespace uccl_ep::ffi_common
