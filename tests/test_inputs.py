"""Inputs as models make them: [batch, seq, hidden] activations, integer indices of other widths, bf16 or f16
router weights and float16 rows. Each form must give what the canonical form ([tokens, hidden], int32, float32)
gives on the same values (itself checked against the NumPy reference in test_normal.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_uccl_ep as ep

R, B, S, H, K, E = 4, 3, 5, 128, 3, 16


@pytest.fixture(scope="module", autouse=True)
def runtime():
    ep.initialize()
    yield


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:R]), ("ep",))


def _routing(seed: int):
    rng = np.random.default_rng(seed)
    idx = ref.random_routing(rng, R, B * S, K, E).reshape(R, B, S, K)
    x = rng.standard_normal((R, B, S, H)).astype(np.float32)
    w = rng.random((R, B, S, K)).astype(np.float32)
    return x, idx, w


def _roundtrip(x, idx, w, *, flat: bool, y_dtype=None):
    """Dispatch, y = rows * 2 + rank (rounded to y_dtype if given), combine; with flat=True on [T, H] int32 /
    float32 inputs."""

    def body(x, idx, w):
        x, idx, w = x[0], idx[0], w[0]
        if flat:
            x, idx, w = x.reshape(B * S, H), idx.reshape(B * S, K).astype(jnp.int32), w.reshape(B * S, K)
            w = w.astype(jnp.float32)
        res = ep.dispatch(x, idx, w, num_experts=E, axis_name="ep")
        rank = jax.lax.axis_index("ep").astype(res.x.dtype)
        y = res.x * 2 + rank
        y = y if y_dtype is None else y.astype(y_dtype).astype(y.dtype)
        out = ep.combine(y, res.handle)
        return out[None], res.topk_weights.astype(jnp.float32)[None], res.num_tokens[None]

    f = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P("ep"), out_specs=P("ep")))
    return [np.asarray(a) for a in f(x, idx, w)]


@pytest.mark.parametrize("idx_dtype", [np.int16, np.uint32, np.int32])
@pytest.mark.parametrize("w_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_batch_seq_inputs_and_index_and_weight_dtypes(idx_dtype, w_dtype):
    x, idx, w = _routing(5)
    w_model = np.asarray(jnp.asarray(w, w_dtype))  # what a model of that dtype holds
    out, got_w, n = _roundtrip(x, idx.astype(idx_dtype), w_model, flat=False)
    want, want_w, want_n = _roundtrip(x, idx, w_model.astype(np.float32), flat=True)
    assert out.shape == (R, B, S, H)  # the leading dimensions come back
    np.testing.assert_array_equal(n, want_n)
    np.testing.assert_array_equal(out.reshape(R, B * S, H), want)
    np.testing.assert_array_equal(got_w, want_w)  # weights came through in their own dtype, unchanged


def test_float16_rows_travel_and_sum_in_float32():
    x, idx, w = _routing(6)
    x16 = np.asarray(jnp.asarray(x, jnp.float16))
    out16, _, _ = _roundtrip(x16, idx, w, flat=False)
    out32, _, _ = _roundtrip(x16.astype(np.float32), idx, w, flat=False, y_dtype=jnp.float16)
    assert out16.dtype == np.float16
    # The same sums rounded once to float16 (the copies of a token are summed in float32).
    np.testing.assert_array_equal(out16, out32.astype(np.float16))


def test_gradients_reach_bf16_weights_and_batched_x():
    x, idx, w = _routing(7)

    def loss(x, w, idx):
        def body(x, w, idx):
            res = ep.dispatch(x[0], idx[0], w[0], num_experts=E, axis_name="ep")
            y = res.x * res.topk_weights.astype(res.x.dtype).sum(-1, keepdims=True)
            return ep.combine(y, res.handle)[None]

        f = jax.shard_map(body, mesh=_mesh(), in_specs=P("ep"), out_specs=P("ep"))
        return (f(x, w, idx).astype(jnp.float32) ** 2).sum()

    wb = jnp.asarray(w, jnp.bfloat16)
    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x), wb, jnp.asarray(idx, jnp.int16))
    assert gx.shape == x.shape and gw.dtype == jnp.bfloat16 and gw.shape == w.shape
    gx_flat, gw_flat = jax.jit(jax.grad(loss, argnums=(0, 1)))(
        jnp.asarray(x), wb.astype(jnp.float32), jnp.asarray(idx, jnp.int32)
    )
    np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_flat), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(gw, np.float32), np.asarray(gw_flat.astype(jnp.bfloat16), np.float32), rtol=1e-2, atol=1e-2
    )
    assert np.abs(np.asarray(gw, np.float32)).sum() > 0  # the weights' gradient is not lost in the cast


def test_layout_keeps_the_leading_dimensions():
    _, idx, _ = _routing(8)

    def body(idx):
        lay = ep.get_dispatch_layout(idx[0], num_experts=E, axis_name="ep")
        return lay.is_token_in_rank[None], lay.num_tokens_per_rank[None]

    f = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P("ep"), out_specs=P("ep")))
    in_rank, per_rank = (np.asarray(a) for a in f(idx.astype(np.uint32)))
    assert in_rank.shape == (R, B, S, R)
    owner = np.where(idx >= 0, idx // (E // R), -1)
    want = np.stack([(owner == q).any(-1) for q in range(R)], -1)
    np.testing.assert_array_equal(in_rank, want)
    np.testing.assert_array_equal(per_rank, want.reshape(R, B * S, R).sum(1))


def test_what_cannot_be_taken_says_so():
    x, idx, w = _routing(9)
    with pytest.raises(ValueError, match="topk_idx must hold integers"):
        _roundtrip(x, idx.astype(np.float32), w, flat=False)
    with pytest.raises(ValueError, match="topk_weights must be floating point"):
        _roundtrip(x, idx, idx, flat=False)
    with pytest.raises(ValueError, match="x's leading dimensions"):
        _roundtrip(x, idx.reshape(R, B * S, K), w.reshape(R, B * S, K), flat=False)


def test_unsupported_transformations_name_themselves():
    x, idx, w = _routing(10)
    x2, idx2 = jnp.asarray(x[0].reshape(B * S, H)), jnp.asarray(idx[0].reshape(B * S, K))
    with pytest.raises(ValueError, match="run inside jax.shard_map over a mesh with the axis 'ep'"):
        ep.dispatch(x2, idx2, num_experts=E, axis_name="ep")

    def ll(x, idx):
        out = ep.low_latency_dispatch(
            x[0], idx[0], num_experts=E, max_tokens_per_rank=B * S, axis_name="ep", use_fp8=False
        )
        return out[0].astype(jnp.float32).sum()[None]

    f = jax.shard_map(ll, mesh=_mesh(), in_specs=P("ep"), out_specs=P("ep"))
    xs, idxs = jnp.asarray(x.reshape(R, B * S, H)), jnp.asarray(idx.reshape(R, B * S, K))
    with pytest.raises(NotImplementedError, match="low-latency ops are for inference and decoding"):
        jax.grad(lambda x: f(x, idxs).sum())(xs)

    def vmapped(x, idx):
        def one(x, idx):
            return ep.dispatch(x, idx, num_experts=E, axis_name="ep").x

        return jax.vmap(one)(x[0], idx[0])[None]

    g = jax.shard_map(vmapped, mesh=_mesh(), in_specs=P("ep"), out_specs=P("ep"))
    with pytest.raises(NotImplementedError, match="cannot run under jax.vmap"):
        jax.jit(g)(jnp.asarray(x), jnp.asarray(idx))


def test_fp8_dispatch_is_differentiable_with_the_cast_as_identity():
    x, idx, w = _routing(11)
    x = jnp.asarray(x, jnp.bfloat16)
    scale = jnp.arange(1, H + 1, dtype=jnp.float32) / H  # a loss linear in the received rows

    def loss(x, use_fp8):
        def body(x, idx):
            res = ep.dispatch(x[0], idx[0], num_experts=E, axis_name="ep", use_fp8=use_fp8)
            y = (res.x.astype(jnp.float32) * scale).astype(res.x.dtype)
            return ep.combine(y, res.handle)[None]

        f = jax.shard_map(body, mesh=_mesh(), in_specs=P("ep"), out_specs=P("ep"))
        return f(x, jnp.asarray(idx)).astype(jnp.float32).sum()

    v8, g8 = jax.jit(jax.value_and_grad(loss), static_argnums=1)(x, True)
    v16, g16 = jax.jit(jax.value_and_grad(loss), static_argnums=1)(x, False)
    assert g8.dtype == jnp.bfloat16 and g8.shape == x.shape
    np.testing.assert_array_equal(np.asarray(g8, np.float32), np.asarray(g16, np.float32))  # same backward
    assert abs(float(v8) - float(v16)) <= 0.02 * abs(float(v16))  # forward within FP8 rounding
    assert float(v8) != float(v16)  # and it did travel as FP8
