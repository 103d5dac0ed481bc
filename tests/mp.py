"""Multi-process test cases: N processes with jax.distributed on a free 127.0.0.1 port, each calling one function of
a test file and returning its JSON result.

The names the tests import, on top of the package's launcher (jax_uccl_ep.launch) and spawn.py: every child runs
in its own process group, killed at the timeout, and dies with the test process, so no test leaves processes
behind.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from spawn import RESULT_MARK, RankResult, describe
from spawn import call_in_processes as launch

from jax_uccl_ep.launch import detect_gpus, free_port

__all__ = [
    "RESULT_MARK",
    "RankResult",
    "count_gpus",
    "describe",
    "detect_gpus",
    "free_port",
    "launch",
    "launch_ok",
    "run_launcher",
]


def count_gpus() -> int:
    """NVIDIA GPUs this process may use (0 without any)."""
    return len(detect_gpus())


def launch_ok(path: str, function: str, num_processes: int, **kwargs: Any) -> list[Any]:
    """Like launch(), but asserts every rank succeeded and returns their results."""
    results = launch(path, function, num_processes, **kwargs)
    assert all(r.ok for r in results), describe(results)
    return [r.result for r in results]


def run_launcher(args: list[str], cwd: str, timeout: float = 120.0, **kwargs: Any) -> subprocess.CompletedProcess:
    """Runs `python -m jax_uccl_ep.launch args...` from `cwd` (outside the repository: the installed package), its
    output captured as text; `kwargs` go to subprocess.run (env=...)."""
    return subprocess.run(
        [sys.executable, "-m", "jax_uccl_ep.launch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )
