// The one copy of the settings and test modes (settings.hpp).
#include "settings.hpp"

namespace uccl_ep {

Settings& mutable_settings() {
  static Settings s{};
  return s;
}

HandlerTestModes& handler_test_modes() {
  static HandlerTestModes modes;
  return modes;
}

}  // namespace uccl_ep
