"""Low-latency (decode) mode: low_latency_dispatch and low_latency_combine, for use inside jax.shard_map.

Each token goes to every selected expert (one copy per expert slot) into static expert-major buffers that keep
their size from step to step: recv_x is [L, R * N, H] for L = num_experts / R local experts and N =
max_tokens_per_rank. Combine weights each returned row by its router weight on the token's own rank.

CPU devices go through the proxy runtime; GPUs of one host store rows straight into each other's buffers over
NVLink (kernels/nvl/low_latency.cu), with an arrival counter per sender and a deadline on every wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import (
    FLOAT_DTYPES,
    as_expert_indices,
    as_router_weights,
    axis_size,
    check,
    check_experts,
    check_topk,
)
from ._ffi import ep_call
from .fp8 import FP8_BLOCK, pack_ue8m0

# uccl_ep::Fp8Cast (kernels/fp8.hpp): rows sent as given, cast to FP8, cast with power-of-two scales.
FP8_CAST_CODES = {"none": 0, "cast": 1, "power_of_two_scales": 2}

AxisName = Union[str, Sequence[str]]


@jax.tree_util.register_pytree_node_class
class LowLatencyHandle:
    """What low_latency_combine needs from a low_latency_dispatch."""

    def __init__(
        self,
        layout: jax.Array,
        src_slot: jax.Array,
        axis_name: AxisName,
        num_experts: int,
        max_tokens_per_rank: int,
        topk: int,
        cumulative_local_expert_recv_stats: jax.Array | None = None,
    ):
        self.layout = layout  # [L, R] int32: rows of each local expert from each source rank
        # [L, R * N] int32: the row's top-k slot on its source rank (token * K + k), -1 on padding. The combine
        # sends each row back to that slot, so the source needs no routing pass of its own.
        self.src_slot = src_slot
        self.axis_name = axis_name
        self.num_experts = num_experts
        self.max_tokens_per_rank = max_tokens_per_rank
        self.topk = topk  # K of the dispatch's topk_idx
        # [L] int32: the running count passed to the dispatch plus this step's rows (None if none was passed)
        self.cumulative_local_expert_recv_stats = cumulative_local_expert_recv_stats

    @property
    def src_token(self) -> jax.Array:
        """[L, R * N] int32: the row's token index on its source rank, -1 on padding."""
        return jnp.where(self.src_slot >= 0, self.src_slot // self.topk, -1)

    def tree_flatten(self):
        return (
            (self.layout, self.src_slot, self.cumulative_local_expert_recv_stats),
            (self.axis_name, self.num_experts, self.max_tokens_per_rank, self.topk),
        )

    @classmethod
    def tree_unflatten(cls, aux, children):
        layout, src_slot, stats = children
        return cls(layout, src_slot, *aux, stats)


def _check_platform() -> None:
    if jax.devices()[0].platform not in ("cpu", "gpu"):
        raise NotImplementedError(
            f"jax_uccl_ep: low-latency mode runs on CPU devices and NVIDIA GPUs, not on {jax.devices()[0].platform}"
        )


@jax.tree_util.register_pytree_node_class
class LowLatencyPending:
    """A low-latency op whose send half ran: pass it to the matching *_recv. Between the two, compute freely but
    run no other EP op on these devices."""

    def __init__(self, token: jax.Array, static: tuple):
        self.token = token  # [1] int32: makes the receive half run after the send half
        self.static = static

    def tree_flatten(self):
        return (self.token,), self.static

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(*children, static)


def _prepare_dispatch(x, topk_idx, num_experts, max_tokens_per_rank, axis_name, use_fp8, round_scale, use_ue8m0):
    """Checks the arguments; returns the FFI calls' operands (x, scales, int32 topk_idx), fp8_cast and static."""
    _check_platform()
    topk_idx = as_expert_indices(topk_idx)
    check(hasattr(x, "ndim") and x.ndim == 2, f"x must be 2-D [tokens, hidden], got {getattr(x, 'shape', x)}")
    check(x.dtype in FLOAT_DTYPES, f"x must be float32 or bfloat16, got {x.dtype}")
    t, h = x.shape
    check_topk(topk_idx, t)
    num_ranks = axis_size(axis_name)
    check_experts(num_experts, num_ranks)
    check(
        isinstance(max_tokens_per_rank, (int, np.integer)) and max_tokens_per_rank >= t,
        f"max_tokens_per_rank must be an int >= the tokens per rank ({t}), got {max_tokens_per_rank!r}",
    )
    if use_ue8m0:
        round_scale = True
        check(h % (4 * FP8_BLOCK) == 0, f"use_ue8m0 needs hidden a multiple of {4 * FP8_BLOCK}, got {h}")
    if use_fp8:  # the dispatch casts on the way, by per_token_cast_to_fp8's rule (one pass over x, no FP8 copy)
        check(h % FP8_BLOCK == 0, f"use_fp8 needs hidden a multiple of {FP8_BLOCK}, got {h}")
        cast = "power_of_two_scales" if round_scale else "cast"
        fp8_cast, wire_dtype, scale_width = FP8_CAST_CODES[cast], jnp.float8_e4m3fn, h // FP8_BLOCK
    else:
        fp8_cast, wire_dtype, scale_width = FP8_CAST_CODES["none"], x.dtype, 0
    static = (
        "dispatch",
        axis_name,
        num_experts,
        int(max_tokens_per_rank),
        num_ranks,
        h,
        np.dtype(wire_dtype).name,
        scale_width,
        use_fp8,
        use_ue8m0,
        topk_idx.shape[1],
    )
    return (x, jnp.zeros((t, 0), jnp.float32), topk_idx), fp8_cast, static


def _dispatch_outputs(static) -> tuple:
    _, _, num_experts, n, num_ranks, h, dtype, scale_width, _, _, _ = static
    local, slab = num_experts // num_ranks, num_ranks * n
    return (
        jax.ShapeDtypeStruct((local, slab, h), jnp.dtype(dtype)),
        jax.ShapeDtypeStruct((local, slab, scale_width), jnp.float32),
        jax.ShapeDtypeStruct((local,), jnp.int32),
        jax.ShapeDtypeStruct((local, num_ranks), jnp.int32),
        jax.ShapeDtypeStruct((local, slab), jnp.int32),
    )


def _dispatch_result(static, outs, cumulative_local_expert_recv_stats):
    _, axis_name, num_experts, n, num_ranks, _, _, _, use_fp8, use_ue8m0, topk = static
    recv_x, recv_scales, recv_count, layout, src_slot = outs
    if use_fp8:
        recv_x = (recv_x, pack_ue8m0(recv_scales) if use_ue8m0 else recv_scales)
    stats = None
    if cumulative_local_expert_recv_stats is not None:
        check(
            cumulative_local_expert_recv_stats.shape == recv_count.shape,
            f"cumulative_local_expert_recv_stats must have shape {recv_count.shape} (local experts), "
            f"got {cumulative_local_expert_recv_stats.shape}",
        )
        stats = cumulative_local_expert_recv_stats + recv_count.astype(cumulative_local_expert_recv_stats.dtype)
    return recv_x, recv_count, LowLatencyHandle(layout, src_slot, axis_name, num_experts, n, topk, stats)


def low_latency_dispatch_send(
    x: jax.Array,
    topk_idx: jax.Array,
    *,
    num_experts: int,
    max_tokens_per_rank: int,
    axis_name: AxisName,
    use_fp8: bool = True,
    round_scale: bool = False,
    use_ue8m0: bool = False,
) -> LowLatencyPending:
    """The send half of low_latency_dispatch (same arguments); finish with low_latency_dispatch_recv.

    XLA may move independent ops across the halves: make the work you put between them, and the next EP op,
    depend on the data so that no other EP op lands in between (that fails with an out-of-step error).
    """
    operands, fp8_cast, static = _prepare_dispatch(
        x, topk_idx, num_experts, max_tokens_per_rank, axis_name, use_fp8, round_scale, use_ue8m0
    )
    (token,) = ep_call(
        "low_latency_dispatch_send",
        (jax.ShapeDtypeStruct((1,), jnp.int32),),
        *operands,
        axis_name=axis_name,
        num_experts=num_experts,
        max_tokens_per_rank=static[3],
        fp8_cast=fp8_cast,
    )
    return LowLatencyPending(token, static)


def low_latency_dispatch_recv(pending: LowLatencyPending, cumulative_local_expert_recv_stats: jax.Array | None = None):
    """The receive half of low_latency_dispatch: returns (recv_x, recv_count, handle) as it does."""
    static = pending.static
    check(static[0] == "dispatch", "low_latency_dispatch_recv takes what low_latency_dispatch_send returned")
    outs = ep_call(
        "low_latency_dispatch_recv",
        _dispatch_outputs(static),
        pending.token,
        axis_name=static[1],
        num_experts=static[2],
        max_tokens_per_rank=static[3],
        topk=static[10],
    )
    return _dispatch_result(static, outs, cumulative_local_expert_recv_stats)


def low_latency_dispatch(
    x: jax.Array,
    topk_idx: jax.Array,
    *,
    num_experts: int,
    max_tokens_per_rank: int,
    axis_name: AxisName,
    use_fp8: bool = True,
    round_scale: bool = False,
    use_ue8m0: bool = False,
    cumulative_local_expert_recv_stats: jax.Array | None = None,
):
    """Sends each token to each of its experts (call inside shard_map).

    Args:
      x: [T, H] bfloat16 or float32 tokens, T <= max_tokens_per_rank (H a multiple of 128 with use_fp8).
      topk_idx: [T, K] global experts (any integer dtype), -1 for an unused slot.
      num_experts: E, divisible by the axis size R. max_tokens_per_rank: N, the static row budget per source.
      use_fp8: send float8_e4m3fn rows with float32 scales per 128 channels; round_scale rounds the scales to
        powers of two; use_ue8m0 (implies round_scale) returns them packed as UE8M0 exponents, four per int32.
      cumulative_local_expert_recv_stats: optional [L] running count of rows received per local expert (load
        statistics for balancing); handle.cumulative_local_expert_recv_stats is it plus this step's recv_count.

    Returns:
      (recv_x, recv_count, handle): recv_x [L, R * N, H] (with use_fp8 a pair with scales [L, R * N, H / 128]
      float32, or [L, R * N, H / 512] int32 with use_ue8m0); recv_count [L] int32 valid rows per local expert, rows
      [0, recv_count) grouped by source rank ascending, then token. Padding rows are zeros on CPU devices; on GPUs
      they are not written (whatever the buffer held: mask with recv_count); handle.src_token is -1 there.
      To overlap other work with the transfer, call low_latency_dispatch_send and low_latency_dispatch_recv.
    """
    operands, fp8_cast, static = _prepare_dispatch(
        x, topk_idx, num_experts, max_tokens_per_rank, axis_name, use_fp8, round_scale, use_ue8m0
    )
    outs = ep_call(
        "low_latency_dispatch",
        _dispatch_outputs(static),
        *operands,
        axis_name=axis_name,
        num_experts=num_experts,
        max_tokens_per_rank=static[3],
        fp8_cast=fp8_cast,
    )
    return _dispatch_result(static, outs, cumulative_local_expert_recv_stats)


def _check_combine_send(y, handle):
    _check_platform()
    check(isinstance(handle, LowLatencyHandle), "handle must be the handle of a low_latency_dispatch")
    check(hasattr(y, "ndim") and y.ndim == 3, f"y must be [local experts, R * N, hidden], got {getattr(y, 'shape', y)}")
    check(y.dtype in FLOAT_DTYPES, f"y must be float32 or bfloat16, got {y.dtype}")
    check(
        y.shape[:2] == handle.src_slot.shape,
        f"y must have {handle.src_slot.shape} leading dims (the dispatch's layout), got {y.shape[:2]}",
    )


def _combine_routing(topk_idx, topk_weights, topk: int):
    """The receive half's routing as the kernels take it: int32 indices, float32 weights (any int and float
    dtypes in)."""
    topk_idx = as_expert_indices(topk_idx)
    check_topk(topk_idx, None)
    check(
        topk_idx.shape[1] == topk,
        f"topk_idx must be the dispatch's, with K = {topk} slots per token, got shape {topk_idx.shape}",
    )
    return topk_idx, as_router_weights(topk_weights, topk_idx)


def low_latency_combine_send(y: jax.Array, handle: LowLatencyHandle) -> LowLatencyPending:
    """The send half of low_latency_combine: y [L, R * N, H] float32 or bfloat16, rows as the dispatch laid them."""
    _check_combine_send(y, handle)
    (token,) = ep_call(
        "low_latency_combine_send",
        (jax.ShapeDtypeStruct((1,), jnp.int32),),
        y,
        handle.layout,
        handle.src_slot,
        axis_name=handle.axis_name,
        num_experts=handle.num_experts,
        max_tokens_per_rank=handle.max_tokens_per_rank,
        topk=handle.topk,
    )
    static = (
        "combine",
        handle.axis_name,
        handle.num_experts,
        handle.max_tokens_per_rank,
        y.shape[2],
        np.dtype(y.dtype).name,
        handle.topk,
    )
    return LowLatencyPending(token, static)


def low_latency_combine_recv(pending: LowLatencyPending, topk_idx: jax.Array, topk_weights: jax.Array) -> jax.Array:
    """The receive half of low_latency_combine: [T, H], weighted by topk_weights [T, K], in y's dtype."""
    kind, axis_name, num_experts, n, h, dtype, topk = pending.static
    check(kind == "combine", "low_latency_combine_recv takes what low_latency_combine_send returned")
    topk_idx, topk_weights = _combine_routing(topk_idx, topk_weights, topk)
    (out,) = ep_call(
        "low_latency_combine_recv",
        (jax.ShapeDtypeStruct((topk_idx.shape[0], h), jnp.dtype(dtype)),),
        pending.token,
        topk_idx,
        topk_weights,
        axis_name=axis_name,
        num_experts=num_experts,
        max_tokens_per_rank=n,
    )
    return out


def low_latency_combine(
    y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, handle: LowLatencyHandle
) -> jax.Array:
    """Returns expert outputs y [L, R * N, H] (rows as low_latency_dispatch laid them out) to their tokens and sums
    them weighted by topk_weights [T, K] (slots with topk_idx -1 contribute nothing), in float32; [T, H] in y's
    dtype. To overlap other work with the transfer, call low_latency_combine_send and low_latency_combine_recv."""
    _check_combine_send(y, handle)
    topk_idx, topk_weights = _combine_routing(topk_idx, topk_weights, handle.topk)
    (out,) = ep_call(
        "low_latency_combine",
        (jax.ShapeDtypeStruct((topk_idx.shape[0], y.shape[2]), y.dtype),),
        y,
        handle.layout,
        handle.src_slot,
        topk_idx,
        topk_weights,
        axis_name=handle.axis_name,
        num_experts=handle.num_experts,
        max_tokens_per_rank=handle.max_tokens_per_rank,
    )
    return out
