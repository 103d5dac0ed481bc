// How the library's errors reach Python, for each extension module (module.cpp, testing.cpp): the runtime's
// timeouts as TimeoutError, bad arguments as ValueError, with their messages unchanged.
#pragma once
#include <nanobind/nanobind.h>

#include <exception>
#include <stdexcept>

#include "../proxy/errors.hpp"

namespace uccl_ep {

inline void register_error_translator() {
  nanobind::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const TimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
}

}  // namespace uccl_ep
