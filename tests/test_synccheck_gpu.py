"""The NVLink dispatch's blocks meet at their barriers together: one dispatch(layout="expert") on one GPU (R = 1,
the receive writing the pairs) under compute-sanitizer's synccheck, pulled and sent. The kernels leave work to single
lanes and then meet at block barriers; a barrier that a split warp passes early puts its threads a barrier out of
step (docs/ARCHITECTURE.md, the path of one op), which may run right with one code layout and fault with the next.
Skipped without an NVIDIA GPU or compute-sanitizer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from mp import detect_gpus

HERE = os.path.dirname(os.path.abspath(__file__))
SANITIZER = shutil.which("compute-sanitizer")
pytestmark = pytest.mark.skipif(
    not detect_gpus() or SANITIZER is None, reason="needs an NVIDIA GPU and compute-sanitizer"
)

# One expert-layout dispatch of random rows (40 tokens, hidden 256 bf16, top-4 of 8 experts, alignment 8), its
# groups checked against the rows each expert should get, in token order.
CHILD = """
import sys
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
import jax_uccl_ep as ep
from jax_uccl_ep import _plan
import cases

ep.initialize(nvl_buffer_bytes=64 << 20)
assert _plan.current().gpu_writes_pairs, "the receive should write the pairs here"
mesh = cases.mesh_of(jax.devices()[:1])
T, H, K, E = 40, 256, 4, 8
x, _, idx, w = cases.random_case(13, 1, T, H, K, E, jnp.bfloat16)


def body(x, idx, w):
    r = ep.dispatch(x[0], idx[0], w[0], num_experts=E, axis_name="ep", layout="expert", expert_alignment=8)
    return r.x[None], r.expert_offsets[None], r.num_tokens_per_expert[None]


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
rows, offsets, counts = (np.asarray(o)[0] for o in f(*(cases.shard(mesh, a) for a in (x, idx, w))))
xs, ids = np.asarray(x, np.float32)[0], np.asarray(idx)[0]
for e in range(E):
    tokens = [t for t in range(T) for k in range(K) if ids[t, k] == e]
    got = rows[offsets[e] : offsets[e] + counts[e]].astype(np.float32)
    assert counts[e] == len(tokens) and np.array_equal(got, xs[tokens]), e
ep.check_errors()
ep.shutdown()
print("rows OK", flush=True)
"""


@pytest.mark.parametrize("pull", ["1", "0"], ids=["pulled", "sent"])
def test_the_expert_layout_dispatch_passes_synccheck(pull):
    env = dict(
        os.environ,
        JAX_PLATFORMS="cuda",  # the suite's conftest sets cpu for its own process
        CUDA_VISIBLE_DEVICES=detect_gpus()[0],
        UCCL_EP_NVL_PULL_DISPATCH=pull,
        UCCL_EP_TIMEOUT_S="30",
        CUDA_LAUNCH_BLOCKING="1",
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
    )
    args = [SANITIZER, "--tool", "synccheck", "--error-exitcode", "3", "--print-limit", "4"]
    done = subprocess.run(
        [*args, sys.executable, "-c", CHILD.format(tests=HERE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "rows OK" in done.stdout, said[-4000:]
    assert "ERROR SUMMARY: 0 errors" in said, said[-4000:]
