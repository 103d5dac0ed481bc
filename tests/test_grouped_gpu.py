"""The experts' grouped matmul on one GPU: the Mosaic kernels under the package's VJP against a NumPy float64
reference and against jax.lax.ragged_dot, forward and both gradients, alone and inside shard_map; the pair rows'
copy from token rows (expand_pairs) and the sum back (sum_pairs); then the layer with its bf16 experts against the
float32 dense reference. Skipped without an NVIDIA GPU (the tokamax cases also without tokamax; the Mosaic backend
runs JAX's own kernel then). References run at `jax.default_matmul_precision("highest")`: TF32 would move them by
more than the bf16 tolerance on its own."""

from __future__ import annotations

import functools
import os

import pytest
from mp import count_gpus, describe, launch

HERE = os.path.abspath(__file__)
pytestmark = pytest.mark.skipif(count_gpus() < 1, reason="needs an NVIDIA GPU")

# Groups of uneven size, one empty, one smaller than a tile, rows left over past the last group.
GROUP_SIZES = [700, 0, 1300, 64, 5, 900]
ROWS, K, N = 4096, 256, 384


def _relative_error(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def grouped_child(row_kernel: str) -> dict:
    """Child: forward, d lhs and d rhs of grouped_matmul's Mosaic kernels against NumPy and jax.lax.ragged_dot; the
    weights' gradient three times (a racy kernel gave a different error each run); the kernels again with NaN in
    the rows past the groups. `row_kernel`: the forward products by tokamax's kernel, or by JAX's own (what a GPU
    without tokamax runs)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jax_uccl_ep import grouped

    if row_kernel == "tokamax" and grouped._tokamax() is None:
        return {"skip": "tokamax is not installed"}
    if row_kernel == "jax":
        grouped._tokamax = lambda: None  # as where tokamax is not installed
    if grouped.grouped_backend("auto", jnp.bfloat16) != "mosaic":
        return {"skip": "the Mosaic kernels cannot run on this GPU"}
    rng = np.random.default_rng(11)
    sizes = np.array(GROUP_SIZES, np.int32)
    lhs = rng.standard_normal((ROWS, K)).astype(np.float32)
    rhs = (rng.standard_normal((len(sizes), K, N)) / np.sqrt(K)).astype(np.float32)
    dout = rng.standard_normal((ROWS, N)).astype(np.float32)
    # bf16 operands: round once on the host, so every path (and NumPy) multiplies the same numbers.
    lhs16, rhs16, dout16 = (jnp.asarray(a, jnp.bfloat16) for a in (lhs, rhs, dout))
    l64, r64, d64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (lhs16, rhs16, dout16))

    starts = np.concatenate([[0], np.cumsum(sizes)])
    want_y = np.zeros((ROWS, N))
    want_dl = np.zeros((ROWS, K))
    want_dr = np.zeros((len(sizes), K, N))
    for g in range(len(sizes)):
        rows = slice(starts[g], starts[g + 1])
        want_y[rows] = l64[rows] @ r64[g]
        want_dl[rows] = d64[rows] @ r64[g].T
        want_dr[g] = l64[rows].T @ d64[rows]

    def value_and_grads(matmul, lhs=lhs16, dout=dout16):
        def loss(lhs, rhs):
            y = matmul(lhs, rhs)
            return jnp.sum(y.astype(jnp.float32) * dout.astype(jnp.float32)), y

        (_, y), (dl, dr) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(lhs, rhs16)
        return y, dl, dr

    def fast(lhs, rhs):
        return grouped.grouped_matmul(lhs, rhs, jnp.asarray(sizes), out_dtype=jnp.float32, backend="mosaic")

    def xla(lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs, jnp.asarray(sizes), preferred_element_type=jnp.float32)

    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))

    def in_shard_map(lhs, rhs):
        return jax.shard_map(fast, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))(lhs, rhs)

    with jax.default_matmul_precision("highest"):
        fast_grads = jax.jit(functools.partial(value_and_grads, fast))
        got = {"fast": fast_grads(), "xla": jax.jit(functools.partial(value_and_grads, xla))()}
        got["shard_map"] = jax.jit(functools.partial(value_and_grads, in_shard_map))()
        again = [fast_grads()[2] for _ in range(2)]
        # NaN in the rows past the groups, of the rows and of the cotangent (a buffer's unwritten padding): the
        # kernels must not let them into any row of a group, the weights' gradient or the zeroed rows.
        total = int(sizes.sum())
        nan_lhs, nan_dout = (a.at[total:].set(jnp.nan) for a in (lhs16, dout16))
        got["nan_padding"] = jax.jit(functools.partial(value_and_grads, fast, lhs=nan_lhs, dout=nan_dout))()
    total = int(sizes.sum())
    out = {"total_rows": total}
    for name, (y, dl, dr) in got.items():
        y, dl, dr = (np.asarray(a, np.float64) for a in (y, dl, dr))
        out[name] = {
            "y": _relative_error(y[:total], want_y[:total]),
            "dlhs": _relative_error(dl[:total], want_dl[:total]),
            "drhs": _relative_error(dr, want_dr),
            "rows_past_groups_max": float(max(np.abs(y[total:]).max(), np.abs(dl[total:]).max())),
            "empty_group_grad_max": float(np.abs(dr[1]).max()),
        }
    out["fast"]["drhs"] = max([out["fast"]["drhs"]] + [_relative_error(dr, want_dr) for dr in again])
    fast_y, xla_y = np.asarray(got["fast"][0], np.float64), np.asarray(got["xla"][0], np.float64)
    out["fast_vs_xla_y"] = _relative_error(fast_y[:total], xla_y[:total])
    return out


def expert_slots_child() -> dict:
    """Child: the decode layer's experts on per-expert slot buffers (random counts, one group empty, one negative,
    one full, garbage in the padding) through the Mosaic kernels on the packed rows, against the batched matmuls
    over the slots (XLA) and a NumPy float64 SwiGLU on the same bf16 numbers."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_uccl_ep import grouped, layers

    if grouped.grouped_backend("auto", jnp.bfloat16) != "mosaic":
        return {"skip": "the Mosaic kernels cannot run on this GPU"}
    groups, slots, d_model, d_ff = 6, 512, 256, 384
    rng = np.random.default_rng(12)
    params = layers.init_moe_params(jax.random.key(4), d_model=d_model, d_ff=d_ff, num_experts=groups)
    params = {k: v.astype(jnp.bfloat16) for k, v in params.items()}
    rows = jnp.asarray(rng.standard_normal((groups, slots, d_model)), jnp.bfloat16)
    counts = rng.integers(1, slots, groups).astype(np.int32)
    counts[1], counts[3], counts[4] = 0, -5, slots  # empty, negative (no rows either), full
    p64 = {k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in params.items()}
    r64 = np.asarray(rows.astype(jnp.float32), np.float64)
    want = np.zeros(r64.shape)
    for g in range(groups):
        x = r64[g, : max(counts[g], 0)]
        gate, up = x @ p64["w_gate"][g], x @ p64["w_up"][g]
        want[g, : max(counts[g], 0)] = (gate / (1 + np.exp(-gate)) * up) @ p64["w_down"][g]
    out = {"counts": counts.tolist()}
    with jax.default_matmul_precision("highest"):
        for backend in ("mosaic", "xla"):
            f = jax.jit(lambda r, c, b=backend: layers.swiglu_expert_slots(params, r, c, backend=b))
            got = np.asarray(f(rows, jnp.asarray(counts)).astype(jnp.float32), np.float64)
            padding = max(float(np.abs(got[g, max(counts[g], 0) :]).max(initial=0.0)) for g in range(groups))
            out[backend] = {"y": _relative_error(got, want), "padding_max": padding}
    return out


def test_the_decode_layers_expert_slots_on_mosaic_kernels_match_numpy():
    res = _child_result("expert_slots_child")
    if "skip" in res:
        pytest.skip(res["skip"])
    for backend in ("mosaic", "xla"):
        # bf16 intermediates (h) against float64: ~1e-2 at most.
        assert res[backend]["y"] < 2e-2, res
        assert res[backend]["padding_max"] == 0.0, res


def _child_result(function: str, *args: object, env: dict | None = None) -> dict:
    """Runs `function(*args)` of this file in one GPU process (with `env` set); its result, printed for the log."""
    results = launch(HERE, function, 1, args=list(args), platform="gpu", timeout_s=300, env=env or {})
    assert all(x.ok for x in results), describe(results)
    print(results[0].result)
    return results[0].result


@pytest.mark.parametrize("row_kernel", ["tokamax", "jax"])
def test_grouped_matmul_on_mosaic_kernels_matches_numpy_and_ragged_dot(row_kernel):
    res = _child_result("grouped_child", row_kernel)
    if "skip" in res:
        pytest.skip(res["skip"])
    for name in ("fast", "xla", "shard_map", "nan_padding"):
        errors = res[name]
        # bf16 operands, float32 accumulation; d lhs is produced in bf16 (the operands' dtype): ~3 significant digits.
        # JAX's kernel writes y in the operands' dtype before the cast to float32: one more bf16 rounding (2^-8).
        assert errors["y"] < (2e-3 if row_kernel == "tokamax" else 4e-3), (name, errors)
        assert errors["dlhs"] < 1e-2, (name, errors)
        assert errors["drhs"] < 1e-2, (name, errors)
        assert errors["rows_past_groups_max"] == 0.0, (name, errors)
        assert errors["empty_group_grad_max"] == 0.0, (name, errors)
    assert res["fast_vs_xla_y"] < (2e-3 if row_kernel == "tokamax" else 4e-3), res


def _median_us(f, *args) -> float:
    """Microseconds a call of jitted `f`: the median of 5 rounds of 20 calls after one to compile (wall time), with
    the test mode's poisoning of outputs off (a fill of every output byte)."""
    import time

    import jax
    import numpy as np

    from jax_uccl_ep import _uccl_ep_testing

    modes = _uccl_ep_testing.test_modes()
    _uccl_ep_testing.set_test_modes(**{**modes, "poison": False})
    try:
        jax.block_until_ready(f(*args))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(20):
                out = f(*args)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / 20)
    finally:
        _uccl_ep_testing.set_test_modes(**modes)
    return round(float(np.median(times)) * 1e6, 1)


def expand_child() -> dict:
    """Child: the pair rows from token rows on the GPU (expand without zero padding: the FFI's expand_pairs, as the
    layer runs it) against NumPy, for rows of 4096, 60 and 7 bytes (the copy's wide and narrow paths), slots naming
    no row among them; then its time beside the zeroing gather at the layer's sizes (reported, not checked)."""

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_uccl_ep import _pairs

    rng = np.random.default_rng(5)
    res = {}
    for name, shape, dtype in [("bf16", (2048,), jnp.bfloat16), ("f32", (3, 5), jnp.float32), ("u8", (7,), jnp.uint8)]:
        c, m = 300, 1000
        rows_np = (rng.standard_normal((c, *shape)) * 50).astype(np.float32)
        rows = jnp.asarray(rows_np.astype(np.uint8) if dtype == jnp.uint8 else rows_np, dtype)
        pair_row = rng.integers(0, c + 50, m).astype(np.int32)  # ~1/7 name no row
        got = {
            z: np.asarray(jax.jit(lambda r, p, z=z: _pairs.expand(r, p, None, z))(rows, jnp.asarray(pair_row)))
            for z in (False, True)
        }
        named = pair_row < c
        want = np.asarray(rows)[np.minimum(pair_row, c - 1)]
        res[name] = {
            "named_rows_wrong": int(sum((got[z][named] != want[named]).any() for z in (False, True))),
            "zeroed_padding_nonzero": int(got[True][~named].any()),
        }
    c, m, h, valid = 15024, 131072, 2048, 33000
    rows = jnp.asarray(rng.standard_normal((c, h)), jnp.bfloat16)
    pair_row = np.full(m, c, np.int32)
    pair_row[:valid] = rng.integers(0, c, valid)
    pair_row = jnp.asarray(pair_row)
    for z in (True, False):
        res[f"us_zero_padding_{z}"] = _median_us(
            jax.jit(lambda r, p, z=z: _pairs.expand(r, p, None, z)), rows, pair_row
        )
    return res


def test_expand_on_the_gpu_copies_each_slot_its_row():
    res = _child_result("expand_child")
    for name in ("bf16", "f32", "u8"):
        assert res[name] == {"named_rows_wrong": 0, "zeroed_padding_nonzero": 0}, res


def sum_child() -> dict:
    """Child: combine's first step after token rows (reduce_pairs by the FFI's sum_pairs) on the GPU against NumPy
    for the suite's cases (16-byte vectors and an element a lane, bf16 and float32 both ways); then its time beside
    XLA's gather and sum at the layer's sizes (reported, not checked)."""
    import cases
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_uccl_ep import _pairs

    res: dict = {
        "problems": [p for i, case in enumerate(cases.SUM_PAIRS_CASES) for p in cases.sum_pairs_problems(i, *case)]
    }
    rng = np.random.default_rng(6)
    c, m, h, k, valid = 15024, 131072, 2048, 8, 33000
    pairs = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    pair_of = np.full((c, k), m, np.int32)
    pair_of.reshape(-1)[rng.choice(c * k, valid, replace=False)] = rng.permutation(valid)
    pair_of = jnp.asarray(pair_of)
    for z, label in ((True, "xla"), (False, "sum_pairs")):
        fn = jax.jit(lambda p, o, z=z: _pairs.reduce_pairs(p, None, o, z, jnp.bfloat16, not z))
        res[f"us_{label}"] = _median_us(fn, pairs, pair_of)
    return res


def test_sum_pairs_on_the_gpu_matches_numpy():
    res = _child_result("sum_child")
    assert res["problems"] == [], res


def swiglu_child() -> dict:
    """Child: the layer's weighted SwiGLU between its matmuls (FFI swiglu and swiglu_grad) on the GPU against NumPy
    float64, for bf16 rows of 1024 features (16-byte vectors) and float32 rows of 10 (an element at a time), the
    groups' rows a prefix of the buffer; then its forward+backward time at the layer's sizes beside XLA's
    elementwise step over every row (reported, not checked)."""

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_uccl_ep import _uccl_ep_testing, layers

    rng = np.random.default_rng(6)
    res = {}

    def step(a, w, dh, n):
        h, vjp = jax.vjp(lambda a, w: layers._weighted_swiglu(a, w, n), a, w)
        return (h, *vjp(dh))

    for name, m, f, dtype in [("bf16", 3000, 1024, jnp.bfloat16), ("f32", 500, 10, jnp.float32)]:
        n = m * 2 // 3
        gate_up = jnp.asarray(rng.standard_normal((m, 2 * f)) * 2, dtype)
        weights = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
        dh = jnp.asarray(rng.standard_normal((m, f)), dtype)
        h, d_gate_up, d_w = jax.jit(step)(gate_up, weights, dh, jnp.int32(n))
        g = np.asarray(gate_up.astype(jnp.float32), np.float64)[:n]
        gate, up = g[:, :f], g[:, f:]
        w = np.asarray(weights, np.float64)[:n, None]
        d = np.asarray(dh.astype(jnp.float32), np.float64)[:n]
        sig = 1 / (1 + np.exp(-gate))
        want_dg = np.concatenate([d * w * up * sig * (1 + gate * (1 - sig)), d * w * gate * sig], axis=1)
        if _uccl_ep_testing.test_modes()["poison"]:  # the rows past the groups: left as the fill made them
            past = [np.asarray(h.astype(jnp.float32))[n:], np.asarray(d_gate_up.astype(jnp.float32))[n:]]
            res[f"{name}_past_rows_nan"] = bool(all(np.isnan(p).all() for p in past))
        res[name] = {
            "h": _relative_error(np.asarray(h.astype(jnp.float32))[:n], gate * sig * up * w),
            "d_gate_up": _relative_error(np.asarray(d_gate_up.astype(jnp.float32))[:n], want_dg),
            "d_weight": _relative_error(np.asarray(d_w)[:n], np.sum(d * gate * sig * up, axis=1)),
        }
    m, f, n = 131072, 1024, 33000
    gate_up = jnp.asarray(rng.standard_normal((m, 2 * f)), jnp.bfloat16)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    dh = jnp.asarray(rng.standard_normal((m, f)), jnp.bfloat16)

    def xla_step(a, w, dh, n):  # what the layer ran before: XLA's elementwise step over every row, then the weights
        def fn(a, w):
            gate, up = jnp.split(a.astype(jnp.float32), 2, axis=-1)
            return (jax.nn.silu(gate) * up * w[:, None]).astype(a.dtype)

        h, vjp = jax.vjp(fn, a, w)
        return (h, *vjp(dh))

    for label, fn in (("ffi", step), ("xla", xla_step)):
        res[f"us_fwd_bwd_{label}"] = _median_us(jax.jit(fn), gate_up, weights, dh, jnp.int32(n))
    return res


def test_the_weighted_swiglu_on_the_gpu_matches_numpy():
    res = _child_result("swiglu_child")
    assert res["bf16"]["h"] < 1e-2 and res["bf16"]["d_gate_up"] < 1e-2 and res["bf16"]["d_weight"] < 1e-2, res
    assert max(res["f32"].values()) < 1e-5, res
    assert all(res.get(f"{name}_past_rows_nan", True) for name in ("bf16", "f32")), res


def layer_child() -> dict:
    """Child: the layer over every GPU of the process (R of them, one where that is all: dispatch and combine over
    NVLink, or over its own rank), bf16 experts through the Mosaic kernels and through XLA, against the dense
    reference in float32, output and gradients."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jax_uccl_ep as ep
    from jax_uccl_ep import layers
    from jax_uccl_ep.grouped import grouped_backend

    ep.initialize()
    devices = jax.devices()[: 1 << (min(len(jax.devices()), 8).bit_length() - 1)]  # 1, 2, 4 or 8: divide 16 experts
    mesh = Mesh(np.array(devices), ("ep",))
    d_model, d_ff, experts, tokens = 256, 384, 16, 512
    params = layers.init_moe_params(jax.random.key(1), d_model=d_model, d_ff=d_ff, num_experts=experts)
    x = jax.random.normal(jax.random.key(2), (8, tokens // 8, d_model))
    cotangent = jax.random.normal(jax.random.key(3), x.shape)

    def grads(layer):
        def loss(p, x):
            return jnp.sum(layer(p, x).astype(jnp.float32) * cotangent)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

    out: dict = {"ranks": len(devices)}
    with jax.default_matmul_precision("highest"):
        ref_config = layers.MoEConfig(num_experts=experts, top_k=4, compute_dtype=jnp.float32)
        ref = grads(lambda p, x: layers.moe_ffn_reference(p, x, ref_config).y)
        ref_y = jax.jit(lambda p, x: layers.moe_ffn_reference(p, x, ref_config).y)(params, x)
        for backend in ("mosaic", "xla"):
            config = layers.MoEConfig(num_experts=experts, top_k=4, grouped_matmul=backend)
            if backend == "mosaic" and grouped_backend("auto", config.experts_dtype(jnp.float32)) != backend:
                out[backend] = "skip"
                continue
            got = grads(lambda p, x, c=config: layers.moe_ffn(p, x, mesh=mesh, config=c).y)
            (_, (gp, gx)), (_, (rp, rx)) = got, ref
            out[backend] = {
                "loss": _relative_error(got[0], ref[0]),
                "dx": _relative_error(gx, rx),
                **{f"d{k}": _relative_error(gp[k], rp[k]) for k in ("router", "w_gate", "w_up", "w_down")},
            }
            # The decoding layer (low latency, rows in the experts' dtype or FP8, the router weights carried) on
            # the same parameters and tokens, against the reference's forward.
            per_rank = x.reshape(len(devices), -1, d_model)
            for use_fp8 in (False, True):

                def decode(p, t, c=config, f=use_fp8):
                    y = layers.moe_ffn_decode(p, t[0], c, axis_name="ep", max_tokens_per_rank=t.shape[1], use_fp8=f)
                    return y[None]

                specs = (layers.moe_param_specs("ep"), P("ep"))
                got = jax.jit(jax.shard_map(decode, mesh=mesh, in_specs=specs, out_specs=P("ep")))(params, per_rank)
                out[backend]["decode_fp8" if use_fp8 else "decode"] = _relative_error(got.reshape(x.shape), ref_y)
    ep.shutdown()
    return out


@pytest.mark.parametrize("pairs", ["token rows", "pair writer"])
def test_the_layer_with_bf16_experts_follows_the_float32_reference(pairs):
    """The layer over every GPU of one process, its pair rows written by the NVLink receive (the default where
    dispatch pulls), or from token rows and XLA's layout (UCCL_EP_NVL_DISPATCH_PAIRS=0); and the decoding layer
    (low latency, bf16 and FP8 rows) on the same parameters and tokens."""
    res = _child_result("layer_child", env={"UCCL_EP_NVL_DISPATCH_PAIRS": "1" if pairs == "pair writer" else "0"})
    res.pop("ranks")
    for backend, errors in res.items():
        if errors == "skip":
            continue
        # bf16 rows and weights against float32 everywhere: relative errors of a few 1e-3; FP8 rows (e4m3, a scale
        # per 128 values) a few 1e-2.
        assert {"loss", "dx", "decode", "decode_fp8"} <= errors.keys(), errors
        for name, err in errors.items():
            assert err < (0.1 if name == "decode_fp8" else 3e-2), (backend, name, errors)
