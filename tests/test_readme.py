"""The README's usage snippet runs as written (in a fresh process with 4 CPU devices)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_usage_snippet_runs():
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert blocks, "the README has no python snippet"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4")
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", blocks[0]], cwd=tempfile.mkdtemp(), env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("(64, 256)"), done.stdout
