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
from functools import partial

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
    return subprocess.run(
        [sys.executable, "-m", "jax_uccl_ep.launch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


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
    _layer_vs_dense(_load("moe_layer").moe_ffn, top_k=top_k, seed=11 + top_k)


# The other EP formulations (moe_ffn_all_to_all, moe_ffn_ragged, grouped experts) against the dense reference.
# XLA:CPU has no ragged-all-to-all, so the ragged layer's offsets and sizes are checked here through an emulation of
# jax.lax.ragged_all_to_all's documented semantics (itself checked against the documentation's example); the layer
# with the real collective has its own test, which skips on CPU and says why.


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, axis_index_groups=None
):
    """jax.lax.ragged_all_to_all (one chunk per peer) from all_to_all, gathers and scatters; differentiable."""
    import jax
    import jax.numpy as jnp

    assert axis_index_groups is None
    r, n = jax.lax.axis_size(axis_name), operand.shape[0]
    assert input_offsets.shape == (r,)
    rows = jnp.arange(n)
    chunks = operand.at[input_offsets[:, None] + rows].get(mode="fill", fill_value=0)  # [R, n, ...]: one per peer
    chunks = jnp.where((rows < send_sizes[:, None]).reshape(r, n, *[1] * (operand.ndim - 1)), chunks, 0)
    received = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [R, n, ...]: one from each peer
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each peer's chunk goes
    dest = jnp.where(rows < recv_sizes[:, None], offsets[:, None] + rows, output.shape[0])  # past the end: dropped
    return output.at[dest.reshape(-1)].set(received.reshape(r * n, *operand.shape[1:]), mode="drop")


def _layer_vs_dense(layer, *, top_k: int, seed: int, tokens: int = 20) -> None:
    """layer(params, x, num_experts, top_k, axis_name) in shard_map vs moe_ffn_dense: output and all gradients."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    ml = _load("moe_layer")
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("ep",))
    r = mesh.size
    num_experts, d_model, d_ff = 2 * r, 24, 40
    keys = jax.random.split(jax.random.key(seed), 4)
    params = ml.init_moe_params(keys[0], d_model=d_model, d_ff=d_ff, num_experts=num_experts)
    params["router"] = params["router"] + 2.0 * jax.random.normal(keys[1], (1, num_experts))  # skewed load
    x = jax.random.normal(keys[2], (r * tokens, d_model))
    cotangent = jax.random.normal(keys[3], (r * tokens, d_model))
    specs = ml.moe_param_specs("ep")

    def ep_loss(p, x):
        y = jax.shard_map(
            lambda p, x: layer(p, x, num_experts=num_experts, top_k=top_k, axis_name="ep"),
            mesh=mesh,
            in_specs=(specs, P("ep")),
            out_specs=P("ep"),
        )(p, x)
        return jnp.sum(y * cotangent), y

    def dense_loss(p, x):
        y = ml.moe_ffn_dense(p, x, num_experts=num_experts, top_k=top_k)
        return jnp.sum(y * cotangent), y

    (_, y), grads = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1), has_aux=True))(params, x)
    (_, y_ref), grads_ref = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1), has_aux=True))(params, x)
    assert float(jnp.std(y_ref)) > 1e-2
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-4, atol=1e-5)
    flat, _ = jax.tree.flatten_with_path(grads)
    flat_ref, _ = jax.tree.flatten_with_path(grads_ref)
    for (path, g), (_, g_ref) in zip(flat, flat_ref):
        g, g_ref = np.asarray(g), np.asarray(g_ref)
        assert np.abs(g_ref).max() > 1e-3, f"{jax.tree_util.keystr(path)}: reference gradient vanished"
        np.testing.assert_allclose(
            g, g_ref, rtol=1e-4, atol=1e-5 * np.abs(g_ref).max(), err_msg=f"gradient {jax.tree_util.keystr(path)}"
        )


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_layer_matches_dense_reference(ep_runtime, use_fp8):
    """moe_ffn_low_latency (forward, decode-sized batches with a larger static budget) against moe_ffn_dense."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    ml = _load("moe_layer")
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("ep",))
    r, num_experts, d_model, d_ff, tokens, top_k = mesh.size, 4 * mesh.size, 128, 64, 5, 2
    keys = jax.random.split(jax.random.key(21), 3)
    params = ml.init_moe_params(keys[0], d_model=d_model, d_ff=d_ff, num_experts=num_experts)
    x = jax.random.normal(keys[1], (r * tokens, d_model))
    layer = jax.jit(
        jax.shard_map(
            lambda p, x: ml.moe_ffn_low_latency(
                p, x, num_experts=num_experts, top_k=top_k, axis_name="ep", max_tokens_per_rank=8, use_fp8=use_fp8
            ),
            mesh=mesh,
            in_specs=(ml.moe_param_specs("ep"), P("ep")),
            out_specs=P("ep"),
        )
    )
    y = np.asarray(layer(params, x))
    y_ref = np.asarray(ml.moe_ffn_dense(params, x, num_experts=num_experts, top_k=top_k))
    assert float(np.std(y_ref)) > 1e-2
    # FP8 rows carry e4m3's relative error (<= 2^-4 per element) into the experts.
    tol = dict(rtol=0.1, atol=0.05 * np.abs(y_ref).max()) if use_fp8 else dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y, y_ref, **tol)


def test_emulated_ragged_all_to_all_follows_the_documented_example():
    """The example in jax.lax.ragged_all_to_all's docstring, on 2 devices, through the emulation."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (JAX_NUM_CPU_DEVICES)")
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)[:2]), ("x",))
    args = [
        jnp.array(a, jnp.int32)
        for a in (
            [[1, 2, 2], [3, 4, 0]],  # operand
            [[0, 0, 0, 0], [0, 0, 0, 0]],  # output
            [[0, 1], [0, 1]],  # input_offsets
            [[1, 2], [1, 1]],  # send_sizes
            [[0, 0], [1, 2]],  # output_offsets
            [[1, 1], [2, 1]],  # recv_sizes
        )
    ]
    f = jax.shard_map(
        lambda *a: emulated_ragged_all_to_all(*(v[0] for v in a), axis_name="x")[None],
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
    )
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(*args)), [[1, 3, 0, 0], [2, 2, 4, 0]])


@pytest.mark.parametrize(
    "impl,expert_compute,top_k",
    [
        ("all_to_all", "masked", 2),
        ("all_to_all", "grouped", 3),
        ("ragged", "grouped", 2),
        ("ragged", "masked", 3),
        ("uccl", "grouped", 2),
    ],
)
def test_ep_layers_match_dense_reference_with_gradients(ep_runtime, monkeypatch, impl, expert_compute, top_k):
    import jax

    ml = _load("moe_layer")
    fn = {"uccl": ml.moe_ffn, "all_to_all": ml.moe_ffn_all_to_all, "ragged": ml.moe_ffn_ragged}[impl]
    if impl == "ragged":
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    _layer_vs_dense(partial(fn, expert_compute=expert_compute), top_k=top_k, seed=21 + top_k)


def test_all_to_all_layer_drops_the_slots_past_capacity(ep_runtime):
    """With C slots per (sender, receiver), the first C slots (token order) for each rank count, the rest add 0."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    ml = _load("moe_layer")
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("ep",))
    r = mesh.size
    num_experts, d_model, d_ff, tokens, top_k, capacity = 2 * r, 16, 24, 24, 2, 7
    keys = jax.random.split(jax.random.key(5), 3)
    params = ml.init_moe_params(keys[0], d_model=d_model, d_ff=d_ff, num_experts=num_experts)
    params["router"] = params["router"] + 2.0 * jax.random.normal(keys[1], (1, num_experts))
    x = jax.random.normal(keys[2], (r * tokens, d_model))
    layer = jax.jit(
        jax.shard_map(
            lambda p, x: ml.moe_ffn_all_to_all(
                p, x, num_experts=num_experts, top_k=top_k, axis_name="ep", capacity=capacity
            ),
            mesh=mesh,
            in_specs=(ml.moe_param_specs("ep"), P("ep")),
            out_specs=P("ep"),
        )
    )
    y = np.asarray(layer(params, x))

    weights, idx = (np.asarray(a) for a in ml.route(params["router"], x, top_k))
    experts_out = np.asarray(ml.expert_mlp(params["w1"], params["w2"], x))  # [E, R*T, D]
    expected = np.zeros_like(y)
    dropped = 0
    for sender in range(r):
        used = np.zeros(r, int)  # slots this sender has put in each destination's block
        for t in range(sender * tokens, (sender + 1) * tokens):
            for k in range(top_k):
                dest = idx[t, k] // (num_experts // r)
                used[dest] += 1
                if used[dest] <= capacity:
                    expected[t] += weights[t, k] * experts_out[idx[t, k], t]
                else:
                    dropped += 1
    assert dropped > 0  # the case exercises the capacity
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)


def test_ragged_layer_with_the_real_ragged_all_to_all(ep_runtime):
    """moe_ffn_ragged with jax.lax.ragged_all_to_all itself; XLA:CPU does not implement it (jax 0.10): skips."""
    import jax

    ml = _load("moe_layer")
    try:
        _layer_vs_dense(ml.moe_ffn_ragged, top_k=2, seed=31)
    except Exception as e:  # noqa: BLE001  (JaxRuntimeError; its module moved between jax versions)
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if jax.devices()[0].platform == "cpu" and "ragged-all-to-all" in message and "UNIMPLEMENTED" in message:
            pytest.skip(f"XLA:CPU (jax {jax.__version__}) cannot run ragged_all_to_all: {type(e).__name__}: {message}")
        raise


def test_train_moe_ep_impls_match_dense_losses(ep_runtime, monkeypatch):
    """A few training steps of every EP formulation in one process (4 CPU devices) give the dense losses."""
    import jax

    pytest.importorskip("optax")
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)  # XLA:CPU lacks the real one
    train = _load("train_moe").train
    base = ["--steps", "3", "--time-every", "0", "--batch-per-device", "2", "--seed", "7"]
    dense = train(base + ["--ep-impl", "dense"], verbose=False)["losses"]
    for impl, extra in [("all_to_all", []), ("ragged", []), ("uccl", ["--expert-compute", "grouped"])]:
        out = train(base + ["--ep-impl", impl, *extra], verbose=False)
        assert out["ep_impl"] == impl and len(out["step_ms"]) == 3
        np.testing.assert_allclose(out["losses"], dense, rtol=1e-5, err_msg=impl)
    assert dense[-1] < dense[0] - 0.1, dense  # it learns


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
    proc = _launcher(
        ["-n", "2", TRAIN, "--steps", str(steps), "--ep-impl", "uccl", "--time-every", "0", "--json", "--seed", "3"],
        cwd=str(tmp_path),
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith(f"[rank 0] {JSON_MARK}")]
    assert len(lines) == 1, proc.stdout[-3000:]
    uccl = json.loads(lines[0][len(f"[rank 0] {JSON_MARK}") :])
    assert any(l.startswith("[rank 0] step   20/20") for l in proc.stdout.splitlines())
    # dense: train() called as a function in 2 processes through tests/mp.py.
    dense = launch_ok(
        TRAIN,
        "train",
        2,
        args=[["--steps", str(steps), "--ep-impl", "dense", "--time-every", "0", "--seed", "3"]],
        timeout_s=150,
    )
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
    with open(os.path.join(out, f"pids.tmp{rank}"), "w") as f:  # ranks 0 and 2 both get here: one file each
        f.write(f"{os.getpid()} {grandchild.pid}")
    os.rename(os.path.join(out, f"pids.tmp{rank}"), os.path.join(out, f"pids.{rank}"))
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
    script.write_text(
        textwrap.dedent("""
        import json, os
        keys = ["JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_PLATFORMS",
                "JAX_NUM_CPU_DEVICES", "FI_TCP_IFACE", "CUDA_VISIBLE_DEVICES"]
        print(json.dumps({k: os.environ.get(k) for k in keys}))
    """)
    )
    env = {k: v for k, v in os.environ.items() if k != "FI_TCP_IFACE"}
    proc = _launcher(
        ["-n", "2", "--platform", "cpu", "--devices-per-process", "3", str(script)],
        cwd=str(tmp_path),
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    seen = {}
    for line in proc.stdout.splitlines():
        rank, _, payload = line.partition("] ")
        seen[int(rank[len("[rank ") :])] = json.loads(payload)
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
    script.write_text(
        textwrap.dedent("""
        import os, time
        print("ready", os.getpid(), flush=True)
        time.sleep(300)
    """)
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jax_uccl_ep.launch", "-n", "2", "--grace-period", "1", str(script)],
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
