"""The examples (MoE layer, MoE transformer training) and the multi-process launcher."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import reference
from mp import launch_ok, run_launcher

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


# The example's baselines (moe_ffn_all_to_all, moe_ffn_ragged) and its dense glue against the package's dense
# reference, jax_uccl_ep.layers.moe_ffn_reference, run on each rank's tokens. The package's own layer
# (layers.moe_ffn_local, "uccl") goes through the same check as a control of the check itself.
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


def _mesh():
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("ep",))


def _skewed_params(key, *, d_model: int, d_ff: int, num_experts: int) -> dict:
    """The package's random parameters with a router biased towards some experts (uneven loads, dropped slots)."""
    import jax

    from jax_uccl_ep import layers

    k_params, k_bias = jax.random.split(key)
    params = layers.init_moe_params(k_params, d_model=d_model, d_ff=d_ff, num_experts=num_experts)
    params["router"] = params["router"] + 2.0 * jax.random.normal(k_bias, (1, num_experts))
    return params


def _layer_vs_reference(layer, config, *, seed: int, tokens: int = 20) -> None:
    """layer(params, x, config, axis_name="ep") in shard_map against layers.moe_ffn_reference on each rank's
    tokens: output, aux loss (the ranks' mean) and the gradients of both with respect to every input."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jax_uccl_ep import layers

    mesh = _mesh()
    r = mesh.size
    d_model, d_ff = 24, 40
    keys = jax.random.split(jax.random.key(seed), 3)
    params = _skewed_params(keys[0], d_model=d_model, d_ff=d_ff, num_experts=config.num_experts)
    x = jax.random.normal(keys[1], (r * tokens, d_model))
    cotangent = jax.random.normal(keys[2], (r * tokens, d_model))

    def body(p, x):
        out = layer(p, x, config, axis_name="ep")
        return out.y, jax.lax.pmean(out.aux_loss, "ep")

    def ep_loss(p, x):
        y, aux = jax.shard_map(
            body, mesh=mesh, in_specs=(layers.moe_param_specs("ep"), P("ep")), out_specs=(P("ep"), P())
        )(p, x)
        return jnp.sum(y * cotangent) + aux, (y, aux)

    def reference_loss(p, x):
        outs = [layers.moe_ffn_reference(p, xr, config) for xr in jnp.split(x, r)]  # each rank's tokens
        y = jnp.concatenate([o.y for o in outs])
        aux = jnp.mean(jnp.stack([o.aux_loss for o in outs]))
        return jnp.sum(y * cotangent) + aux, (y, aux)

    (_, (y, aux)), grads = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1), has_aux=True))(params, x)
    (_, (y_ref, aux_ref)), grads_ref = jax.jit(jax.value_and_grad(reference_loss, argnums=(0, 1), has_aux=True))(
        params, x
    )
    assert float(jnp.std(y_ref)) > 1e-2
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(aux), float(aux_ref), rtol=1e-5)
    # And against NumPy from the spec (tests/reference.py, nothing shared with the package): output and the
    # ranks' mean Switch loss, two-sided.
    host = {k: np.asarray(v) for k, v in params.items()}
    refs = [
        reference.moe_layer(host, xr, config.top_k, score=config.score, renormalize=config.renormalize)
        for xr in np.split(np.asarray(x), r)
    ]
    np.testing.assert_allclose(np.asarray(y), np.concatenate([ref[0] for ref in refs]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        float(aux), config.aux_loss_coef * np.mean([ref[1] for ref in refs]), rtol=1e-5, atol=1e-9
    )
    flat, _ = jax.tree.flatten_with_path(grads)
    flat_ref, _ = jax.tree.flatten_with_path(grads_ref)
    assert len(flat) == len(flat_ref) == 5  # router, w_gate, w_up, w_down; x
    for (path, g), (_, g_ref) in zip(flat, flat_ref):
        g, g_ref = np.asarray(g), np.asarray(g_ref)
        assert np.abs(g_ref).max() > 1e-3, f"{jax.tree_util.keystr(path)}: reference gradient vanished"
        np.testing.assert_allclose(
            g, g_ref, rtol=1e-4, atol=1e-5 * np.abs(g_ref).max(), err_msg=f"gradient {jax.tree_util.keystr(path)}"
        )


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
    "impl,top_k,score",
    [
        ("all_to_all", 2, "softmax"),
        ("all_to_all", 3, "sigmoid"),
        ("ragged", 2, "softmax"),
        ("ragged", 3, "sigmoid"),
        ("dense", 2, "softmax"),
        ("uccl", 2, "softmax"),
    ],
)  # top-1 renormalized weights are constant: no router gradient
def test_layers_match_the_package_reference_with_gradients(ep_runtime, monkeypatch, impl, top_k, score):
    import jax

    from jax_uccl_ep import layers

    ml = _load("moe_layer")
    assert ml.LAYERS["uccl"] is layers.moe_ffn_local  # the example trains the package's layer
    if impl == "ragged":
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    config = layers.MoEConfig(num_experts=2 * jax.device_count(), top_k=top_k, score=score, aux_loss_coef=0.1)
    _layer_vs_reference(ml.LAYERS[impl], config, seed=21 + top_k)


@pytest.mark.parametrize("how", ["capacity", "capacity_factor"])
def test_all_to_all_layer_drops_the_slots_past_capacity(ep_runtime, how):
    """With C slots per (sender, expert), the first C slots (token order) for each expert count, the rest add 0.
    C is given directly, or as the capacity factor f: ceil(f x tokens x top-k / experts) (MaxText's)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from jax_uccl_ep import layers

    ml = _load("moe_layer")
    mesh = _mesh()
    r = mesh.size
    num_experts, d_model, d_ff, tokens, top_k = 2 * r, 16, 24, 24, 2
    if how == "capacity":
        config, capacity = layers.MoEConfig(num_experts=num_experts, top_k=top_k), 4
        kwargs = {"capacity": capacity}
    else:
        config = layers.MoEConfig(num_experts=num_experts, top_k=top_k, capacity_factor=0.6)
        capacity, kwargs = int(np.ceil(0.6 * tokens * top_k / num_experts)), {}
    keys = jax.random.split(jax.random.key(5), 2)
    params = _skewed_params(keys[0], d_model=d_model, d_ff=d_ff, num_experts=num_experts)
    x = jax.random.normal(keys[1], (r * tokens, d_model))

    def body(p, x):
        out = ml.moe_ffn_all_to_all(p, x, config, axis_name="ep", **kwargs)
        return out.y, out.stats.rows_received

    layer = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(layers.moe_param_specs("ep"), P("ep")), out_specs=(P("ep"), P("ep")))
    )
    y, received = (np.asarray(a) for a in layer(params, x))

    host = {k: np.asarray(v, np.float64) for k, v in params.items()}
    xs = np.asarray(x, np.float64)
    weights, idx, _ = reference.moe_route(host["router"], xs, top_k)
    expected = np.zeros_like(xs)
    kept = np.zeros(r, int)  # slots each rank received
    dropped = 0
    for sender in range(r):
        used = np.zeros(num_experts, int)  # slots this sender has given each expert
        for t in range(sender * tokens, (sender + 1) * tokens):
            for k in range(top_k):
                dest = idx[t, k] // (num_experts // r)
                used[idx[t, k]] += 1
                if used[idx[t, k]] <= capacity:
                    expected[t] += weights[t, k] * reference.swiglu(host, idx[t, k], xs[t])
                    kept[dest] += 1
                else:
                    dropped += 1
    assert dropped > 0  # the case exercises the capacity
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(received, kept)


def test_ragged_layer_with_the_real_ragged_all_to_all(ep_runtime):
    """moe_ffn_ragged with jax.lax.ragged_all_to_all itself, output and gradients (its backward is the reverse
    exchange, not JAX's transpose of the collective); float32 experts at the highest matmul precision, so that GPUs
    compare at the reference's rounding. XLA:CPU does not implement ragged_all_to_all (jax 0.10): skips there."""
    import jax
    import jax.numpy as jnp

    from jax_uccl_ep import layers

    ml = _load("moe_layer")
    config = layers.MoEConfig(num_experts=2 * jax.device_count(), top_k=2, aux_loss_coef=0.1, compute_dtype=jnp.float32)
    try:
        with jax.default_matmul_precision("highest"):
            _layer_vs_reference(ml.moe_ffn_ragged, config, seed=31)
    except Exception as e:  # noqa: BLE001  (JaxRuntimeError; its module moved between jax versions)
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if jax.devices()[0].platform == "cpu" and "ragged-all-to-all" in message and "UNIMPLEMENTED" in message:
            pytest.skip(f"XLA:CPU (jax {jax.__version__}) cannot run ragged_all_to_all: {type(e).__name__}: {message}")
        raise


def test_train_moe_ep_impls_match_dense_losses(ep_runtime, monkeypatch):
    """A few training steps of every EP formulation in one process (4 CPU devices) give the dense losses, the
    cross-entropy and the load-balancing loss."""
    import jax

    pytest.importorskip("optax")
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)  # XLA:CPU lacks the real one
    train = _load("train_moe").train
    base = ["--steps", "3", "--time-every", "0", "--batch-per-device", "2", "--seed", "7", "--aux-loss-coef", "0.05"]
    dense = train(base + ["--ep-impl", "dense"], verbose=False)
    for impl in ["all_to_all", "ragged", "uccl"]:
        out = train(base + ["--ep-impl", impl], verbose=False)
        assert out["ep_impl"] == impl and len(out["step_ms"]) == 3
        np.testing.assert_allclose(out["losses"], dense["losses"], rtol=1e-5, err_msg=impl)
        np.testing.assert_allclose(out["aux_losses"], dense["aux_losses"], rtol=1e-4, err_msg=impl)
    assert dense["losses"][-1] < dense["losses"][0] - 0.1, dense["losses"]  # it learns
    # Two layers' Switch losses (each about 1 when balanced) times the coefficient.
    assert all(a > 0.5 * 2 * 0.05 for a in dense["aux_losses"]), dense["aux_losses"]


def test_train_moe_with_its_layers_scanned_gives_the_unrolled_losses(ep_runtime):
    """--scan-layers (stacked parameters, one jax.lax.scan, as MaxText runs its layers): the package's ops inside
    the scan's loop, forward and backward, give the unrolled model's losses, and the layer's timings take the first
    of the stacked layers."""
    pytest.importorskip("optax")
    train = _load("train_moe").train
    base = ["--steps", "3", "--batch-per-device", "2", "--seed", "5", "--layers", "3", "--ep-impl"]
    dense = train(base + ["dense", "--time-every", "0"], verbose=False)
    unrolled = train(base + ["uccl", "--time-every", "0"], verbose=False)
    scanned = train(base + ["uccl", "--scan-layers", "--time-every", "3"], verbose=False)
    assert scanned["scan_layers"] and not unrolled["scan_layers"]
    # The same arithmetic in the same order, looped instead of unrolled; the dense reference to float rounding.
    np.testing.assert_allclose(scanned["losses"], unrolled["losses"], rtol=1e-6)
    np.testing.assert_allclose(scanned["aux_losses"], unrolled["aux_losses"], rtol=1e-6)
    np.testing.assert_allclose(scanned["losses"], dense["losses"], rtol=1e-4)
    assert dense["losses"][-1] < dense["losses"][0]
    assert scanned["dispatch_ms"] > 0 and scanned["moe_fwd_ms"] > 0


def test_train_moe_generates_with_the_decode_layer_what_its_training_forward_computes(ep_runtime):
    """--generate: greedy decoding with a key/value cache and the MoE layers in low-latency mode (moe_ffn_decode)
    gives, at every step, the logits the training forward (normal-mode layer, whole sequences) gives at that
    position: to float rounding unquantized (layers stacked and scanned), to FP8's error with --decode-fp8; and a
    model trained on the chain generates the chain's transitions (random tokens would be allowed 1 in 16)."""
    pytest.importorskip("optax")
    train = _load("train_moe").train
    base = ["--steps", "40", "--time-every", "0", "--seed", "3", "--generate", "12"]
    out = train(base + ["--scan-layers"], verbose=False)["generate"]
    assert out["tokens"] == 12 and out["sequences"] == 4 * 8 and len(out["sample"]) == 13, out
    assert out["max_logit_diff"] < 1e-5 and out["argmax_agree"] > 0.97, out
    assert out["legal_transitions"] > 0.9, out
    fp8 = train(base + ["--decode-fp8", "--d-model", "128"], verbose=False)["generate"]
    assert 1e-4 < fp8["max_logit_diff"] < 0.3 and fp8["argmax_agree"] > 0.8, fp8  # FP8 rows: not bit-exact


def test_train_moe_with_the_load_sized_buffer(ep_runtime):
    """--pair-buffer-factor: the never-dropping layer on the load-sized buffer gives the worst-case buffer's losses
    (nothing drops either way), and its part timings run the layer's own path (token rows, swiglu_experts on the
    small buffer)."""
    pytest.importorskip("optax")
    train = _load("train_moe").train
    base = ["--steps", "3", "--batch-per-device", "2", "--seed", "4", "--ep-impl", "uccl"]
    plain = train(base + ["--time-every", "0"], verbose=False)
    sized = train(base + ["--pair-buffer-factor", "1.5", "--time-every", "3"], verbose=False)
    np.testing.assert_allclose(sized["losses"], plain["losses"], rtol=1e-5)
    assert sized["pairs_dropped"] == [0, 0, 0], sized["pairs_dropped"]
    assert sized["dispatch_ms"] > 0 and sized["experts_ms"] > 0 and sized["combine_ms"] > 0, sized


def test_train_moe_in_one_process_with_several_devices(ep_runtime):
    pytest.importorskip("optax")
    train = _load("train_moe").train
    out = train(["--steps", "4", "--time-every", "2", "--batch-per-device", "2", "--profile-parts"], verbose=False)
    losses = out["losses"]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.1, losses
    assert out["devices"] == len(__import__("jax").devices()) and out["processes"] == 1
    assert out["dispatch_ms"] > 0 and out["combine_ms"] > 0 and out["moe_fwd_ms"] > 0
    # The profiled step: every part of the layer ran ops; on CPU devices the receive writes the pairs, so XLA runs
    # no pair layout; attention and the optimizer are "other".
    profile = out["profile_ms"]
    assert all(profile[k] > 0 for k in ("router", "dispatch", "experts", "combine", "other")), profile
    assert profile["pair_layout"] == 0, profile
    # The experts' gate/up matmul (a result [pair rows, 2 * d_ff]) is counted in the experts part: checked by the
    # kernels' result shapes, not by timings, which at these sizes swap places between runs on two CPU cores.
    two_ff = 2 * _load("train_moe").Config().d_ff
    shapes = [kernel[3] for kernel in out["profile_top_kernels"]["experts"]]
    assert any(re.search(rf"\[\d+,{two_ff}\]", shape) for shape in shapes), shapes


def test_a_step_profile_splits_the_device_time_by_named_scope():
    """examples/step_profile.py on a jitted value-and-grad whose scopes do very different work: the forward and
    backward ops of each scope count towards it (the HLO's op names keep the scope under jvp/transpose), the
    unscoped reduction is other, and the heavier scope takes the larger share."""
    import jax
    import jax.numpy as jnp

    step_profile = _load("step_profile")

    def f(x, w_small, w_large):
        with jax.named_scope("light_part"):
            a = jnp.tanh(x[:, :16] @ w_small)
        with jax.named_scope("heavy_part"):
            b = jnp.tanh(x @ w_large) @ w_large.T
        return jnp.sum(a) + jnp.sum(b)

    def scanned(x, w_small, w_large):  # the same layer four times in a loop (a while loop in the HLO)
        def layer(carry, _):  # the body depends on the carry, so XLA cannot hoist it out of the loop
            return carry + f(x * (1 + carry), w_small, w_large) * 1e-6, None

        return jax.lax.scan(layer, jnp.zeros(()), None, length=4)[0]

    keys = jax.random.split(jax.random.key(0), 3)
    args = (
        jax.random.normal(keys[0], (512, 512)),
        jax.random.normal(keys[1], (16, 16)) / 4,
        jax.random.normal(keys[2], (512, 512)) / 23,
    )
    scopes = {"light": "light_part", "heavy": "heavy_part"}
    assert step_profile.scope_of("jit(f)/transpose(jvp(heavy_part))/dot_general", scopes) == "heavy"
    assert step_profile.scope_of("jit(f)/jvp(heavy_part)/light_part/dot", scopes) == "light"  # the innermost
    assert step_profile.scope_of("jit(f)/heavy_parts/dot", scopes) is None  # a whole word only
    # A fusion's part: its matmul's scope wherever the matmul sits, else its root's (an optimizer update that fuses in
    # a scoped gradient's convert is in no scope), and the fused instructions' majority where it has no op name.
    text = """HloModule jit_step, is_scheduled=true

%fused_update (p0: f32[8], p1: bf16[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  %p1 = bf16[8]{0} parameter(1)
  %convert.1 = f32[8]{0} convert(%p1), metadata={op_name="jit(step)/transpose(jvp(heavy_part))/convert"}
  ROOT %add.1 = f32[8]{0} add(%p0, %convert.1), metadata={op_name="jit(step)/add"}
}

%fused_dot (p0: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %dot.1 = f32[8,8]{1,0} dot(%p0, %p0), metadata={op_name="jit(step)/light_part/dot_general"}
  ROOT %tanh.1 = f32[8,8]{1,0} tanh(%dot.1), metadata={op_name="jit(step)/tanh"}
}

%fused_plain (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  %exp.1 = f32[8]{0} exponential(%p0), metadata={op_name="jit(step)/heavy_part/exp"}
  ROOT %neg.1 = f32[8]{0} negate(%exp.1), metadata={op_name="jit(step)/heavy_part/neg"}
}

ENTRY %main (a: f32[8], b: bf16[8], c: f32[8,8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = bf16[8]{0} parameter(1)
  %c = f32[8,8]{1,0} parameter(2)
  %update_fusion = f32[8]{0} fusion(%a, %b), kind=kLoop, calls=%fused_update, metadata={op_name="jit(step)/add"}
  %dot_fusion = f32[8,8]{1,0} fusion(%c), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/tanh"}
  ROOT %plain_fusion = f32[8]{0} fusion(%update_fusion), kind=kLoop, calls=%fused_plain
}
"""
    module, ops, _ = step_profile.op_parts(text, scopes)
    assert module == "jit_step"
    assert (ops["update_fusion"], ops["dot_fusion"], ops["plain_fusion"]) == (None, "light", "heavy"), ops
    for fn in (f, scanned):
        step = jax.jit(jax.value_and_grad(fn, argnums=(1, 2)))
        jax.block_until_ready(step(*args))
        text = step.lower(*args).compile().as_text()
        _, ops, loops = step_profile.op_parts(text, scopes)
        assert "heavy" in ops.values() and "light" in ops.values(), (fn.__name__, ops)
        # The loops, whose events span their bodies' op events (counted themselves), are known and left out.
        whiles = set(re.findall(r"%?([\w.\-]+) = [^\n]* while\(", text))
        assert loops == whiles and bool(whiles) == (fn is scanned), (fn.__name__, loops, whiles)
        assert all(ops[name] is not None for name in ops if name.startswith("dot")), ops  # every matmul is scoped
        profile = step_profile.profile_parts(step, args, scopes, top=2)
        value, _ = profile.pop("_results")
        top = profile.pop("_top")
        assert np.isfinite(float(value))
        assert profile["heavy"] > profile["light"] > 0, (fn.__name__, profile)
        assert profile["other"] < profile["heavy"], (fn.__name__, profile)
        # Each part's heaviest kernels: at most `top`, heaviest first, within the part's time, the heavy part's from
        # its own ops (a dot or a fusion of one).
        for part in (*scopes, "other"):
            times = [t for _, t, _, _ in top[part]]
            assert len(times) <= 2 and times == sorted(times, reverse=True), (part, top[part])
            assert sum(times) <= profile[part] * (1 + 1e-9), (part, top[part], profile[part])
        assert top["heavy"][0][2] >= 1 and ops.get(top["heavy"][0][0]) == "heavy", (top, ops)
        # and what it computes: the heavy matmul's result, the shape its op has in the compiled text
        name, what = top["heavy"][0][0], top["heavy"][0][3]
        assert re.search(rf"%?{re.escape(name)} = {re.escape(what.split()[0])}[{{ ]", text), (what, name)


def test_train_moe_capacity_options(ep_runtime):
    """--capacity counts all_to_all's slots per expert (uccl refuses it); a small --capacity-factor drops slots in
    all_to_all and rows in uccl, so their losses leave the never-dropping runs'."""
    pytest.importorskip("optax")
    train = _load("train_moe").train
    base = ["--steps", "2", "--time-every", "0", "--batch-per-device", "2", "--seed", "4", "--ep-impl"]
    with pytest.raises(SystemExit, match="capacity-factor"):
        train(base + ["uccl", "--capacity", "8"], verbose=False)
    full = train(base + ["all_to_all"], verbose=False)
    dropping = train(base + ["all_to_all", "--capacity-factor", "0.25"], verbose=False)
    # Slots per (sender, expert): 0.25 x 64 tokens x top-2 / 8 experts.
    explicit = train(base + ["all_to_all", "--capacity", "4"], verbose=False)
    assert dropping["capacity"] is None and explicit["capacity"] == 4
    assert abs(dropping["losses"][0] - full["losses"][0]) > 1e-3, (dropping["losses"], full["losses"])
    np.testing.assert_allclose(explicit["losses"], dropping["losses"], rtol=1e-6)
    # uccl drops rows past its capacity factor too (whole rows per device, not all_to_all's slots per pair).
    uccl_full = train(base + ["uccl"], verbose=False)
    uccl_dropping = train(base + ["uccl", "--capacity-factor", "0.25"], verbose=False)
    np.testing.assert_allclose(uccl_full["losses"], full["losses"], rtol=1e-5)
    assert abs(uccl_dropping["losses"][0] - uccl_full["losses"][0]) > 1e-3, uccl_dropping["losses"]
    # At factor 0.25 a device keeps at most a quarter of the pairs it gets on average (uccl: 0.25 x 64 tokens x
    # top-2 pairs; all_to_all: ceil(0.25 x 64 x 2 / 8) = 4 slots per sender and expert), so at least 3/4 of all
    # pairs drop in every step, in both; with ~16 pairs per (sender, expert) and ~128 per device on average, both
    # keep close to that quarter (under 0.8 dropped); the never-dropping runs drop none.
    for out in (dropping, uccl_dropping):
        shares = np.asarray(out["pairs_dropped"]) / out["pairs_per_step"]
        assert np.all((shares >= 0.75) & (shares < 0.8)), (out["ep_impl"], shares)
    assert sum(full["pairs_dropped"]) == sum(uccl_full["pairs_dropped"]) == 0


# ------------------------------------------------------------------------------------------- (a) parity


def test_training_loss_curves_match_dense_reference(tmp_path):
    pytest.importorskip("optax")
    steps = 20
    # uccl: the command a user types, through the launcher.
    proc = run_launcher(
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
    np.testing.assert_allclose(uccl["aux_losses"], dense[0]["aux_losses"], rtol=1e-3)
    assert min(uccl["aux_losses"]) > 0  # the load-balancing loss is on by default and trains with the rest
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
    proc = run_launcher(["-n", "3", "--grace-period", "0.5", str(script), str(tmp_path)], cwd=str(tmp_path), timeout=60)
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
    proc = run_launcher(
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
