"""The README's Python snippets run as written, each printing what its last line's comment says: in one process
with 4 CPU devices, and under the launcher as 2 processes of 2 CPU devices (each rank prints it, nothing else)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest
from mp import run_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "README.md")) as _f:
    BLOCKS = re.findall(r"```python\n(.*?)```", _f.read(), re.S)


def test_the_readme_has_snippets():
    assert len(BLOCKS) >= 2, "the README lost its python snippets"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
@pytest.mark.parametrize("how", ["one process", "launcher"])
def test_snippet_runs(index, how):
    block = BLOCKS[index]
    expected = re.search(r"#\s*(.+)\s*$", block.strip().splitlines()[-1])
    assert expected, "a snippet's last line says in a comment what it prints"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4")
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    cwd = tempfile.mkdtemp()
    if how == "one process":
        done = subprocess.run(
            [sys.executable, "-c", block], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
        )
    else:
        with open(os.path.join(cwd, "snippet.py"), "w") as f:
            f.write(block)
        args = ["--platform", "cpu", "-n", "2", "--devices-per-process", "2", "snippet.py"]
        done = run_launcher(args, cwd=cwd, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    want = expected.group(1).strip()
    if how == "one process":
        assert done.stdout.strip().endswith(want), done.stdout
    else:
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        assert f"[rank 0] {want}" in lines and f"[rank 1] {want}" in lines, lines
        assert not any("Gloo" in line or "jax_uccl_ep (" in line for line in lines), lines
