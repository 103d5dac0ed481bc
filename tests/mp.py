"""Launch N Python processes with jax.distributed on a free 127.0.0.1 port and collect what they return.

Each child imports a test module by path, calls one of its functions and prints the JSON of the return value on
a marked line. Children run in their own process group: on timeout every one of them is killed, and a child
whose parent dies exits on its own, so no test leaves processes behind.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

RESULT_MARK = "@@uccl_ep_result@@"

_CHILD = r"""
import importlib.util, json, os, sys, threading, time
parent = os.getppid()
def _watch():
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.5)
threading.Thread(target=_watch, daemon=True).start()
if os.environ.get("UCCL_EP_TEST_STACKS_AFTER_S"):  # a hung child shows where, before the launcher kills it
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ["UCCL_EP_TEST_STACKS_AFTER_S"]))
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
sys.path.insert(0, os.path.dirname(sys.argv[1]))
spec = importlib.util.spec_from_file_location("uccl_ep_test_target", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module  # dataclasses in the target look their module up
spec.loader.exec_module(module)
result = getattr(module, sys.argv[2])(*json.loads(sys.argv[3]))
print(%r + json.dumps(result), flush=True)
if os.environ.get("UCCL_EP_TEST_HARD_EXIT") == "1":
    os._exit(0)  # a dead peer would hold up jax.distributed's exit barrier
""" % RESULT_MARK


def count_gpus() -> int:
    """NVIDIA GPUs nvidia-smi lists here (0 without it)."""
    import shutil

    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the timeout
    result: Any
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.result is not None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    path: str,
    function: str,
    num_processes: int,
    *,
    args: list | None = None,
    devices_per_process: int = 1,
    timeout_s: float = 180.0,
    env: dict[str, str] | None = None,
    per_rank_env: list[dict[str, str]] | None = None,
    platform: str = "cpu",
) -> list[RankResult]:
    """Runs `function(*args)` from the file `path` in `num_processes` processes; returns one RankResult each.

    platform "cpu": `devices_per_process` CPU devices each; "gpu": the GPUs the environment leaves visible.
    """
    port = free_port()
    procs = []
    workdir = tempfile.mkdtemp(prefix="uccl_ep_mp_")  # not the repo root: import the installed package
    start = time.monotonic()
    for rank in range(num_processes):
        child_env = dict(os.environ)
        if platform == "cpu":
            child_env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices_per_process))
        else:
            child_env.pop("JAX_NUM_CPU_DEVICES", None)
            child_env["JAX_PLATFORMS"] = "cuda"
        child_env.update(
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES=str(num_processes),
            JAX_PROCESS_ID=str(rank),
            FI_TCP_IFACE="lo",  # test traffic stays on loopback
            PYTHONUNBUFFERED="1",
            UCCL_EP_TEST_STACKS_AFTER_S=str(max(1.0, timeout_s - 15.0)),
        )
        child_env.update(env or {})
        if per_rank_env:
            child_env.update(per_rank_env[rank])
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _CHILD, os.path.abspath(path), function, json.dumps(args or [])],
            cwd=workdir, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        ))
    results = []
    deadline = start + timeout_s
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            code = p.returncode
        except subprocess.TimeoutExpired:
            for q in procs:
                _kill(q)
            out, err = p.communicate()
            code = None
        result = None
        for line in out.splitlines():
            if line.startswith(RESULT_MARK):
                result = json.loads(line[len(RESULT_MARK):])
        results.append(RankResult(rank, code, result, out, err, time.monotonic() - start))
    for q in procs:
        _kill(q)
    return results


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def describe(results: list[RankResult]) -> str:
    return "\n".join(
        f"--- rank {r.rank}: exit {r.returncode}, {r.seconds:.1f} s\n"
        f"stdout: {_without_result(r.stdout)[-1500:]}\nstderr: {r.stderr[-3000:]}" for r in results
    )


def _without_result(out: str) -> str:
    return "\n".join(line for line in out.splitlines() if not line.startswith(RESULT_MARK))


def launch_ok(path: str, function: str, num_processes: int, **kwargs: Any) -> list[Any]:
    """Like launch(), but asserts every rank succeeded and returns their results."""
    results = launch(path, function, num_processes, **kwargs)
    assert all(r.ok for r in results), describe(results)
    return [r.result for r in results]
