"""FP8 casts for dispatch: per-token, per-128-channel scaling into float8_e4m3fn, as DeepSeek's recipe does."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FP8_BLOCK = 128  # channels that share one scale
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def dispatch_row_bytes(hidden: int, fp8: bool, dtype: Any) -> tuple[int, int]:
    """(x bytes, scale bytes) of one dispatched row: FP8 rows are `hidden` bytes with a float32 scale per
    FP8_BLOCK channels; other rows are hidden elements of `dtype` and have no scales."""
    if fp8:
        return hidden, (hidden // FP8_BLOCK) * 4
    return hidden * np.dtype(dtype).itemsize, 0


def per_token_cast_to_fp8(x: jax.Array, round_scale: bool = False) -> tuple[jax.Array, jax.Array]:
    """Casts x [T, H] (H a multiple of 128) to (x_fp8 [T, H] float8_e4m3fn, scales [T, H // 128] float32).

    Each block of 128 channels of a token is divided by its scale, amax(|block|) / 448, so the block's largest
    value lands on the largest FP8 number; x ~= x_fp8 * scales (repeated over each block). With `round_scale`
    the scales are rounded up to powers of two (what UE8M0 scales can hold).
    """
    if x.ndim != 2 or x.shape[1] % FP8_BLOCK:
        raise ValueError(
            f"per_token_cast_to_fp8: x must be [tokens, hidden] with hidden a multiple of "
            f"{FP8_BLOCK}, got shape {x.shape}"
        )
    t, h = x.shape
    blocks = x.astype(jnp.float32).reshape(t, h // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), 1e-4)  # all-zero blocks keep a finite scale
    scales = amax / FP8_MAX
    if round_scale:  # 2^ceil(log2 s) from the bits (exp2/log2 are not exact: 2^-15 came out as 3.0517593e-05)
        bits = jax.lax.bitcast_convert_type(scales, jnp.uint32)
        exponent = (bits >> 23) + jnp.where(bits & 0x7FFFFF, 1, 0).astype(jnp.uint32)
        rounded = jax.lax.bitcast_convert_type(exponent << 23, jnp.float32)
        scales = jnp.where(jnp.isfinite(scales), rounded, scales)  # NaN and inf stay as they are
    x_fp8 = (blocks / scales[..., None]).astype(jnp.float8_e4m3fn).reshape(t, h)
    return x_fp8, scales


def per_token_cast_back(x_fp8: jax.Array, scales: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """Inverse of per_token_cast_to_fp8: x_fp8 [T, H] times its block scales [T, H // 128], in `dtype`."""
    t, h = x_fp8.shape
    if scales.shape != (t, h // FP8_BLOCK):
        raise ValueError(f"per_token_cast_back: scales must have shape {(t, h // FP8_BLOCK)}, got {scales.shape}")
    blocks = x_fp8.astype(jnp.float32).reshape(t, h // FP8_BLOCK, FP8_BLOCK) * scales[..., None]
    return blocks.reshape(t, h).astype(dtype)


def pack_ue8m0(scales: jax.Array) -> jax.Array:
    """Power-of-two float32 scales [..., G] (G a multiple of 4) as UE8M0 exponents, four to an int32 [..., G / 4].

    Byte i of each int32 (little end first) is the biased exponent (127 + log2 scale) of scale 4j + i.
    """
    if scales.shape[-1] % 4:
        raise ValueError(f"pack_ue8m0: the last dimension must be a multiple of 4, got {scales.shape}")
    exponents = (jax.lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint32) >> 23) & 0xFF
    e = exponents.reshape(*scales.shape[:-1], scales.shape[-1] // 4, 4)
    packed = e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)
    return jax.lax.bitcast_convert_type(packed, jnp.int32)


def unpack_ue8m0(packed: jax.Array) -> jax.Array:
    """Inverse of pack_ue8m0: float32 scales [..., 4 * G]."""
    u = jax.lax.bitcast_convert_type(packed, jnp.uint32)
    e = jnp.stack([(u >> (8 * i)) & 0xFF for i in range(4)], axis=-1)
    return jax.lax.bitcast_convert_type(e << 23, jnp.float32).reshape(*packed.shape[:-1], packed.shape[-1] * 4)
