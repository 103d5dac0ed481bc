"""The examples (MoE layer, MoE transformer training) and the multi-process launcher."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from mp import launch_ok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TRAIN = os.path.join(EXAMPLES, "train_moe.py")
JSON_MARK = "TRAIN_MOE_JSON "


def _load(name: str):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _launcher(args: list[str], cwd: str, timeout: float = 120.0, **kwargs) -> subprocess.CompletedProcess:
    """Runs `python -m jax_uccl_ep.launch args...` from `cwd` (outside the repository: the installed package)."""
    return subprocess.run([sys.executable, "-m", "jax_uccl_ep.launch", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether `pid` has exited (or is a zombie waiting for init) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


# ------------------------------------------------------------------------------------------- (c) moe layer


@pytest.fixture(scope="module")
def ep_runtime():
    import jax
    import jax_uccl_ep

    jax_uccl_ep.initialize()
    if jax.device_count() < 2:
        pytest.skip("needs several devices (JAX_NUM_CPU_DEVICES)")
    return jax_uccl_ep


@pytest.mark.parametrize("top_k", [2, 3])  # top-1 renormalized weights are constant: no router gradient
def test_moe_layer_matches_dense_reference_with_gradients(ep_runtime, top_k):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    ml = _load("moe_layer")
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("ep",))
    r = mesh.size
    num_experts, d_model, d_ff, tokens = 2 * r, 24, 40, 20
    keys = jax.random.split(jax.random.key(11 + top_k), 4)
    params = ml.init_moe_params(keys[0], d_model=d_model, d_ff=d_ff, num_experts=num_experts)
    # Skew the router so that some experts (and ranks) get far more tokens than others.
    params["router"] = params["router"] + 2.0 * jax.random.normal(keys[1], (1, num_experts))
    x = jax.random.normal(keys[2], (r * tokens, d_model))
    cotangent = jax.random.normal(keys[3], (r * tokens, d_model))
    specs = ml.moe_param_specs("ep")

    def ep_loss(p, x):
        layer = jax.shard_map(
            lambda p, x: ml.moe_ffn(p, x, num_experts=num_experts, top_k=top_k, axis_name="ep"),
            mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep"))
        y = layer(p, x)
        return jnp.sum(y * cotangent), y

    def dense_loss(p, x):  # plain JAX on the full arrays: no shard_map, no collectives
        y = ml.moe_ffn_dense(p, x, num_experts=num_experts, top_k=top_k)
        return jnp.sum(y * cotangent), y

    (_, y), grads = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1), has_aux=True))(params, x)
    (_, y_ref), grads_ref = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1), has_aux=True))(params, x)

    assert float(jnp.std(y_ref)) > 1e-2  # a non-trivial output
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-4, atol=1e-5)
    flat, _ = jax.tree.flatten_with_path(grads)
    flat_ref, _ = jax.tree.flatten_with_path(grads_ref)
    for (path, g), (_, g_ref) in zip(flat, flat_ref):
        g, g_ref = np.asarray(g), np.asarray(g_ref)
        assert np.abs(g_ref).max() > 1e-3, f"{jax.tree_util.keystr(path)}: reference gradient vanished"
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5 * np.abs(g_ref).max(),
                                   err_msg=f"gradient {jax.tree_util.keystr(path)}")


def test_train_moe_in_one_process_with_several_devices(ep_runtime):
    pytest.importorskip("optax")
    train = _load("train_moe").train
    out = train(["--steps", "4", "--time-every", "2", "--batch-per-device", "2"], verbose=False)
    losses = out["losses"]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.1, losses
    assert out["devices"] == len(__import__("jax").devices()) and out["processes"] == 1
    assert out["dispatch_ms"] > 0 and out["combine_ms"] > 0 and out["moe_fwd_ms"] > 0


# ------------------------------------------------------------------------------------------- (a) parity


def test_training_loss_curves_match_dense_reference(tmp_path):
    pytest.importorskip("optax")
    steps = 20
    # uccl: the command a user types, through the launcher.
    proc = _launcher(["-n", "2", TRAIN, "--steps", str(steps), "--ep-impl", "uccl", "--time-every", "0",
                      "--json", "--seed", "3"], cwd=str(tmp_path), timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith(f"[rank 0] {JSON_MARK}")]
    assert len(lines) == 1, proc.stdout[-3000:]
    uccl = json.loads(lines[0][len(f"[rank 0] {JSON_MARK}"):])
    assert any(l.startswith("[rank 0] step   20/20") for l in proc.stdout.splitlines())
    # dense: train() called as a function in 2 processes through tests/mp.py.
    dense = launch_ok(TRAIN, "train", 2, args=[["--steps", str(steps), "--ep-impl", "dense", "--time-every", "0",
                                                "--seed", "3"]], timeout_s=150)
    assert dense[0]["losses"] == dense[1]["losses"]  # every process reports the global loss

    assert uccl["processes"] == 2 and uccl["devices"] == 2 and dense[0]["ep_impl"] == "dense"
    a, b = np.array(uccl["losses"]), np.array(dense[0]["losses"])
    assert a.shape == b.shape == (steps,)
    np.testing.assert_allclose(a, b, rtol=1e-4)
    assert a[-3:].mean() < a[:3].mean() - 0.5, a  # it learns


# ------------------------------------------------------------------------------------------- (b) launcher

_FAILING_CHILD = textwrap.dedent("""
    import os, subprocess, sys, time
    rank = int(os.environ["JAX_PROCESS_ID"])
    out = sys.argv[1]
    print(f"hello from {rank} of {os.environ['JAX_NUM_PROCESSES']}", flush=True)
    print(f"note on stderr from {rank}", file=sys.stderr, flush=True)
    print(f"no newline at the end {rank}", end="", flush=True)
    if rank == 1:
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(out, "pids.0")) and time.time() < deadline:
            time.sleep(0.05)
        sys.exit(3)
    grandchild = subprocess.Popen(["sleep", "300"])  # must not outlive the job either
    with open(os.path.join(out, "pids.tmp"), "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}")
    os.rename(os.path.join(out, "pids.tmp"), os.path.join(out, "pids.0"))
    time.sleep(300)
""")


def test_launcher_kills_the_rest_when_a_rank_fails(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_FAILING_CHILD)
    start = time.monotonic()
    proc = _launcher(["-n", "3", "--grace-period", "0.5", str(script), str(tmp_path)], cwd=str(tmp_path), timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr)
    assert elapsed < 30
    out_lines, err_lines = proc.stdout.splitlines(), proc.stderr.splitlines()
    for rank in range(3):
        assert f"[rank {rank}] hello from {rank} of 3" in out_lines
        assert f"[rank {rank}] note on stderr from {rank}" in err_lines
        assert f"[rank {rank}] no newline at the end {rank}" in out_lines
    assert all(l.startswith("[rank ") for l in out_lines), out_lines
    assert any("rank 1 exited with status 3" in l for l in err_lines), err_lines
    pids = [int(p) for p in (tmp_path / "pids.0").read_text().split()]
    for pid in pids:
        assert _gone(pid), f"process {pid} outlived the launcher"


def test_launcher_sets_the_environment(tmp_path):
    script = tmp_path / "env.py"
    script.write_text(textwrap.dedent("""
        import json, os
        keys = ["JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_PLATFORMS",
                "JAX_NUM_CPU_DEVICES", "FI_TCP_IFACE", "CUDA_VISIBLE_DEVICES"]
        print(json.dumps({k: os.environ.get(k) for k in keys}))
    """))
    env = {k: v for k, v in os.environ.items() if k != "FI_TCP_IFACE"}
    proc = _launcher(["-n", "2", "--platform", "cpu", "--devices-per-process", "3", str(script)],
                     cwd=str(tmp_path), timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    seen = {}
    for line in proc.stdout.splitlines():
        rank, _, payload = line.partition("] ")
        seen[int(rank[len("[rank "):])] = json.loads(payload)
    assert sorted(seen) == [0, 1]
    assert seen[0]["JAX_COORDINATOR_ADDRESS"] == seen[1]["JAX_COORDINATOR_ADDRESS"]
    assert seen[0]["JAX_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
    for rank in (0, 1):
        assert seen[rank]["JAX_PROCESS_ID"] == str(rank)
        assert seen[rank]["JAX_NUM_PROCESSES"] == "2"
        assert seen[rank]["JAX_PLATFORMS"] == "cpu"
        assert seen[rank]["JAX_NUM_CPU_DEVICES"] == "3"
        assert seen[rank]["FI_TCP_IFACE"] == "lo"


def test_launcher_forwards_sigterm(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text(textwrap.dedent("""
        import os, time
        print("ready", os.getpid(), flush=True)
        time.sleep(300)
    """))
    launcher = subprocess.Popen([sys.executable, "-m", "jax_uccl_ep.launch", "-n", "2", "--grace-period", "1",
                                 str(script)], cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        pids = []
        while len(pids) < 2:
            line = launcher.stdout.readline()
            assert line, launcher.stderr.read()
            if " ready " in line:
                pids.append(int(line.split()[-1]))
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=20) == 128 + signal.SIGTERM
        for pid in pids:
            assert _gone(pid)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
