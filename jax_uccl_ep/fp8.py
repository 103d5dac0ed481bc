"""FP8 casts for dispatch: per-token, per-128-channel scaling into float8_e4m3fn, as DeepSeek's recipe does."""
from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_BLOCK = 128  # channels that share one scale
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def per_token_cast_to_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Casts x [T, H] (H a multiple of 128) to (x_fp8 [T, H] float8_e4m3fn, scales [T, H // 128] float32).

    Each block of 128 channels of a token is divided by its scale, amax(|block|) / 448, so the block's largest
    value lands on the largest FP8 number; x ~= x_fp8 * scales (repeated over each block).
    """
    if x.ndim != 2 or x.shape[1] % FP8_BLOCK:
        raise ValueError(f"per_token_cast_to_fp8: x must be [tokens, hidden] with hidden a multiple of "
                         f"{FP8_BLOCK}, got shape {x.shape}")
    t, h = x.shape
    blocks = x.astype(jnp.float32).reshape(t, h // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), 1e-4)  # all-zero blocks keep a finite scale
    scales = amax / FP8_MAX
    x_fp8 = (blocks / scales[..., None]).astype(jnp.float8_e4m3fn).reshape(t, h)
    return x_fp8, scales


def per_token_cast_back(x_fp8: jax.Array, scales: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """Inverse of per_token_cast_to_fp8: x_fp8 [T, H] times its block scales [T, H // 128], in `dtype`."""
    t, h = x_fp8.shape
    if scales.shape != (t, h // FP8_BLOCK):
        raise ValueError(f"per_token_cast_back: scales must have shape {(t, h // FP8_BLOCK)}, got {scales.shape}")
    blocks = x_fp8.astype(jnp.float32).reshape(t, h // FP8_BLOCK, FP8_BLOCK) * scales[..., None]
    return blocks.reshape(t, h).astype(dtype)
