// The settings the kernels and handlers read, handed over by the Python package (jax_uccl_ep/config.py reads
// the environment and holds every default; nothing in C++ reads the environment). Set before a runtime starts
// and between runs, never while an op runs. Defined once, in the core library (settings.cpp), so the extension
// that sets them and the code that reads them share one copy.
#pragma once

namespace uccl_ep {

struct Settings {
  double timeout_s;        // deadline of every wait on a peer
  int num_sms;             // normal mode's SM budget on GPUs: send and receive blocks together
  int num_send_sms;        // the send blocks of that budget (0: a half with bulk copies, else a third)
  bool nvl_bulk;           // normal mode's NVLink kernels move rows by bulk copies (TMA), else by SM stores
  bool nvl_pull_combine;   // combine among GPUs of one process reads the members' rows where they are (pull)
  bool nvl_pull_dispatch;  // dispatch among GPUs of one process reads the members' rows where they are (pull)
  int ll_num_sms;          // blocks of the split low-latency receive kernels
  bool ll_fused;           // a non-split low-latency op's send and receive in one kernel
  int kernel_timing;       // 1: CUDA events around each GPU op; 2: also the low-latency kernels' phase stamps
};

Settings& mutable_settings();  // importing jax_uccl_ep configures it before any op or hook can run
inline const Settings& settings() { return mutable_settings(); }
inline void configure(const Settings& s) { mutable_settings() = s; }

// Test modes of the handlers: set only through the tests' extension (ffi/testing.cpp), never by the package.
struct HandlerTestModes {
  bool poison = false;  // CPU ops fill their outputs with 0xFF first, so rows an op forgets to write show
};
HandlerTestModes& handler_test_modes();

}  // namespace uccl_ep
