"""The README's Python snippets run as written (in fresh processes with 4 CPU devices), each printing what its
last line's comment says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "README.md")) as _f:
    BLOCKS = re.findall(r"```python\n(.*?)```", _f.read(), re.S)


def test_the_readme_has_snippets():
    assert len(BLOCKS) >= 2, "the README lost its python snippets"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_snippet_runs(index):
    block = BLOCKS[index]
    expected = re.search(r"#\s*(.+)\s*$", block.strip().splitlines()[-1])
    assert expected, "a snippet's last line says in a comment what it prints"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4")
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", block], cwd=tempfile.mkdtemp(), env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith(expected.group(1).strip()), done.stdout
