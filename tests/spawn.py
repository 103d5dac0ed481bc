"""Call a function of a Python file in N processes of one jax.distributed job on this host; collect what it returns.

The tests (tests/mp.py) and the benches (bench/common.py) run their multi-process cases through this, on top of
:mod:`jax_uccl_ep.launch`. Each child imports the file by path, calls the function with JSON arguments and prints
the JSON of its return value on a marked line. Children run in an empty temporary directory, so they import the
installed jax_uccl_ep rather than a source checkout (the file's own directory is on their path, for its helpers).

Variables the children read: ``UCCL_EP_TEST_STACKS_AFTER_S`` (set here, 15 s before the timeout: a hung child
prints every thread's stack before it is killed), ``UCCL_EP_TEST_HARD_EXIT=1`` (the caller's choice: end with
``os._exit(0)`` after the result, since a dead peer would hold up jax.distributed's exit barrier), and the test
modes' variables (``TEST_MODES``), which every child and the test process itself (conftest.py) hand to the tests'
extension before anything starts a runtime.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jax_uccl_ep import launch as _launch

RESULT_MARK = "@@uccl_ep_result@@"

# The test modes (jax_uccl_ep._uccl_ep_testing.set_test_modes) and the variables that turn them on: the package
# never reads these, so a user's environment cannot turn a test mode on.
TEST_MODES = {
    "reorder": "UCCL_EP_REORDER",  # proxies post writes out of order and late; results must not change
    "poison": "UCCL_EP_POISON",  # CPU ops fill their outputs with 0xFF first, so unwritten rows show
    "stuck_proxy": "UCCL_EP_TEST_STUCK_PROXY",  # a proxy thread ignores shutdown, as one stuck in libfabric would
}


def set_test_modes(environ: Mapping[str, str] | None = None) -> dict[str, bool]:
    """Hands the test modes that `environ` (default: os.environ) turns on ("1"; unset, empty or "0": off) to the
    tests' extension, for the runtimes started after this; returns them."""
    from jax_uccl_ep import _uccl_ep_testing

    environ = os.environ if environ is None else environ
    modes = {mode: environ.get(name, "").strip() not in ("", "0") for mode, name in TEST_MODES.items()}
    _uccl_ep_testing.set_test_modes(**modes)
    return modes


_CHILD = r"""
import importlib.util, json, os, sys
if os.environ.get("UCCL_EP_TEST_STACKS_AFTER_S"):  # a hung child shows where, before the launcher kills it
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ["UCCL_EP_TEST_STACKS_AFTER_S"]))
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
sys.path.insert(0, HARNESS_DIR)
import spawn
spawn.set_test_modes()
sys.path.remove(HARNESS_DIR)
sys.path.insert(0, os.path.dirname(sys.argv[1]))
spec = importlib.util.spec_from_file_location("uccl_ep_test_target", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module  # dataclasses in the target look their module up
spec.loader.exec_module(module)
result = getattr(module, sys.argv[2])(*json.loads(sys.argv[3]))
print(MARK + json.dumps(result), flush=True)
if os.environ.get("UCCL_EP_TEST_HARD_EXIT") == "1":
    os._exit(0)  # a dead peer would hold up jax.distributed's exit barrier
""".replace("MARK", repr(RESULT_MARK)).replace("HARNESS_DIR", repr(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class RankResult:
    """One process of :func:`call_in_processes`: its exit status, the function's return value (None if it printed
    none) and its output."""

    rank: int
    returncode: int | None  # None: killed at the timeout
    result: Any
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        """Exited with 0 after returning a value."""
        return self.returncode == 0 and self.result is not None


def call_in_processes(
    path: str,
    function: str,
    num_processes: int,
    *,
    args: list | None = None,
    devices_per_process: int = 1,
    timeout_s: float = 180.0,
    env: Mapping[str, str | None] | None = None,
    per_rank_env: Sequence[Mapping[str, str | None]] | None = None,
    platform: str = "cpu",
) -> list[RankResult]:
    """Runs `function(*args)` from the file `path` in `num_processes` processes; returns one RankResult each.

    platform "cpu": `devices_per_process` CPU devices each (``JAX_PLATFORMS=cpu``, ``JAX_NUM_CPU_DEVICES``); "gpu":
    ``JAX_PLATFORMS=cuda`` and the GPUs the environment leaves visible. Every child also gets the coordinator
    variables of :func:`jax_uccl_ep.launch.child_env` and ``FI_TCP_IFACE=lo``; `env` and then ``per_rank_env[i]``
    go on top (None removes a variable). At `timeout_s` every child still running is killed.
    """
    if platform == "cpu":
        overrides: dict[str, str | None] = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices_per_process)}
    elif platform == "gpu":
        overrides = {"JAX_PLATFORMS": "cuda", "JAX_NUM_CPU_DEVICES": None}
    else:
        raise ValueError(f"platform must be 'cpu' or 'gpu', not {platform!r}")
    overrides.update(
        FI_TCP_IFACE="lo",  # forced, not just defaulted: test traffic stays on loopback
        UCCL_EP_TEST_STACKS_AFTER_S=str(max(1.0, timeout_s - 15.0)),
    )
    overrides.update(env or {})
    command = [sys.executable, "-c", _CHILD, os.path.abspath(path), function, json.dumps(args or [])]
    with tempfile.TemporaryDirectory(prefix="uccl_ep_mp_", ignore_cleanup_errors=True) as workdir:
        done = _launch.run(
            command, num_processes, env=overrides, per_rank_env=per_rank_env, cwd=workdir, timeout_s=timeout_s
        )
    return [RankResult(d.rank, d.returncode, _result(d.stdout), d.stdout, d.stderr, d.seconds) for d in done]


def _result(stdout: str) -> Any:
    """The JSON value on the last marked line of `stdout`, or None."""
    result = None
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK) :])
    return result


def describe(results: list[RankResult]) -> str:
    """Every rank's exit status, time and the ends of its output (its result line left out), for a failure
    message."""
    return "\n".join(
        f"--- rank {r.rank}: exit {r.returncode}, {r.seconds:.1f} s\n"
        f"stdout: {_without_result(r.stdout)[-1500:]}\nstderr: {r.stderr[-3000:]}"
        for r in results
    )


def _without_result(out: str) -> str:
    return "\n".join(line for line in out.splitlines() if not line.startswith(RESULT_MARK))
