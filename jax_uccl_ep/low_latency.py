"""Low-latency (decode) mode: low_latency_dispatch and low_latency_combine, for use inside jax.shard_map.

Each token goes to every selected expert (one copy per expert slot) into static expert-major buffers that keep
their size from step to step: recv_x is [L, R * N, H] for L = num_experts / R local experts and N =
max_tokens_per_rank. Combine weights each returned row by its router weight on the token's own rank; or, where
the dispatch carried the router weights (``topk_weights=``), on the expert's rank, which then returns one row per
token and rank (the sum of that token's rows there) instead of one per slot.

Each op also comes in halves (``*_send``, then ``*_recv`` with the ``LowLatencyPending`` it returned), so other
work can overlap the transfer. CPU devices go through the proxy runtime; GPUs of one node store rows straight into
each other's buffers over NVLink (kernels/nvl/low_latency.cu), with an arrival counter per sender and a deadline on
every wait; GPUs across nodes run the same kernels against the proxy runtime's buffers, GPU-initiated (at most 32
ranks), else staged through the host (_plan.op_path decides).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
# recv_x of a low-latency dispatch: the rows, or with use_fp8 the pair (FP8 rows, scales)
RecvX = Union[jax.Array, tuple[jax.Array, jax.Array]]


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
        weights: jax.Array | None = None,
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
        # [L, R * N] float32: each row's router weight, 0 on padding, where the dispatch carried them (else None):
        # combine then weights and sums a token's rows here and returns one row per token and rank.
        self.weights = weights

    @property
    def src_token(self) -> jax.Array:
        """[L, R * N] int32: the row's token index on its source rank, -1 on padding."""
        return jnp.where(self.src_slot >= 0, self.src_slot // self.topk, -1)

    def tree_flatten(self):
        return (
            (self.layout, self.src_slot, self.cumulative_local_expert_recv_stats, self.weights),
            (self.axis_name, self.num_experts, self.max_tokens_per_rank, self.topk),
        )

    @classmethod
    def tree_unflatten(cls, aux, children):
        layout, src_slot, stats, weights = children
        return cls(layout, src_slot, *aux, stats, weights)


def _check_platform() -> None:
    if jax.devices()[0].platform not in ("cpu", "gpu"):
        raise NotImplementedError(
            f"jax_uccl_ep: low-latency mode runs on CPU devices and NVIDIA GPUs, not on {jax.devices()[0].platform}"
        )


@dataclass(frozen=True)
class _DispatchStatic:
    """What a low-latency dispatch's receive half needs from its send half besides the token: its shapes and
    options (static: part of the pending op's tree structure)."""

    axis_name: AxisName
    num_experts: int
    max_tokens_per_rank: int  # N
    num_ranks: int  # R
    hidden: int  # H
    wire_dtype: str  # of the rows on the wire: x's, or float8_e4m3fn with use_fp8
    scale_width: int  # FP8 scales per row (0 without use_fp8)
    use_fp8: bool
    use_ue8m0: bool
    topk: int  # K of topk_idx
    carries_weights: bool  # topk_weights travel with the rows (combine sums on the experts' ranks)


@dataclass(frozen=True)
class _CombineStatic:
    """Likewise for a low-latency combine."""

    axis_name: AxisName
    num_experts: int
    max_tokens_per_rank: int
    hidden: int
    dtype: str  # of y, and so of the output
    topk: int
    sums_on_experts: bool  # the dispatch carried the weights: a row per token and rank comes back


@jax.tree_util.register_pytree_node_class
class LowLatencyPending:
    """A low-latency op whose send half ran: pass it to the matching *_recv. Between the two, compute freely but
    run no other EP op on these devices."""

    def __init__(self, token: jax.Array, static: _DispatchStatic | _CombineStatic):
        self.token = token  # [1] int32: makes the receive half run after the send half
        self.static = static

    def tree_flatten(self):
        return (self.token,), self.static

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(*children, static)


def _prepare_dispatch(
    x: jax.Array,
    topk_idx: jax.Array,
    num_experts: int,
    max_tokens_per_rank: int,
    axis_name: AxisName,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
    topk_weights: jax.Array | None,
) -> tuple[tuple[jax.Array, ...], int, _DispatchStatic]:
    """Checks the arguments; returns the FFI calls' operands (x, scales, int32 topk_idx, float32 topk_weights or
    [T, 0]), fp8_cast and static."""
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
    if use_ue8m0 and use_fp8:  # the scales of an FP8 dispatch, packed four to an int32
        round_scale = True
        check(
            h % (4 * FP8_BLOCK) == 0,
            f"use_ue8m0 needs hidden a multiple of {4 * FP8_BLOCK}, got {h}: pass use_ue8m0=False, or use_fp8=False",
        )
    if use_fp8:  # the dispatch casts on the way, by per_token_cast_to_fp8's rule (one pass over x, no FP8 copy)
        check(h % FP8_BLOCK == 0, f"use_fp8 needs hidden a multiple of {FP8_BLOCK}, got {h}: pass use_fp8=False")
        cast = "power_of_two_scales" if round_scale else "cast"
        fp8_cast, wire_dtype, scale_width = FP8_CAST_CODES[cast], jnp.float8_e4m3fn, h // FP8_BLOCK
    else:
        fp8_cast, wire_dtype, scale_width = FP8_CAST_CODES["none"], x.dtype, 0
    static = _DispatchStatic(
        axis_name=axis_name,
        num_experts=num_experts,
        max_tokens_per_rank=int(max_tokens_per_rank),
        num_ranks=num_ranks,
        hidden=h,
        wire_dtype=np.dtype(wire_dtype).name,
        scale_width=scale_width,
        use_fp8=use_fp8,
        use_ue8m0=use_ue8m0,
        topk=topk_idx.shape[1],
        carries_weights=topk_weights is not None,
    )
    weights = jnp.zeros((t, 0), jnp.float32) if topk_weights is None else as_router_weights(topk_weights, topk_idx)
    return (x, jnp.zeros((t, 0), jnp.float32), topk_idx, weights), fp8_cast, static


def _dispatch_outputs(static: _DispatchStatic) -> tuple[jax.ShapeDtypeStruct, ...]:
    local, slab = static.num_experts // static.num_ranks, static.num_ranks * static.max_tokens_per_rank
    return (
        jax.ShapeDtypeStruct((local, slab, static.hidden), jnp.dtype(static.wire_dtype)),
        jax.ShapeDtypeStruct((local, slab, static.scale_width), jnp.float32),
        jax.ShapeDtypeStruct((local,), jnp.int32),
        jax.ShapeDtypeStruct((local, static.num_ranks), jnp.int32),
        jax.ShapeDtypeStruct((local, slab), jnp.int32),
        jax.ShapeDtypeStruct((local, slab), jnp.float32),
    )


def _dispatch_result(
    static: _DispatchStatic, outs: Sequence[jax.Array], cumulative_local_expert_recv_stats: jax.Array | None
) -> tuple[RecvX, jax.Array, LowLatencyHandle]:
    rows, recv_scales, recv_count, layout, src_slot, weights = outs
    recv_x: RecvX = rows
    if static.use_fp8:
        recv_x = (rows, pack_ue8m0(recv_scales) if static.use_ue8m0 else recv_scales)
    stats = None
    if cumulative_local_expert_recv_stats is not None:
        check(
            cumulative_local_expert_recv_stats.shape == recv_count.shape,
            f"cumulative_local_expert_recv_stats must have shape {recv_count.shape} (local experts), "
            f"got {cumulative_local_expert_recv_stats.shape}",
        )
        stats = cumulative_local_expert_recv_stats + recv_count.astype(cumulative_local_expert_recv_stats.dtype)
    handle = LowLatencyHandle(
        layout,
        src_slot,
        static.axis_name,
        static.num_experts,
        static.max_tokens_per_rank,
        static.topk,
        stats,
        weights if static.carries_weights else None,
    )
    return recv_x, recv_count, handle


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
    topk_weights: jax.Array | None = None,
) -> LowLatencyPending:
    """The send half of low_latency_dispatch (same arguments); finish with low_latency_dispatch_recv.

    XLA may move independent ops across the halves: make the work you put between them, and the next EP op,
    depend on the data so that no other EP op lands in between (that fails with an out-of-step error).
    """
    operands, fp8_cast, static = _prepare_dispatch(
        x, topk_idx, num_experts, max_tokens_per_rank, axis_name, use_fp8, round_scale, use_ue8m0, topk_weights
    )
    (token,) = ep_call(
        "low_latency_dispatch_send",
        (jax.ShapeDtypeStruct((1,), jnp.int32),),
        *operands,
        axis_name=axis_name,
        num_experts=num_experts,
        max_tokens_per_rank=static.max_tokens_per_rank,
        fp8_cast=fp8_cast,
    )
    return LowLatencyPending(token, static)


def low_latency_dispatch_recv(
    pending: LowLatencyPending, cumulative_local_expert_recv_stats: jax.Array | None = None
) -> tuple[RecvX, jax.Array, LowLatencyHandle]:
    """The receive half of low_latency_dispatch: returns (recv_x, recv_count, handle) as it does."""
    static = pending.static
    if not isinstance(static, _DispatchStatic):
        raise ValueError("jax_uccl_ep: low_latency_dispatch_recv takes what low_latency_dispatch_send returned")
    outs = ep_call(
        "low_latency_dispatch_recv",
        _dispatch_outputs(static),
        pending.token,
        axis_name=static.axis_name,
        num_experts=static.num_experts,
        max_tokens_per_rank=static.max_tokens_per_rank,
        topk=static.topk,
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
    topk_weights: jax.Array | None = None,
) -> tuple[RecvX, jax.Array, LowLatencyHandle]:
    """Sends each token to each of its experts (call inside shard_map).

    Args:
      x: [T, H] bfloat16 or float32 tokens, T <= max_tokens_per_rank (H a multiple of 128 with use_fp8).
      topk_idx: [T, K] global experts (any integer dtype), -1 for an unused slot.
      num_experts: E, divisible by the axis size R. max_tokens_per_rank: N, the static row budget per source.
      use_fp8: send float8_e4m3fn rows with float32 scales per 128 channels; round_scale rounds the scales to
        powers of two; use_ue8m0 (implies round_scale) returns them packed as UE8M0 exponents, four per int32.
      cumulative_local_expert_recv_stats: optional [L] running count of rows received per local expert (load
        statistics for balancing); handle.cumulative_local_expert_recv_stats is it plus this step's recv_count.
      topk_weights: optional [T, K] router weights, sent with the rows (handle.weights [L, R * N] has each row's):
        low_latency_combine then weights and sums a token's rows on each expert's rank and sends back one row per
        token and rank rather than one per slot (at top-8 of 256 experts on 4 ranks ~3.6 rows a token, not 8);
        call it with topk_weights=None.

    Returns:
      (recv_x, recv_count, handle): recv_x [L, R * N, H] (with use_fp8 a pair with scales [L, R * N, H / 128]
      float32, or [L, R * N, H / 512] int32 with use_ue8m0); recv_count [L] int32 valid rows per local expert, rows
      [0, recv_count) grouped by source rank ascending, then token. Padding rows are zeros on CPU devices; on GPUs
      they are not written (whatever the buffer held: mask with recv_count); handle.src_token is -1 there.
      To overlap other work with the transfer, call low_latency_dispatch_send and low_latency_dispatch_recv.
    """
    operands, fp8_cast, static = _prepare_dispatch(
        x, topk_idx, num_experts, max_tokens_per_rank, axis_name, use_fp8, round_scale, use_ue8m0, topk_weights
    )
    outs = ep_call(
        "low_latency_dispatch",
        _dispatch_outputs(static),
        *operands,
        axis_name=axis_name,
        num_experts=num_experts,
        max_tokens_per_rank=static.max_tokens_per_rank,
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


def _combine_routing(topk_idx, topk_weights, topk: int, num_experts: int, local_experts: int, sums_on_experts: bool):
    """The receive half's routing as the kernels take it: int32 indices, float32 weights (any int and float
    dtypes in). Where the experts' ranks sum a token's rows, each rank's row comes back at the token's first slot
    that names one of its experts, weighted 1: the other slots are -1."""
    topk_idx = as_expert_indices(topk_idx)
    check_topk(topk_idx, None)
    check(
        topk_idx.shape[1] == topk,
        f"topk_idx must be the dispatch's, with K = {topk} slots per token, got shape {topk_idx.shape}",
    )
    if not sums_on_experts:
        check(topk_weights is not None, "topk_weights must be given (the dispatch did not carry them)")
        return topk_idx, as_router_weights(topk_weights, topk_idx)
    check(
        topk_weights is None,
        "the dispatch carried the router weights (its topk_weights=), and combine applies those on the experts' "
        "ranks: pass topk_weights=None",
    )
    rank = jnp.where(topk_idx >= 0, topk_idx // local_experts, -1)
    earlier = jnp.tril(jnp.ones((topk, topk), bool), -1)  # [k, k']: k' before k
    repeats = ((rank[:, :, None] == rank[:, None, :]) & earlier).any(-1)
    first = (rank >= 0) & ~repeats
    # Indices outside [-1, E) stay, masked or not, so the op names them as the per-slot combine does.
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    return jnp.where(first | bad, topk_idx, -1), first.astype(jnp.float32)


def _row_weights(handle: LowLatencyHandle) -> jax.Array:
    """The combine's send-side weights: the handle's, or none ([0]: rows go back one per slot)."""
    return jnp.zeros((0,), jnp.float32) if handle.weights is None else handle.weights


def low_latency_combine_send(y: jax.Array, handle: LowLatencyHandle) -> LowLatencyPending:
    """The send half of low_latency_combine: y [L, R * N, H] float32 or bfloat16, rows as the dispatch laid them."""
    _check_combine_send(y, handle)
    (token,) = ep_call(
        "low_latency_combine_send",
        (jax.ShapeDtypeStruct((1,), jnp.int32),),
        y,
        handle.layout,
        handle.src_slot,
        _row_weights(handle),
        axis_name=handle.axis_name,
        num_experts=handle.num_experts,
        max_tokens_per_rank=handle.max_tokens_per_rank,
        topk=handle.topk,
    )
    static = _CombineStatic(
        axis_name=handle.axis_name,
        num_experts=handle.num_experts,
        max_tokens_per_rank=handle.max_tokens_per_rank,
        hidden=y.shape[2],
        dtype=np.dtype(y.dtype).name,
        topk=handle.topk,
        sums_on_experts=handle.weights is not None,
    )
    return LowLatencyPending(token, static)


def low_latency_combine_recv(
    pending: LowLatencyPending, topk_idx: jax.Array, topk_weights: jax.Array | None
) -> jax.Array:
    """The receive half of low_latency_combine: [T, H], weighted by topk_weights [T, K] (None where the dispatch
    carried them), in y's dtype."""
    static = pending.static
    if not isinstance(static, _CombineStatic):
        raise ValueError("jax_uccl_ep: low_latency_combine_recv takes what low_latency_combine_send returned")
    local = static.num_experts // axis_size(static.axis_name)
    topk_idx, topk_weights = _combine_routing(
        topk_idx, topk_weights, static.topk, static.num_experts, local, static.sums_on_experts
    )
    (out,) = ep_call(
        "low_latency_combine_recv",
        (jax.ShapeDtypeStruct((topk_idx.shape[0], static.hidden), jnp.dtype(static.dtype)),),
        pending.token,
        topk_idx,
        topk_weights,
        axis_name=static.axis_name,
        num_experts=static.num_experts,
        max_tokens_per_rank=static.max_tokens_per_rank,
    )
    return out


def low_latency_combine(
    y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array | None, handle: LowLatencyHandle
) -> jax.Array:
    """Returns expert outputs y [L, R * N, H] (rows as low_latency_dispatch laid them out) to their tokens and sums
    them weighted by topk_weights [T, K] (slots with topk_idx -1 contribute nothing), in float32; [T, H] in y's
    dtype. Where the dispatch carried the weights (its topk_weights=), pass None: each expert's rank weights and
    sums a token's rows in float32 and sends the sum back in y's dtype, one row per token and rank, and the token's
    rank adds those in float32. To overlap other work with the transfer, call low_latency_combine_send and
    low_latency_combine_recv."""
    _check_combine_send(y, handle)
    local = handle.num_experts // axis_size(handle.axis_name)
    topk_idx, topk_weights = _combine_routing(
        topk_idx, topk_weights, handle.topk, handle.num_experts, local, handle.weights is not None
    )
    (out,) = ep_call(
        "low_latency_combine",
        (jax.ShapeDtypeStruct((topk_idx.shape[0], y.shape[2]), y.dtype),),
        y,
        handle.layout,
        handle.src_slot,
        _row_weights(handle),
        topk_idx,
        topk_weights,
        axis_name=handle.axis_name,
        num_experts=handle.num_experts,
        max_tokens_per_rank=handle.max_tokens_per_rank,
    )
    return out
