"""Argument checks shared by the ops: each raises ValueError naming the argument, what it got and what it takes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np

AxisName = Union[str, Sequence[str]]

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16)  # what the kernels sum
ROW_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # what dispatch carries (float16 sums as float32)


def summed_row_dtype(dtype: Any) -> np.dtype:
    """The dtype rows of `dtype` travel in where the kernels sum them: their own where it is one of FLOAT_DTYPES,
    else (float16) float32."""
    return np.dtype(dtype) if np.dtype(dtype) in FLOAT_DTYPES else np.dtype(np.float32)


def check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"jax_uccl_ep: {message}")


def axis_size(axis_name: AxisName) -> int:
    """Ranks along the EP axis (or axes) of the enclosing shard_map; a ValueError that says so outside one."""
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        raise ValueError(
            f"jax_uccl_ep: the EP ops run inside jax.shard_map over a mesh with the axis {axis_name!r} (each device "
            "calls them on its own tokens); wrap the call in jax.shard_map(..., mesh=mesh, in_specs=..., "
            "out_specs=...), or use the layer jax_uccl_ep.layers.moe_ffn, which opens it"
        ) from None


def check_topk(topk_idx: jax.Array, num_tokens: int | None, name: str = "topk_idx") -> None:
    check(topk_idx.ndim == 2, f"{name} must be 2-D [tokens, top_k], got shape {topk_idx.shape}")
    check(topk_idx.dtype == jnp.int32, f"{name} must be int32, got {topk_idx.dtype}")
    if num_tokens is not None:
        check(topk_idx.shape[0] == num_tokens, f"{name} has {topk_idx.shape[0]} rows, x has {num_tokens}")


def as_expert_indices(topk_idx: jax.Array, name: str = "topk_idx") -> jax.Array:
    """`topk_idx` of any integer dtype as the int32 the ops take (-1 stays -1; uint32's 0xFFFFFFFF becomes -1). Wider
    indices past int32's range are clamped to its ends, which the ops refuse as experts, rather than wrapped onto
    one."""
    check(
        hasattr(topk_idx, "dtype") and jnp.issubdtype(topk_idx.dtype, jnp.integer),
        f"{name} must hold integers (expert indices, -1 for none), got {getattr(topk_idx, 'dtype', topk_idx)}",
    )
    if topk_idx.dtype == jnp.int32:
        return topk_idx
    if jnp.iinfo(topk_idx.dtype).bits > 32:
        int32 = jnp.iinfo(jnp.int32)
        low = int32.min if jnp.issubdtype(topk_idx.dtype, jnp.signedinteger) else 0
        topk_idx = jnp.clip(topk_idx, low, int32.max)
    return topk_idx.astype(jnp.int32)


def as_router_weights(topk_weights: jax.Array, topk_idx: jax.Array) -> jax.Array:
    """Router weights of any float dtype as the float32 the ops carry, shaped like `topk_idx`."""
    check(
        hasattr(topk_weights, "dtype") and jnp.issubdtype(topk_weights.dtype, jnp.floating),
        f"topk_weights must be floating point, got {getattr(topk_weights, 'dtype', topk_weights)}",
    )
    check(
        topk_weights.shape == topk_idx.shape,
        f"topk_weights must have the shape of topk_idx {topk_idx.shape}, got {topk_weights.shape}",
    )
    return topk_weights.astype(jnp.float32)


def flatten_tokens(a: jax.Array, trailing: int = 1) -> tuple[jax.Array, tuple[int, ...]]:
    """`a` [..., *last `trailing` dims] as [tokens, ...]: the leading dimensions flattened (batch, sequence, ...),
    and their shape, which the op's result gets back."""
    check(
        hasattr(a, "ndim") and a.ndim >= trailing + 1,
        f"expected [..., tokens, {'...' if trailing > 1 else 'hidden'}] with at least {trailing + 1} dimensions, "
        f"got shape {getattr(a, 'shape', a)}",
    )
    check(
        all(n > 0 for n in a.shape[a.ndim - trailing :]),
        f"the last {'dimensions' if trailing > 1 else 'dimension'} of shape {a.shape} must not be empty (a row "
        "needs channels)",
    )
    lead = tuple(a.shape[: a.ndim - trailing])
    return a.reshape((-1, *a.shape[a.ndim - trailing :])), lead


def check_experts(num_experts: int, num_ranks: int) -> None:
    check(
        isinstance(num_experts, (int, np.integer)) and num_experts > 0,
        f"num_experts must be a positive int, got {num_experts!r}",
    )
    check(num_experts % num_ranks == 0, f"num_experts={num_experts} is not divisible by the axis size {num_ranks}")
