"""FP8 casts: round trip within float8_e4m3fn's precision, scales per 128 channels, and the bad-shape errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jax_uccl_ep as ep


@pytest.mark.parametrize("tokens,hidden", [(1, 128), (37, 256), (16, 7168)])
def test_round_trip_within_fp8_precision(tokens, hidden):
    rng = np.random.default_rng(tokens * hidden)
    # Blocks of very different magnitudes: each must be scaled on its own.
    x = rng.standard_normal((tokens, hidden)) * np.exp(rng.uniform(-6, 6, (tokens, hidden // 128, 1))).repeat(
        128, 2
    ).reshape(tokens, hidden)
    x[:, ::16] *= 10.0 ** rng.uniform(-6, -3, x[:, ::16].shape)  # far below their block's largest: FP8 subnormals
    x = jnp.asarray(x, jnp.float32)
    x_fp8, scales = ep.per_token_cast_to_fp8(x)
    assert x_fp8.dtype == jnp.float8_e4m3fn and x_fp8.shape == x.shape
    assert scales.dtype == jnp.float32 and scales.shape == (tokens, hidden // 128)
    back = np.asarray(ep.per_token_cast_back(x_fp8, scales, jnp.float32))
    xs = np.asarray(x)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal numbers. Below 2^-6 (scaled) values are
    # subnormal, on a grid of 2^-9: at most half a step, scale * 2^-10, off, with scale = block amax / 448.
    blocks_max = np.abs(xs).reshape(tokens, hidden // 128, 128).max(-1).repeat(128, 1).reshape(tokens, hidden)
    scale = blocks_max / 448.0
    err = np.abs(back - xs)
    assert np.all(err <= np.maximum(np.abs(xs) * 2.0**-4, scale * 2.0**-10) * 1.01)
    assert np.any(np.abs(xs) < scale * 2.0**-6)  # the case holds subnormals
    # Each block's largest value maps to the largest FP8 number.
    amax_fp8 = np.abs(np.asarray(x_fp8.astype(jnp.float32))).reshape(tokens, hidden // 128, 128).max(-1)
    np.testing.assert_allclose(amax_fp8, 448.0)


def test_zero_block_keeps_finite_scale():
    x = jnp.zeros((2, 256), jnp.float32).at[0, 200].set(3.0)
    x_fp8, scales = ep.per_token_cast_to_fp8(x)
    assert np.all(np.isfinite(np.asarray(scales)))
    back = np.asarray(ep.per_token_cast_back(x_fp8, scales, jnp.float32))
    np.testing.assert_allclose(back, np.asarray(x), rtol=1e-6)
    assert np.count_nonzero(back) == 1


def test_bad_shapes_name_the_problem():
    with pytest.raises(ValueError, match="multiple of 128"):
        ep.per_token_cast_to_fp8(jnp.ones((4, 96)))
    with pytest.raises(ValueError, match="scales must have shape"):
        ep.per_token_cast_back(jnp.ones((4, 128), jnp.float8_e4m3fn), jnp.ones((4, 2)))


def test_rounded_scales_are_exact_powers_of_two():
    # Blocks from 2^-20 to 2^20: exp2(ceil(log2 s)) in XLA gave 3.0517593e-05 for 2^-15, which UE8M0 cannot hold.
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 128)) * np.exp2(rng.uniform(-20, 20, (64, 1)))
    x_fp8, scales = ep.per_token_cast_to_fp8(jnp.asarray(x, jnp.float32), round_scale=True)
    s = np.asarray(scales)
    mantissa, _ = np.frexp(s)
    assert np.all(mantissa == 0.5), s[mantissa != 0.5][:4]
    plain = np.asarray(ep.per_token_cast_to_fp8(jnp.asarray(x, jnp.float32))[1])
    assert np.all((s >= plain) & (s < 2 * plain))  # the next power of two up
    np.testing.assert_array_equal(
        np.asarray(ep.unpack_ue8m0(ep.pack_ue8m0(jnp.asarray(s).reshape(16, 4)))), s.reshape(16, 4)
    )


def test_nonfinite_blocks_keep_nonfinite_scales():
    x = np.ones((2, 256), np.float32)
    x[0, 3], x[1, 200] = np.nan, np.inf
    for round_scale in (False, True):
        scales = np.asarray(ep.per_token_cast_to_fp8(jnp.asarray(x), round_scale=round_scale)[1])
        assert np.isnan(scales[0, 0]) and np.isposinf(scales[1, 1]), scales  # not -0.0 (bits past the exponent)
        assert np.all(np.isfinite(scales[[0, 1], [1, 0]]))
