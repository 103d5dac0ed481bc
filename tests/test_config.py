"""Settings: one module reads the environment, the README documents every variable it reads, bad values name
themselves. No runtime needed."""

from __future__ import annotations

import os
import re

import pytest

from jax_uccl_ep import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_variables() -> set[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    table = text[text.index("## Environment variables") :]
    table = table[: table.index("\n## ", 1)]
    return set(re.findall(r"^\| `(UCCL_EP_[A-Z0-9_]+)`", table, re.M))


def test_readme_table_lists_exactly_the_config_variables():
    documented = _readme_variables() - {"UCCL_EP_CUDA"}  # a build option, read by CMake
    assert documented == set(Config.env_names()), (
        f"README only: {sorted(documented - set(Config.env_names()))}; "
        f"Config only: {sorted(set(Config.env_names()) - documented)}"
    )


def test_only_the_settings_module_reads_the_environment():
    readers = []
    for folder in ("jax_uccl_ep", "ffi", "kernels", "proxy"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if not name.endswith((".py", ".cpp", ".hpp", ".cu", ".cuh")):
                    continue
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    text = f.read()
                if re.search(r"getenv\(|os\.environ(?!\.setdefault\(\"CUDA_MODULE_LOADING\")", text):
                    readers.append(os.path.relpath(path, ROOT))
    # The launcher (launch.py) builds its children's environment from its own; nothing else may read it (the tests'
    # harness, tests/spawn.py, reads the test modes' variables outside the package).
    assert sorted(readers) == ["jax_uccl_ep/config.py", "jax_uccl_ep/launch.py"], readers


def test_variables_override_fields_and_unset_ones_keep_them():
    base = Config(num_sms=16, timeout_s=30.0, two_level="0")
    env = {
        "UCCL_EP_NUM_SMS": "40",
        "UCCL_EP_NVL_BULK": "0",
        "UCCL_EP_FI_PROVIDER": "tcp;ofi_rxm",
        "UCCL_EP_TWO_LEVEL": " ",
        "UCCL_EP_GPUS_PER_NODE": "2",
    }
    got = Config.from_env(base, env)
    assert (got.num_sms, got.nvl_bulk, got.fi_provider, got.gpus_per_node) == (40, False, "tcp;ofi_rxm", 2)
    assert (got.timeout_s, got.two_level) == (30.0, "0")  # unset or blank: the field stays
    assert Config.from_env(None, {}) == Config()


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("UCCL_EP_NUM_SMS", "many", "UCCL_EP_NUM_SMS='many' is not a valid integer"),
        ("UCCL_EP_TIMEOUT_S", "-1", "timeout_s \\(UCCL_EP_TIMEOUT_S\\) must be positive"),
        ("UCCL_EP_TWO_LEVEL", "yes", "must be auto, 1 or 0"),
        ("UCCL_EP_BUFFER_BYTES", "0", "buffer_bytes \\(UCCL_EP_BUFFER_BYTES\\) must be positive"),
    ],
)
def test_bad_values_name_the_variable(variable, value, message):
    with pytest.raises(ValueError, match=message):
        Config.from_env(None, {variable: value})


def test_processes_compare_what_peers_depend_on():
    shared = Config().shared()
    assert "UCCL_EP_NUM_SMS" in shared and "UCCL_EP_BUFFER_BYTES" in shared
    assert "UCCL_EP_TIMEOUT_S" not in shared  # each process may wait as long as it likes
    assert Config(num_sms=8).shared() != shared


def test_cluster_launchers_are_recognised_only_for_several_processes():
    from jax_uccl_ep.config import cluster_launcher

    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}
    assert cluster_launcher(slurm) == "Slurm"
    assert cluster_launcher(dict(slurm, SLURM_NTASKS="1")) is None  # one task: nothing to join
    assert cluster_launcher({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4"}) is None  # salloc shell, not an srun step
    assert cluster_launcher({"OMPI_COMM_WORLD_SIZE": "2"}) == "Open MPI"
    assert cluster_launcher({"OMPI_COMM_WORLD_SIZE": "1"}) is None
    assert cluster_launcher({}) is None


def test_the_plan_summary_names_runtime_buffers_and_nodes():
    from jax_uccl_ep import _plan, _runtime

    topo = _plan.Topology.build([0, 0, 1, 1], ["a", "b"])
    two = _plan.TwoLevel(2, 2, topo.node_of_rank, True, True)
    gpu = _plan.RuntimePlan("gpu", False, topo, True, True, False, two)
    line = _runtime.describe_plan(gpu, Config(buffer_bytes=32 << 20))
    assert "4 ranks on 2 nodes (hostnames)" in line and "32 MiB buffer per device" in line
    assert "normal mode in two levels (across nodes GPU-initiated), low-latency host-staged" in line
    assert "two-level routing: 2 nodes of 2" in line
    one_node = _plan.RuntimePlan("gpu", True, _plan.Topology.build([0, 0], ["a"]), True, False, False, None)
    assert "NVLink runtime, 1024 MiB normal + 256 MiB low-latency buffer per GPU, 24 SMs" in _runtime.describe_plan(
        one_node, Config()
    )


def test_the_codes_python_passes_are_the_kernels_enums():
    """Path, Overflow, the two-level Level and the FP8 cast modes travel as integer attributes: the Python names
    must map to the values of the C++ enums (exported by the extension from kernels/contract.hpp and fp8.hpp)."""
    from jax_uccl_ep import _plan, _uccl_ep, low_latency, normal

    codes = _uccl_ep.enum_codes()
    assert {p.name: int(p) for p in _plan.Path} == dict(codes["Path"])
    assert normal._OVERFLOW_CODES == dict(codes["Overflow"])
    level = dict(codes["Level"])
    assert {("flat" if k is None else k): v for k, v in normal._LEVEL_CODES.items()} == level
    assert low_latency.FP8_CAST_CODES == dict(codes["Fp8Cast"])


def test_initialize_takes_the_old_name_of_the_nvlink_buffer_with_a_warning(monkeypatch):
    import jax_uccl_ep as ep
    from jax_uccl_ep import _runtime

    monkeypatch.setattr(_runtime, "_is_initialized", lambda: True)  # return before anything starts
    with pytest.warns(DeprecationWarning, match="nvl_buffer_bytes"):
        ep.initialize(buffer_bytes=1 << 20)
    with pytest.raises(TypeError, match="nvl_buffer_bytes only"):
        ep.initialize(buffer_bytes=1 << 20, nvl_buffer_bytes=1 << 20)


def test_the_gpu_pair_writers_run_by_default_where_their_launches_can_and_nowhere_else():
    """Which GPU jobs have dispatch(layout="expert")'s receive write the pairs, from the variables a user sets: by
    default every job over one node's GPUs with bulk copies (the NVLink launch, pulled or sent) and a flat job across
    nodes (the GPU-initiated proxy); not with bulk copies off, not with the writer's own variable at 0, not under
    two-level routing nor where the proxy ops are staged through the host."""
    from jax_uccl_ep._plan import TwoLevel
    from jax_uccl_ep._runtime import _gpu_writes_pairs

    two = TwoLevel(2, 2, (0, 0, 1, 1), nvlink=True, across_gpu_initiated=True)

    def writes(env, nodes=1, gpu_initiated=True, two_level=None):
        return _gpu_writes_pairs(Config.from_env(None, env), nodes, gpu_initiated, two_level)

    assert writes({}) and writes({}, nodes=2)
    assert writes({"UCCL_EP_NVL_PULL_DISPATCH": "0"})  # the sent launch writes them too
    for env in ({"UCCL_EP_NVL_DISPATCH_PAIRS": "0"}, {"UCCL_EP_NVL_BULK": "0"}):
        assert not writes(env), env
        assert writes(env, nodes=2), env  # NVLink settings leave the proxy's writer alone
    assert not writes({"UCCL_EP_PROXY_DISPATCH_PAIRS": "0"}, nodes=2)
    assert writes({"UCCL_EP_PROXY_DISPATCH_PAIRS": "0"})  # and the proxy's setting leaves NVLink's alone
    assert not writes({}, nodes=2, two_level=two)
    assert not writes({}, nodes=2, gpu_initiated=False)
