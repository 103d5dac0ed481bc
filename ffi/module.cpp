// The Python extension `jax_uccl_ep._uccl_ep`: FFI handler capsules for registration, the settings, the runtimes'
// lifecycle and errors. The handlers, kernels and runtimes it binds live in the core library (libuccl_ep_core);
// the hooks for tests and benchmarks are another extension over that library (testing.cpp), which this one never
// loads.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <stdexcept>

#include "../kernels/contract.hpp"
#include "../kernels/fp8.hpp"
#include "../kernels/nvl/sizes.hpp"
#include "../kernels/proxy_regions.hpp"
#include "../kernels/settings.hpp"
#include "../proxy/host_memory.hpp"
#include "../proxy/runtime.hpp"
#include "common.hpp"
#include "cpu_handlers.hpp"
#include "python_errors.hpp"
#ifdef UCCL_EP_WITH_CUDA
#include "../kernels/nvl/api.hpp"
#include "cuda_handlers.hpp"
#endif

namespace nb = nanobind;
using namespace uccl_ep;

namespace {

template <typename T>
nb::capsule capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

std::vector<uint8_t> to_vec(const nb::bytes& b) {
  const uint8_t* p = static_cast<const uint8_t*>(b.data());
  return std::vector<uint8_t>(p, p + b.size());
}

}  // namespace

NB_MODULE(_uccl_ep, m) {
  register_error_translator();

  m.def("cpu_registrations", [] {
    nb::dict d;
    d["uccl_ep_layout"] = capsule(UcclEpLayoutCpu);
    d["uccl_ep_pair_capacity"] = capsule(UcclEpPairCapacityCpu);
    d["uccl_ep_expand_pairs"] = capsule(UcclEpExpandPairsCpu);
    d["uccl_ep_sum_pairs"] = capsule(UcclEpSumPairsCpu);
    d["uccl_ep_swiglu"] = capsule(UcclEpSwigluCpu);
    d["uccl_ep_swiglu_grad"] = capsule(UcclEpSwigluGradCpu);
#define UCCL_EP_CPU_CAPSULE(stem, name, signature) d[name] = capsule(UcclEp##stem##Cpu);
    UCCL_EP_FFI_OPS(UCCL_EP_CPU_CAPSULE)
    UCCL_EP_FFI_PAIR_OPS(UCCL_EP_CPU_CAPSULE)
#undef UCCL_EP_CPU_CAPSULE
    return d;
  });

#ifdef UCCL_EP_WITH_CUDA
  // GPUs: NVLink buffers mapped among the GPUs of a host.
  m.def("cuda_registrations", [] {
    nb::dict d;
    d["uccl_ep_layout"] = capsule(UcclEpLayoutCuda);
    d["uccl_ep_pair_capacity"] = capsule(UcclEpPairCapacityCuda);
    d["uccl_ep_expand_pairs"] = capsule(UcclEpExpandPairsCuda);
    d["uccl_ep_sum_pairs"] = capsule(UcclEpSumPairsCuda);
    d["uccl_ep_swiglu"] = capsule(UcclEpSwigluCuda);
    d["uccl_ep_swiglu_grad"] = capsule(UcclEpSwigluGradCuda);
#define UCCL_EP_CUDA_CAPSULE(stem, name, signature) d[name] = capsule(UcclEp##stem##Cuda);
    UCCL_EP_FFI_OPS(UCCL_EP_CUDA_CAPSULE)
    UCCL_EP_FFI_PAIR_OPS(UCCL_EP_CUDA_CAPSULE)
#undef UCCL_EP_CUDA_CAPSULE
    return d;
  });
  m.def(
      "nvl_start",
      [](size_t buffer_bytes, size_t low_latency_bytes, int num_ranks, const std::vector<std::pair<int, int>>& local,
         const std::vector<int32_t>& global_of_local) {
        nb::gil_scoped_release release;
        nvl::NvlRuntime::get().start(buffer_bytes, low_latency_bytes, num_ranks, local, global_of_local);
      },
      nb::arg("buffer_bytes"), nb::arg("low_latency_bytes"), nb::arg("num_ranks"), nb::arg("local"),
      nb::arg("global_of_local") = std::vector<int32_t>{});
  m.def("nvl_gpu_initiated_normal", [](uint32_t num_ranks) { return nvl::gpu_initiated_normal(num_ranks); });
  m.def("nvl_gpu_initiated_low_latency", [](uint32_t num_ranks) { return nvl::gpu_initiated_low_latency(num_ranks); });
  m.def("nvl_ipc_handles", [] {
    nb::dict d;
    for (auto& [rank, h] : nvl::NvlRuntime::get().ipc_handles()) d[nb::int_(rank)] = nb::bytes(h.data(), h.size());
    return d;
  });
  m.def("nvl_connect", [](const std::vector<nb::bytes>& handles) {
    std::vector<std::vector<uint8_t>> v;
    for (auto& b : handles) v.push_back(to_vec(b));
    nb::gil_scoped_release release;
    nvl::NvlRuntime::get().connect(v);
  });
  m.def("nvl_shutdown", [] {
    nb::gil_scoped_release release;
    nvl::NvlRuntime::get().shutdown();
  });
  m.def("nvl_is_initialized", [] { return nvl::NvlRuntime::get().initialized(); });
  m.def("proxy_check_errors", [] { nvl::check_proxy_errors("check_errors"); });
  // Every local GPU is checked (and cleared); one error names them all.
  m.def("nvl_check_errors", [] { nvl::NvlRuntime::get().check_errors("check_errors"); });
  m.def("nvl_buffer_bytes_held", [] {  // per local GPU: (normal, low-latency) bytes allocated
    std::vector<std::pair<size_t, size_t>> out;
    for (auto* d : nvl::NvlRuntime::get().devices()) out.emplace_back(d->buffer_bytes(), d->low_latency_bytes());
    return out;
  });
  m.def("install_pinned_host_allocator", &nvl::install_pinned_host_allocator);
#endif
  m.def("host_allocator", [] { return std::string(host_allocator_name()); });

  // Buffer sizes for shapes, in any build (a job's buffers can be sized where it is planned).
  m.def("nvl_bytes_needed", [](int num_ranks, int num_tokens, int64_t x_row_bytes, int64_t scale_row_bytes, int topk,
                               bool weights, int combine_hidden, bool combine_bf16) {
    const FloatType combine_dtype = combine_bf16 ? FloatType::kBF16 : FloatType::kF32;
    return nvl::nvl_buffer_bytes_for(
        num_ranks, nvl::normal_message_bytes(num_ranks, num_tokens, x_row_bytes, scale_row_bytes, topk, weights,
                                             combine_hidden, combine_dtype));
  });
  m.def("nvl_low_latency_bytes_needed", &nvl::low_latency_bytes_for);
  // routing: 0 flat, 1 hierarchical rounds, 2 two-level (NodeRouting).
  m.def("proxy_bytes_needed", [](int num_ranks, int group_ranks, int routing, int ranks_per_node, int group_nodes,
                                 bool gpus, int num_tokens, int hidden, int64_t x_row_bytes, int64_t scale_row_bytes,
                                 int topk, bool weights, bool combine_bf16, int low_latency_max_tokens, int num_experts,
                                 int64_t low_latency_x_row_bytes, int64_t low_latency_scale_row_bytes,
                                 bool low_latency_combine_bf16) {
    if (routing < 0 || routing > 2) throw std::invalid_argument("uccl_ep: routing must be 0, 1 or 2");
    ProxyShapes s;
    s.num_ranks = num_ranks, s.group_ranks = group_ranks, s.routing = NodeRouting(routing);
    s.ranks_per_node = ranks_per_node, s.group_nodes = group_nodes, s.gpus = gpus;
    s.num_tokens = num_tokens, s.hidden = hidden;
    s.x_row_bytes = x_row_bytes, s.scale_row_bytes = scale_row_bytes, s.topk = topk, s.weights = weights;
    s.combine_dtype = combine_bf16 ? FloatType::kBF16 : FloatType::kF32;
    s.low_latency_max_tokens = low_latency_max_tokens, s.num_experts = num_experts;
    s.low_latency_x_row_bytes = low_latency_x_row_bytes, s.low_latency_scale_row_bytes = low_latency_scale_row_bytes;
    s.low_latency_combine_dtype = low_latency_combine_bf16 ? FloatType::kBF16 : FloatType::kF32;
    return buffer_bytes_for_region(std::max<uint64_t>(1, proxy_region_bytes(s)), uint32_t(num_ranks));
  });

  nb::class_<Settings>(m, "Settings")
      .def(nb::init<>())
      .def_rw("timeout_s", &Settings::timeout_s)
      .def_rw("num_sms", &Settings::num_sms)
      .def_rw("num_send_sms", &Settings::num_send_sms)
      .def_rw("nvl_bulk", &Settings::nvl_bulk)
      .def_rw("nvl_pull_combine", &Settings::nvl_pull_combine)
      .def_rw("nvl_pull_dispatch", &Settings::nvl_pull_dispatch)
      .def_rw("ll_num_sms", &Settings::ll_num_sms)
      .def_rw("ll_fused", &Settings::ll_fused)
      .def_rw("kernel_timing", &Settings::kernel_timing);
  m.def("configure", &configure);  // jax_uccl_ep/config.py's settings for the kernels and handlers

  nb::class_<Config>(m, "ProxyConfig")
      .def(nb::init<>())
      .def_rw("providers", &Config::providers)
      .def_rw("num_channels", &Config::num_channels)
      .def_rw("buffer_bytes", &Config::buffer_bytes)
      .def_rw("timeout_s", &Config::timeout_s)
      .def_rw("max_inflight_writes", &Config::max_inflight_writes)
      .def_rw("max_write_bytes", &Config::max_write_bytes)
      .def_rw("max_inflight_bytes", &Config::max_inflight_bytes)
      .def_rw("park_after_idle_s", &Config::park_after_idle_s)
      .def_rw("ring_capacity", &Config::ring_capacity);

  m.def("start", [](const Config& config, uint32_t num_ranks, const std::vector<std::pair<int, uint32_t>>& local) {
    Runtime::get().start(config, num_ranks, local);
  });
  m.def("local_infos", [] {
    std::vector<nb::bytes> out;
    for (auto& v : Runtime::get().local_infos()) out.emplace_back(v.data(), v.size());
    return out;
  });
  m.def("connect", [](const std::vector<nb::bytes>& infos) {
    std::vector<std::vector<uint8_t>> v;
    for (auto& b : infos) v.push_back(to_vec(b));
    nb::gil_scoped_release release;
    Runtime::get().connect(v);
  });
  m.def("take_op_errors", [] { return uccl_ep::ffi_common::take_op_errors(); });
  // The codes Python passes as attributes, from the enums the kernels use: tests/test_config.py checks that the
  // Python side's names map to these values.
  m.def("enum_codes", [] {
    nb::dict out;
    nb::dict path, overflow, level, cast;
    path["CPU"] = int64_t(Path::kCpu);
    path["NVLINK"] = int64_t(Path::kNvlink);
    path["NODE_NVLINK"] = int64_t(Path::kNodeNvlink);
    path["PROXY_GPU"] = int64_t(Path::kProxyGpu);
    path["STAGED"] = int64_t(Path::kStaged);
    overflow["error"] = int64_t(Overflow::kError);
    overflow["drop"] = int64_t(Overflow::kDrop);
    level["flat"] = int64_t(Level::kFlat);
    level["node"] = int64_t(Level::kNode);
    level["across"] = int64_t(Level::kAcross);
    cast["none"] = int(Fp8Cast::kNone);
    cast["cast"] = int(Fp8Cast::kCast);
    cast["power_of_two_scales"] = int(Fp8Cast::kCastPowerOfTwoScales);
    out["Path"] = path;
    out["Overflow"] = overflow;
    out["Level"] = level;
    out["Fp8Cast"] = cast;
    return out;
  });
  m.def("ops_running", [] { return uccl_ep::ffi_common::op_error_log().running.load(); });
  m.def("quiesce", [](double seconds) {
    nb::gil_scoped_release release;
    Runtime::get().quiesce(seconds);
  });
  m.def("shutdown", [] {
    nb::gil_scoped_release release;
    Runtime::get().shutdown();
  });
  m.def("is_initialized", [] { return Runtime::get().initialized(); });
}
