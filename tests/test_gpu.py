"""GPU (NVLink) normal mode against the same reference checks as the CPU tests. Skipped without NVIDIA GPUs.

Both process modes: one process driving every GPU (JAX's default) and one process per GPU.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from mp import describe, launch

HERE = os.path.abspath(__file__)


def _num_gpus() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


NUM_GPUS = _num_gpus()
pytestmark = pytest.mark.skipif(NUM_GPUS < 2, reason="needs at least 2 NVIDIA GPUs")


def gpu_suite() -> dict:
    """Child: every check on a mesh of all GPUs of the job."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import cases
    import jax_uccl_ep as ep
    import reference as ref

    ep.initialize()
    mesh = cases.mesh_of(sorted(jax.devices(), key=lambda d: d.id))
    r = mesh.devices.size
    # Kernel-found errors are raised where they happened: the process that drives rank 0 (both cases below).
    owns_rank0 = any(d.id == mesh.devices.flat[0].id for d in jax.local_devices())
    problems = {}
    shapes = [
        # tokens, hidden, topk, experts, dtype, empty rank
        (1, 128, 1, r, jnp.float32, None),
        (37, 256, 4, 4 * r, jnp.float32, None),
        (64, 512, 4, 8 * r, jnp.bfloat16, r - 1),
        (300, 7168, 8, 128 * r, jnp.bfloat16, None),
    ]
    for i, (t, h, k, e, dtype, empty) in enumerate(shapes):
        problems[f"case{i}"] = cases.check_case(mesh, 100 + i, t, h, k, e, dtype, empty_rank=empty)
        print(f"case{i}: {problems[f'case{i}']}", flush=True)
    problems["fp8"] = cases.check_fp8(mesh, 7, 41, 256, 3, 4 * r)
    print(f"fp8: {problems['fp8']}", flush=True)
    problems["gradients"] = cases.check_gradients(mesh, 9, 24, 128, 3, 4 * r)
    print(f"gradients: {problems['gradients']}", flush=True)
    ep.check_errors()  # nothing pending so far

    # Capacity exceeded: the kernel cannot fail its own call, and ops never raise it (that would strand the
    # peers); check_errors() says so, in the process that drives the failing rank.
    x, _, idx, w = cases.random_case(5, r, 16, 128, 2, 2 * r, jnp.float32)
    idx[:] = -1
    idx[:, :, 0] = 0
    try:
        cases.roundtrip(mesh, x, idx, w, 2 * r, capacity=3)
        ep.check_errors()
        problems["capacity"] = ["no error for capacity 3"] if owns_rank0 else []
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        ok = owns_rank0 and f"received {16 * r} tokens but capacity is 3" in msg
        problems["capacity"] = [] if ok else [msg[:300]]
    # The runtime keeps working afterwards.
    problems["after_capacity"] = cases.check_case(mesh, 77, 20, 256, 2, 2 * r, jnp.float32)

    # A bad expert index is reported by the same mechanism.
    idx2 = ref.random_routing(np.random.default_rng(3), r, 8, 2, 2 * r)
    idx2[0, 1, 0] = 99
    try:
        cases.roundtrip(mesh, x[:, :8], idx2, w[:, :8], 2 * r)
        ep.check_errors()
        problems["bad_index"] = ["no error for expert 99"] if owns_rank0 else []
    except Exception as exc:  # noqa: BLE001
        problems["bad_index"] = [] if owns_rank0 and "= 99 outside" in str(exc) else [str(exc)[:300]]
    ep.shutdown()
    return {"problems": problems, "ranks": r}


def _check(results, num_ranks):
    assert all(x.ok for x in results), describe(results)
    for x in results:
        assert x.result["ranks"] == num_ranks
        assert {k: v for k, v in x.result["problems"].items() if v} == {}


def test_one_process_drives_all_gpus():
    results = launch(HERE, "gpu_suite", 1, platform="gpu", timeout_s=400,
                     env={"UCCL_EP_NVL_BUFFER_BYTES": str(256 << 20)})
    _check(results, NUM_GPUS)


def test_one_process_per_gpu():
    per_rank = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(NUM_GPUS)]
    results = launch(HERE, "gpu_suite", NUM_GPUS, platform="gpu", per_rank_env=per_rank, timeout_s=400,
                     env={"UCCL_EP_NVL_BUFFER_BYTES": str(256 << 20)})
    _check(results, NUM_GPUS)
