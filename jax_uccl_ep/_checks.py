"""Argument checks shared by the ops: each raises ValueError naming the argument, what it got and what it takes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

AxisName = Union[str, Sequence[str]]

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16)


def check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"jax_uccl_ep: {message}")


def axis_size(axis_name: AxisName) -> int:
    """Ranks along the EP axis (or axes) of the enclosing shard_map."""
    return int(jax.lax.axis_size(axis_name))


def check_topk(topk_idx: jax.Array, num_tokens: int | None, name: str = "topk_idx") -> None:
    check(topk_idx.ndim == 2, f"{name} must be 2-D [tokens, top_k], got shape {topk_idx.shape}")
    check(topk_idx.dtype == jnp.int32, f"{name} must be int32, got {topk_idx.dtype}")
    if num_tokens is not None:
        check(topk_idx.shape[0] == num_tokens, f"{name} has {topk_idx.shape[0]} rows, x has {num_tokens}")


def check_experts(num_experts: int, num_ranks: int) -> None:
    check(
        isinstance(num_experts, (int, np.integer)) and num_experts > 0,
        f"num_experts must be a positive int, got {num_experts!r}",
    )
    check(num_experts % num_ranks == 0, f"num_experts={num_experts} is not divisible by the axis size {num_ranks}")
