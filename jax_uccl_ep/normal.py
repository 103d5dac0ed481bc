"""Normal (high-throughput) mode: get_dispatch_layout, dispatch and combine, for use inside jax.shard_map.

Rank r of an EP axis of size R owns experts [r*E/R, (r+1)*E/R). Dispatch sends each token once to every rank
that owns one of its top-k experts; combine sends the rows back and sums them into the token's slot.

Two-level routing (GPUs on several nodes, an EP axis over every rank of the job; _plan.TwoLevel): a dispatch is
two dispatches. Across nodes first, among the ranks with the same index on their nodes: node n owns experts
[n*E/N, (n+1)*E/N), so a token crosses the network once per node that needs it, and arrives with its expert indices
local to that node. Then within the node (NVLink), by those indices. A combine runs the two in reverse: the node's
rows of a token are summed within the node, then cross back once. Rows then arrive grouped by the node rank that
forwarded them (the sender's index on its node), then by source node, then by token.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Literal, NamedTuple, Union, cast, overload

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, _pairs, _plan
from ._checks import (
    FLOAT_DTYPES,
    ROW_DTYPES,
    as_expert_indices,
    as_router_weights,
    axis_size,
    check,
    check_experts,
    flatten_tokens,
    summed_row_dtype,
)
from ._ffi import ep_call
from .fp8 import FP8_BLOCK, dispatch_row_bytes, per_token_cast_back, per_token_cast_to_fp8

AxisName = Union[str, Sequence[str]]
Fp8Pair = tuple  # (x_fp8 [T, H] float8_e4m3fn, scales [T, H // 128] float32)
Overflow = Literal["error", "drop"]
Layout = Literal["token", "expert"]
_OVERFLOW_CODES = {"error": 0, "drop": 1}  # uccl_ep::Overflow (kernels/contract.hpp)


class DispatchLayout(NamedTuple):
    """Routing counts of this rank's tokens (no communication)."""

    num_tokens_per_rank: jax.Array  # [R] int32: tokens sent to each rank
    num_tokens_per_expert: jax.Array  # [num_experts] int32: top-k slots per expert
    is_token_in_rank: jax.Array  # [T, R] bool


@jax.tree_util.register_pytree_node_class
class DispatchHandle:
    """What combine (and the backward passes) need from a dispatch: two arrays and the EP axis."""

    def __init__(
        self,
        is_token_in_rank: jax.Array,
        recv_counts: jax.Array,
        axis_name: AxisName,
        level: str | None = None,
        token_shape: tuple[int, ...] | None = None,
        overflow: Overflow = "error",
        capacity: int | None = None,
    ):
        self.is_token_in_rank = is_token_in_rank  # [T, R] bool: where this rank's tokens went
        self.recv_counts = recv_counts  # [R] int32: rows each rank sent here, in row order (dropped ones included)
        self.axis_name = axis_name
        self.level = level  # None (the whole axis), or a level of two-level routing ("node", "across")
        self.token_shape = token_shape  # the leading dimensions of dispatch's x (combine restores them)
        self.overflow = overflow  # the dispatch's policy: under "drop", rows past the capacity come back as zeros
        self.capacity = capacity  # the dispatch's output rows (combine's y must have them under "drop")

    def tree_flatten(self):
        aux = (self.axis_name, self.level, self.token_shape, self.overflow, self.capacity)
        return (self.is_token_in_rank, self.recv_counts), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def __repr__(self) -> str:
        level = "" if self.level is None else f", level={self.level!r}"
        drop = ", overflow='drop'" if self.overflow == "drop" else ""
        return (
            f"DispatchHandle(axis_name={self.axis_name!r}{level}{drop}, is_token_in_rank={self.is_token_in_rank!r}, "
            f"recv_counts={self.recv_counts!r})"
        )


@jax.tree_util.register_pytree_node_class
class TwoLevelHandle:
    """A dispatch handle under two-level routing: the dispatch across nodes (its rows are the tokens the node
    level forwards), then the one within the node."""

    def __init__(self, across: DispatchHandle, within: DispatchHandle, token_shape: tuple[int, ...] | None = None):
        self.across = across  # over the ranks with this rank's index on every node
        self.within = within  # over this node's ranks
        self.token_shape = token_shape  # the leading dimensions of dispatch's x (combine restores them)

    @property
    def axis_name(self) -> AxisName:
        return self.within.axis_name

    def tree_flatten(self):
        return (self.across, self.within), self.token_shape

    @classmethod
    def tree_unflatten(cls, token_shape, children):
        return cls(*children, token_shape)

    def __repr__(self) -> str:
        return f"TwoLevelHandle(across={self.across!r}, within={self.within!r})"


RowHandle = Union[DispatchHandle, TwoLevelHandle]  # a dispatch of token rows (layout="token")


@jax.tree_util.register_pytree_node_class
class ExpertHandle:
    """A dispatch handle of the expert-major layout: the rows' handle and where each row's pairs sit."""

    def __init__(self, rows: RowHandle, pair_row: jax.Array, pair_of: jax.Array, zero_padding: bool = True):
        self.rows = rows  # the handle of the rows as they arrived (one per token and rank)
        self.pair_row = pair_row  # [M] int32: the received row of each pair slot (C outside the groups)
        self.pair_of = pair_of  # [C, K] int32: the pair slot of each received row's top-k slot (M for none)
        self.zero_padding = zero_padding  # dispatch's: combine's cotangent outside the groups is zeros, or unwritten

    @property
    def axis_name(self) -> AxisName:
        return self.rows.axis_name

    @property
    def token_shape(self) -> tuple[int, ...] | None:
        return self.rows.token_shape

    def with_rows(self, rows: RowHandle) -> ExpertHandle:
        """The same pairs over another handle of their rows."""
        return ExpertHandle(rows, self.pair_row, self.pair_of, self.zero_padding)

    def tree_flatten(self):
        return (self.rows, self.pair_row, self.pair_of), self.zero_padding

    @classmethod
    def tree_unflatten(cls, zero_padding, children):
        return cls(*children, zero_padding)

    def __repr__(self) -> str:
        return (
            f"ExpertHandle(rows={self.rows!r}, pair_row={self.pair_row!r}, pair_of={self.pair_of!r}, "
            f"zero_padding={self.zero_padding})"
        )


Handle = Union[DispatchHandle, TwoLevelHandle, ExpertHandle]


class DispatchResult(NamedTuple):
    """Output of dispatch. Rows [num_tokens, capacity) are padding (zeros, topk_idx -1)."""

    x: jax.Array | Fp8Pair  # [capacity, H] (or the FP8 pair), by source rank then source token (two-level: by
    # forwarding node rank, source node, token)
    topk_idx: jax.Array  # [capacity, K] int32: local expert index or -1
    topk_weights: jax.Array | None  # [capacity, K] float32, 0 where topk_idx is -1
    num_tokens: jax.Array  # int32 scalar: valid rows
    num_tokens_per_expert: jax.Array  # [num_experts / R] int32, of the rows kept
    handle: RowHandle
    num_dropped: jax.Array  # int32 scalar: rows that arrived past the capacity and were dropped (overflow="drop")


class ExpertDispatchResult(NamedTuple):
    """Output of dispatch(layout="expert"): one row per (received token, local expert) pair, grouped by expert.

    Local expert e's rows are ``x[expert_offsets[e] : expert_offsets[e] + num_tokens_per_expert[e]]``, in the
    received order (source rank, then source token; two-level: the two-level order). Rows outside the groups
    (alignment padding and the tail) have weight 0, and are zeros unless dispatch's zero_padding was False."""

    x: jax.Array | Fp8Pair  # [M, H] (or the FP8 pair [M, H], [M, H // 128])
    weights: jax.Array | None  # [M] float32: each pair row's router weight, 0 outside the groups (None without)
    expert_offsets: jax.Array  # [E / R] int32: first row of each local expert, a multiple of expert_alignment
    num_tokens_per_expert: jax.Array  # [E / R] int32: pair rows of each local expert
    num_tokens: jax.Array  # int32 scalar: tokens received whose pairs were kept
    num_dropped: jax.Array  # int32 scalar: pairs that did not fit in M (overflow="drop")
    handle: ExpertHandle


def get_dispatch_layout(topk_idx: jax.Array, *, num_experts: int, axis_name: AxisName) -> DispatchLayout:
    """Counts tokens per rank and per expert and the token-in-rank mask for `topk_idx` [..., K] (any integer dtype,
    -1 = none; the leading dimensions are the tokens, and is_token_in_rank keeps them: [..., R]).

    An index outside [-1, num_experts) raises at run time on CPU devices; on GPUs its slot is skipped and
    check_errors() raises it.
    """
    num_ranks = axis_size(axis_name)
    topk_idx, lead = flatten_tokens(as_expert_indices(topk_idx))
    check_experts(num_experts, num_ranks)
    t = topk_idx.shape[0]
    outs = ep_call(
        "layout",
        (
            jax.ShapeDtypeStruct((num_ranks,), jnp.int32),
            jax.ShapeDtypeStruct((num_experts,), jnp.int32),
            jax.ShapeDtypeStruct((t, num_ranks), jnp.bool_),
        ),
        topk_idx,
        varying_over=_ffi.axes_of(axis_name),
        ordered=False,  # local: no peers involved
        num_experts=num_experts,
        num_ranks=num_ranks,
    )
    per_rank, per_expert, in_rank = outs
    return DispatchLayout(per_rank, per_expert, in_rank.reshape((*lead, num_ranks)))


def _split_x(x: jax.Array | Fp8Pair) -> tuple[jax.Array, jax.Array, bool]:
    """Returns (rows, scales or a zero-width array, is_fp8) after checking shapes and dtypes."""
    if isinstance(x, (tuple, list)):
        check(len(x) == 2, "an FP8 x must be a pair (x_fp8, scales)")
        x_fp8, scales = x
        check(x_fp8.ndim == 2, f"x_fp8 must be 2-D [tokens, hidden], got shape {x_fp8.shape}")
        check(x_fp8.dtype == jnp.float8_e4m3fn, f"x_fp8 must be float8_e4m3fn, got {x_fp8.dtype}")
        t, h = x_fp8.shape
        check(h % FP8_BLOCK == 0, f"FP8 hidden size must be a multiple of {FP8_BLOCK}, got {h}")
        check(
            scales.shape == (t, h // FP8_BLOCK),
            f"scales must have shape {(t, h // FP8_BLOCK)} for x_fp8 {x_fp8.shape}, got {scales.shape}",
        )
        check(scales.dtype == jnp.float32, f"scales must be float32, got {scales.dtype}")
        return x_fp8, scales, True
    check(hasattr(x, "ndim") and x.ndim == 2, f"x must be 2-D [tokens, hidden], got shape {getattr(x, 'shape', x)}")
    check(x.dtype in ROW_DTYPES, f"x must be float32, bfloat16 or float16 (or an FP8 pair), got {x.dtype}")
    return x, jnp.zeros((x.shape[0], 0), jnp.float32), False


def _two_level_plan(axis_name: AxisName):
    """The runtime's two-level plan if it applies to this axis (one over every rank of the job), else None."""
    plan = _plan.two_level()
    return plan if plan is not None and axis_size(axis_name) == plan.num_ranks else None


_LEVEL_CODES = {None: 0, "node": 1, "across": 2}  # uccl_ep::Level (kernels/contract.hpp): flat, node, across


def _level_args(level: str | None) -> dict:
    """An FFI call's arguments for a level: the lowering's level with the plan it was traced under (the lowering
    refuses another), and the handlers' two_level attribute (CPU handlers abort the whole job when a level fails)."""
    if level is None:
        return dict(level=None, two_level=0)
    plan = _plan.two_level()
    if plan is None:  # a level op is traced only under a two-level plan
        raise RuntimeError(f"jax_uccl_ep: an op of level {level!r} but the runtime routes in one level")
    return dict(level=(level, plan.num_nodes, plan.per_node), two_level=_LEVEL_CODES[level])


def _level_size(axis_name: AxisName, level: str | None) -> int:
    if level is None:
        return axis_size(axis_name)
    plan = _two_level_plan(axis_name)
    return plan.per_node if level == "node" else plan.num_nodes


def _dispatch_level(x, topk_idx, topk_weights, num_experts, axis_name, capacity, overflow, level=None):
    """One dispatch over the axis, or over one level of two-level routing."""
    rows, scales, is_fp8 = _split_x(x)
    t, h = rows.shape
    k = topk_idx.shape[1]
    num_ranks = _level_size(axis_name, level)
    weights = topk_weights if topk_weights is not None else jnp.zeros((t, 0), jnp.float32)
    outs = ep_call(
        "dispatch",
        (
            jax.ShapeDtypeStruct((capacity, h), rows.dtype),
            jax.ShapeDtypeStruct((capacity, scales.shape[1]), jnp.float32),
            jax.ShapeDtypeStruct((capacity, k), jnp.int32),
            jax.ShapeDtypeStruct((capacity, weights.shape[1]), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((num_experts // num_ranks,), jnp.int32),
            jax.ShapeDtypeStruct((t, num_ranks), jnp.bool_),
            jax.ShapeDtypeStruct((num_ranks,), jnp.int32),
        ),
        rows,
        scales,
        topk_idx,
        weights,
        axis_name=axis_name,
        num_experts=num_experts,
        overflow=_OVERFLOW_CODES[overflow],
        **_level_args(level),
    )
    recv_x, recv_scales, recv_idx, recv_w, n, per_expert, in_rank, counts = outs
    return DispatchResult(
        x=(recv_x, recv_scales) if is_fp8 else recv_x,
        topk_idx=recv_idx,
        topk_weights=recv_w if topk_weights is not None else None,
        num_tokens=n,
        num_tokens_per_expert=per_expert,
        handle=DispatchHandle(in_rank, counts, axis_name, level, overflow=overflow, capacity=capacity),
        num_dropped=jnp.sum(counts) - n,
    )


def _in_levels(node_level, x, topk_idx, topk_weights, num_experts: int, axis_name: AxisName):
    """A dispatch over the axis: ``node_level(x, topk_idx, topk_weights, num_experts, level)`` over the whole axis
    (level None), or under two-level routing over the node level (level "node") after the level across nodes, with
    a handle of both levels."""
    plan = _two_level_plan(axis_name)
    if plan is None:
        return node_level(x, topk_idx, topk_weights, num_experts, None)
    # Across nodes: node n owns experts [n*E/N, (n+1)*E/N); its rows come back with node-local indices (or -1)
    # and padding rows with -1 everywhere, so the node level forwards exactly the valid rows. That level's
    # capacity holds every row a node can get; only the node level applies the user's.
    t = topk_idx.shape[0]
    across = _dispatch_level(x, topk_idx, topk_weights, num_experts, axis_name, plan.num_nodes * t, "error", "across")
    within = node_level(across.x, across.topk_idx, across.topk_weights, num_experts // plan.num_nodes, "node")
    handle = within.handle  # of the node level: its rows' handle is one level's
    if isinstance(handle, ExpertHandle):
        rows = TwoLevelHandle(across.handle, cast(DispatchHandle, handle.rows))
        return within._replace(handle=handle.with_rows(rows))
    return within._replace(handle=TwoLevelHandle(across.handle, cast(DispatchHandle, handle)))


def _dispatch_call(x, topk_idx, topk_weights, num_experts, axis_name, capacity, overflow):
    def level(x, topk_idx, topk_weights, num_experts, level):
        return _dispatch_level(x, topk_idx, topk_weights, num_experts, axis_name, capacity, overflow, level)

    return _in_levels(level, x, topk_idx, topk_weights, num_experts, axis_name)


def _combine_call(
    y: jax.Array, handle: Handle, after: jax.Array | None = None, pair_of: jax.Array | None = None
) -> jax.Array:
    """combine's op along `handle`. With an ExpertHandle (its pairs written by the receive) or `pair_of` ([C, K]
    slots of the rows a dispatch received, passed on to the node level under two-level routing), y holds pair rows
    and each received row's pairs are summed in float32 on its way back (combine_pairs)."""
    if isinstance(handle, ExpertHandle):
        if _plan.receive_writes_pairs():  # the host paths' pair ops sum each received row's pairs
            return _combine_call(y, handle.rows, after, handle.pair_of)
        # Pairs a GPU path laid out (its receive or after it): summed on the GPU, then the rows go back.
        return _combine_call(_summed_pairs(y, handle), handle.rows, after).astype(y.dtype)
    if y.dtype not in FLOAT_DTYPES:  # float16: the kernels sum float32 and bfloat16 rows
        return _combine_call(y.astype(jnp.float32), handle, after, pair_of).astype(y.dtype)
    if isinstance(handle, TwoLevelHandle):
        # Sum within the node, then cross back once.
        return _combine_call(_combine_call(y, handle.within, after, pair_of), handle.across)
    t = handle.is_token_in_rank.shape[0]
    (out,) = ep_call(
        "combine" if pair_of is None else "combine_pairs",
        (jax.ShapeDtypeStruct((t, y.shape[1]), y.dtype),),
        *([y] if pair_of is None else [y, pair_of]),
        handle.is_token_in_rank,
        handle.recv_counts,
        axis_name=handle.axis_name,
        after=after,
        overflow=_OVERFLOW_CODES[handle.overflow],
        **_level_args(handle.level),
    )
    return out


def _cached_dispatch_call(
    x: jax.Array,
    handle: Handle,
    capacity: int,
    after: jax.Array | None = None,
    pairs: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """cached_dispatch's op along `handle` into `capacity` rows (those its dispatch received). With an ExpertHandle
    (its pairs written by the receive) or `pairs` (its pair_row [M] and pair_of [C, K], passed on to the node level
    under two-level routing), each received row is written to its pair slots instead: [M, H]
    (cached_dispatch_pairs)."""
    if isinstance(handle, ExpertHandle):
        return _cached_dispatch_call(x, handle.rows, capacity, after, (handle.pair_row, handle.pair_of))
    if isinstance(handle, TwoLevelHandle):
        forwarded = handle.within.is_token_in_rank.shape[0]  # rows the dispatch across nodes delivered
        across = _cached_dispatch_call(x, handle.across, forwarded, after=after)
        return _cached_dispatch_call(across, handle.within, capacity, pairs=pairs)
    rows = capacity if pairs is None else pairs[0].shape[0]
    (out,) = ep_call(
        "cached_dispatch" if pairs is None else "cached_dispatch_pairs",
        (jax.ShapeDtypeStruct((rows, x.shape[1]), x.dtype),),
        *([x] if pairs is None else [x, *pairs]),
        handle.is_token_in_rank,
        handle.recv_counts,
        axis_name=handle.axis_name,
        after=after,
        overflow=_OVERFLOW_CODES[handle.overflow],
        **_level_args(handle.level),
    )
    return out


def _no_cotangent(handle: RowHandle) -> RowHandle:
    """The handle's cotangent: its structure with None (no cotangent) for each of its arrays."""
    return jax.tree.map(lambda _: None, handle)


def _dispatch_bwd(num_experts, axis_name, capacity, overflow, residuals, g):
    handle, recv_idx = residuals
    dx = _combine_call(g.x, handle)  # the VJP of dispatch is a combine
    dw = None
    if g.topk_weights is not None:
        # Only the owner of a slot received its weight; elsewhere the output is a constant 0.
        owned = jnp.where(recv_idx >= 0, g.topk_weights, 0.0).astype(jnp.float32)
        dw = _combine_call(owned, handle, after=dx)  # independent of dx: chain it, or ranks may disagree on order
    return dx, None, dw


def _over_fp8_wire(call):
    """`call` (a dispatch's call, x first) with x's rows cast to FP8 with per-128-channel scales, dispatched as FP8,
    and cast back to x's dtype on arrival."""

    def wire(x, *args):
        out = call(per_token_cast_to_fp8(x), *args)
        rows, scales = out.x
        return out._replace(x=per_token_cast_back(rows, scales, dtype=x.dtype))

    return wire


def _differentiable(forward, residuals_of, backward, num_static: int):
    """`forward` (a dispatch's call: x, topk_idx, topk_weights, then `num_static` static arguments) with the VJP
    `backward(*static, residuals_of(output), cotangent)`: a combine of the rows' cotangent in their dtype (for the
    FP8 wire the casts taken as the identity, as FP8 training does)."""

    @partial(jax.custom_vjp, nondiff_argnums=tuple(range(3, 3 + num_static)))
    def op(x, topk_idx, topk_weights, *static):
        return forward(x, topk_idx, topk_weights, *static)

    def fwd(x, topk_idx, topk_weights, *static):
        out = forward(x, topk_idx, topk_weights, *static)
        return out, residuals_of(out)

    op.defvjp(fwd, backward)
    return op


def _rows_residuals(out: DispatchResult):
    return out.handle, out.topk_idx


_dispatch = _differentiable(_dispatch_call, _rows_residuals, _dispatch_bwd, 4)
_dispatch_fp8_wire = _differentiable(_over_fp8_wire(_dispatch_call), _rows_residuals, _dispatch_bwd, 4)


@overload
def dispatch(
    x: jax.Array | Fp8Pair,
    topk_idx: jax.Array,
    topk_weights: jax.Array | None = None,
    *,
    num_experts: int,
    axis_name: AxisName,
    capacity: int | None = None,
    overflow: Overflow = "error",
    use_fp8: bool = False,
    layout: Literal["token"] = "token",
    expert_alignment: int = 1,
    zero_padding: bool = True,
) -> DispatchResult: ...


@overload
def dispatch(
    x: jax.Array | Fp8Pair,
    topk_idx: jax.Array,
    topk_weights: jax.Array | None = None,
    *,
    num_experts: int,
    axis_name: AxisName,
    capacity: int | None = None,
    overflow: Overflow = "error",
    use_fp8: bool = False,
    layout: Literal["expert"],
    expert_alignment: int = 1,
    zero_padding: bool = True,
) -> ExpertDispatchResult: ...


def dispatch(
    x: jax.Array | Fp8Pair,
    topk_idx: jax.Array,
    topk_weights: jax.Array | None = None,
    *,
    num_experts: int,
    axis_name: AxisName,
    capacity: int | None = None,
    overflow: Overflow = "error",
    use_fp8: bool = False,
    layout: Layout = "token",
    expert_alignment: int = 1,
    zero_padding: bool = True,
) -> DispatchResult | ExpertDispatchResult:
    """Sends each token to every rank of `axis_name` that owns one of its experts (call inside shard_map).

    Args:
      x: [..., H] float32, bfloat16 or float16 rows (the leading dimensions are the tokens, e.g. [batch, seq]), or
        an FP8 pair (x_fp8 [..., H] float8_e4m3fn, scales [..., H // 128] float32).
      topk_idx: [..., K] global expert indices of any integer dtype, -1 for an unused slot.
      topk_weights: optional [..., K] router weights of any float dtype, forwarded with the rows (carried in
        float32, returned in their own dtype).
      num_experts: total experts E; must be divisible by the axis size R.
      axis_name: the EP mesh axis.
      capacity: output rows (tokens) per rank; defaults to R * T, which never overflows.
      overflow: what happens to rows past `capacity` on a rank. Either way the rank keeps its first `capacity`
        rows in row order (by source rank, then source token), so which rows go is deterministic.
        "error": the op fails with an error naming the rank, the count and the capacity. On CPU devices (and
        host-staged GPU ops) every rank raises it in the same op and the runtime stays usable; GPU kernels cannot
        fail their call, so there the rows are dropped and `check_errors()` raises it, naming the rank, in every
        process of the group (under two-level routing: of the node whose rank overflowed). "drop": dropping is
        intended: `num_dropped` counts the rows, their tokens get no contribution from this rank's experts
        (combine returns zeros for them, and no gradient flows through them), and nothing is raised.
      use_fp8: x (float32, bfloat16 or float16, H a multiple of 128) travels as FP8 with a float32 scale per 128
        channels (half BF16's bytes) and arrives cast back to x's dtype. Differentiable: the backward pass is a
        combine in x's dtype (the casts taken as the identity, as FP8 training does). An FP8 pair passed as x
        instead arrives as a pair and has no gradient.
      layout: "token" (rows): one row per received token, as below. "expert" (pairs, the grouped matmul's
        layout): an ExpertDispatchResult of one row per (received token, local expert) pair, each local expert's
        rows together from an offset that is a multiple of `expert_alignment`, in the received order within the
        expert. `capacity` then counts pair rows M (default R * T * min(K, E / R) + (alignment - 1) * E / R,
        which never drops when a token names each expert once); under overflow="drop" the rows past the first
        ones whose pairs fit lose all their pairs (num_dropped counts pairs), under "error" every rank raises,
        naming the rank that overflowed. combine() takes the pair rows back and sums each token's pairs.
      expert_alignment: with layout="expert", the multiple every expert's first row sits at (e.g. a grouped
        matmul's tile rows; padding rows are zeros with weight 0).
      zero_padding: with layout="expert", whether the pair rows outside the groups (alignment padding and the
        tail) are written as zeros. False leaves them as the op found them (any value, NaN included), and the
        cotangent combine's VJP gives those rows too, which saves writing most of a worst-case buffer each way;
        read only the groups' rows then, as grouped_matmul and combine do (their weights are 0 either way; a
        grouped matmul over aligned groups that take their padding in would read it). The MoE layer passes False.

    Returns:
      A DispatchResult of 2-D rows [capacity, ...], ordered by source rank, then source token index (the leading
      dimensions flattened in order). Under two-level routing (GPUs on several nodes, see the module's docstring)
      by the rank of this node that forwarded them, then source node, then source token; `handle` is then a
      TwoLevelHandle. combine() gives back x's leading dimensions.
    """
    if isinstance(x, (tuple, list)):
        check(len(x) == 2, "an FP8 x must be a pair (x_fp8, scales)")
        (x_fp8, lead), (scales, _) = flatten_tokens(x[0]), flatten_tokens(x[1])
        x = (x_fp8, scales)
    else:
        x, lead = flatten_tokens(x)
    rows, _, is_fp8 = _split_x(x)
    t = rows.shape[0]
    check(t >= 1, "x must hold at least one token")
    idx = as_expert_indices(topk_idx)
    check(
        tuple(idx.shape[:-1]) == lead,
        f"topk_idx must be [..., K] with x's leading dimensions {lead}, got shape {idx.shape}",
    )
    idx = idx.reshape(t, -1)
    weights = None
    if topk_weights is not None:
        weights = as_router_weights(topk_weights, topk_idx).reshape(t, -1)
    num_ranks = axis_size(axis_name)
    check_experts(num_experts, num_ranks)
    check(layout in ("token", "expert"), f"layout must be 'token' or 'expert', got {layout!r}")
    check(
        isinstance(expert_alignment, (int, np.integer)) and expert_alignment >= 1,
        f"expert_alignment must be a positive int (rows), got {expert_alignment!r}",
    )
    pair_capacity = None
    if layout == "expert":
        check(
            capacity is None or (isinstance(capacity, (int, np.integer)) and capacity >= 1),
            f"capacity must be a positive int (pair rows), got {capacity!r}",
        )
        groups = num_experts // num_ranks
        pair_capacity = capacity or _pairs.never_dropping_pairs(num_ranks * t, idx.shape[1], groups, expert_alignment)
        capacity = None  # the rows themselves never drop: the pair buffer decides
    if capacity is None:
        capacity = num_ranks * t
    check(
        isinstance(capacity, (int, np.integer)) and capacity >= 1,
        f"capacity must be a positive int (tokens), got {capacity!r}",
    )
    check(overflow in _OVERFLOW_CODES, f"overflow must be 'error' or 'drop', got {overflow!r}")
    check(isinstance(zero_padding, (bool, np.bool_)), f"zero_padding must be a bool, got {zero_padding!r}")
    zero_padding = bool(zero_padding)  # a Python bool from here on: static data of the ops and the handle
    if use_fp8:
        check(not is_fp8, "use_fp8 casts x itself: pass the unquantized rows, not an FP8 pair")
        check(
            rows.shape[1] % FP8_BLOCK == 0,
            f"use_fp8 needs hidden a multiple of {FP8_BLOCK}, got {rows.shape[1]}: pass use_fp8=False (the layer: "
            "MoEConfig(fp8_dispatch=False))",
        )
    if pair_capacity is not None and _receive_writes_pairs(
        x, use_fp8, idx.shape[1], num_experts // num_ranks, expert_alignment, pair_capacity, num_ranks * t
    ):
        call = _dispatch_pairs_call if is_fp8 else _dispatch_pairs_fp8_wire if use_fp8 else _dispatch_pairs
        res = call(
            x, idx, weights, num_experts, axis_name, int(pair_capacity), expert_alignment, overflow, zero_padding
        )
        return res._replace(handle=_with_token_shape(res.handle, lead))
    call = _dispatch_call if is_fp8 else _dispatch_fp8_wire if use_fp8 else _dispatch
    row_overflow = "error" if layout == "expert" else overflow  # R * T rows: never reached
    out = call(x, idx, weights, num_experts, axis_name, int(capacity), row_overflow)
    out = out._replace(handle=_with_token_shape(out.handle, lead))
    if pair_capacity is not None:
        return _by_expert(
            out, num_experts // num_ranks, expert_alignment, int(pair_capacity), overflow, axis_name, zero_padding
        )
    if topk_weights is not None and topk_weights.dtype != jnp.float32:
        out = out._replace(topk_weights=out.topk_weights.astype(topk_weights.dtype))
    return out


def _receive_writes_pairs(
    x: jax.Array | Fp8Pair, use_fp8: bool, top_k: int, groups: int, alignment: int, capacity: int, group_rows: int
) -> bool:
    """Whether this dispatch(layout="expert")'s receive writes the pair buffer (the dispatch_pairs op): on the host
    paths always, on a GPU path where _plan.gpu_writes_pairs allows (`group_rows`: every row the group can send);
    else token rows, then _by_expert."""
    if _plan.receive_writes_pairs():
        return True
    rows, _, is_fp8 = _split_x(x)
    row_bytes, scale_row_bytes = dispatch_row_bytes(rows.shape[1], is_fp8 or use_fp8, rows.dtype)
    every_slot = _pairs.every_slot_pairs(group_rows, top_k, groups, alignment)
    return _plan.gpu_writes_pairs(groups, top_k, capacity, every_slot, row_bytes, scale_row_bytes)


def _by_expert(
    out: DispatchResult,
    groups: int,
    alignment: int,
    capacity: int,
    overflow: Overflow,
    axis_name: AxisName,
    zero_padding: bool,
) -> ExpertDispatchResult:
    """The received rows laid out as pair rows (see _pairs); without `zero_padding` the rows outside the groups are
    left unwritten."""
    rows, top_k = out.topk_idx.shape
    with jax.named_scope(_pairs.SCOPE):
        layout = _pairs.pair_layout(out.topk_idx, out.num_tokens, groups, alignment, capacity)
        if overflow == "error" and capacity < _pairs.every_slot_pairs(rows, top_k, groups, alignment):
            # The pair rows depend on the check, so it runs whenever they are used.
            zero = _raise_if_any_rank_overflows(layout.pairs_needed, capacity, axis_name)
            layout = layout._replace(pair_row=layout.pair_row + zero)

        def expand(rows):
            return _pairs.expand(rows, layout.pair_row, layout.pair_of, zero_padding)

        x = tuple(map(expand, out.x)) if isinstance(out.x, tuple) else expand(out.x)
        weights = None
        if out.topk_weights is not None:
            weights = _pairs.pair_weights(out.topk_weights, layout.pair_index, layout.pair_of)
    return ExpertDispatchResult(
        x=x,
        weights=weights,
        expert_offsets=layout.expert_offsets,
        num_tokens_per_expert=layout.num_tokens_per_expert,
        num_tokens=layout.rows_kept,
        num_dropped=layout.pairs_dropped,
        handle=ExpertHandle(out.handle, layout.pair_row, layout.pair_of, zero_padding),
    )


def _dispatch_pairs_level(
    x, topk_idx, topk_weights, num_experts, axis_name, capacity, alignment, overflow, zero_padding, level=None
):
    """One dispatch_pairs op (the receive writes the pair buffer) over the axis, or the node level of two-level
    routing. The C received rows it indexes are every row the level's group can send (level size x tokens)."""
    rows, scales, is_fp8 = _split_x(x)
    t, h = rows.shape
    k = topk_idx.shape[1]
    num_ranks = _level_size(axis_name, level)
    groups = num_experts // num_ranks
    weights = topk_weights if topk_weights is not None else jnp.zeros((t, 0), jnp.float32)
    outs = ep_call(
        "dispatch_pairs",
        (
            jax.ShapeDtypeStruct((capacity, h), rows.dtype),
            jax.ShapeDtypeStruct((capacity, scales.shape[1]), jnp.float32),
            jax.ShapeDtypeStruct((capacity if topk_weights is not None else 0,), jnp.float32),
            jax.ShapeDtypeStruct((groups,), jnp.int32),
            jax.ShapeDtypeStruct((groups,), jnp.int32),
            jax.ShapeDtypeStruct((capacity,), jnp.int32),
            jax.ShapeDtypeStruct((num_ranks * t, k), jnp.int32),
            jax.ShapeDtypeStruct((3,), jnp.int32),
            jax.ShapeDtypeStruct((t, num_ranks), jnp.bool_),
            jax.ShapeDtypeStruct((num_ranks,), jnp.int32),
        ),
        rows,
        scales,
        topk_idx,
        weights,
        axis_name=axis_name,
        num_experts=num_experts,
        overflow=_OVERFLOW_CODES[overflow],
        expert_alignment=alignment,
        zero_padding=int(zero_padding),
        **_level_args(level),
    )
    pair_x, pair_scales, pair_w, offsets, per_expert, pair_row, pair_of, stats, in_rank, counts = outs
    return ExpertDispatchResult(
        x=(pair_x, pair_scales) if is_fp8 else pair_x,
        weights=pair_w if topk_weights is not None else None,
        expert_offsets=offsets,
        num_tokens_per_expert=per_expert,
        num_tokens=stats[0],
        num_dropped=stats[1],
        handle=ExpertHandle(
            DispatchHandle(in_rank, counts, axis_name, level, overflow="error"), pair_row, pair_of, zero_padding
        ),
    )


def _dispatch_pairs_call(
    x, topk_idx, topk_weights, num_experts, axis_name, capacity, alignment, overflow, zero_padding
):
    def level(x, topk_idx, topk_weights, num_experts, level):
        return _dispatch_pairs_level(
            x, topk_idx, topk_weights, num_experts, axis_name, capacity, alignment, overflow, zero_padding, level
        )

    return _in_levels(level, x, topk_idx, topk_weights, num_experts, axis_name)


def _dispatch_pairs_bwd(num_experts, axis_name, capacity, alignment, overflow, zero_padding, handle, g):
    dx = _combine_call(g.x, handle)  # the VJP of the pair dispatch is a combine of the pairs
    dw = None
    if g.weights is not None:
        # Each (row, slot)'s weight went to its pair slot (none where dropped): gather the slots' cotangents back.
        c, k = handle.pair_of.shape
        owned = jnp.take(g.weights, handle.pair_of.reshape(-1), mode="fill", fill_value=0).reshape(c, k)
        dw = _combine_call(owned.astype(jnp.float32), handle.rows, after=dx)  # chained: one order on every rank
    return dx, None, dw


def _pairs_residuals(out: ExpertDispatchResult):
    return out.handle


_dispatch_pairs = _differentiable(_dispatch_pairs_call, _pairs_residuals, _dispatch_pairs_bwd, 6)
_dispatch_pairs_fp8_wire = _differentiable(
    _over_fp8_wire(_dispatch_pairs_call), _pairs_residuals, _dispatch_pairs_bwd, 6
)


def _raise_if_any_rank_overflows(pairs_needed: jax.Array, capacity: int, axis_name: AxisName) -> jax.Array:
    """Under overflow="error" with the expert layout: every rank of the axis raises in the same op when one rank's
    pairs need more than `capacity` rows, naming the rank that needs the most (the ranks agree through a pmax
    first, so none waits on another). Returns 0 (int32), to be added to what must wait for the check."""
    axes = _ffi.axes_of(axis_name)
    worst = jax.lax.pmax(pairs_needed, axes)
    who = jax.lax.pmax(jnp.where(pairs_needed == worst, jax.lax.axis_index(axes), -1), axes)  # the neediest
    (zero,) = ep_call(
        "pair_capacity",
        (jax.ShapeDtypeStruct((), jnp.int32),),
        worst.astype(jnp.int32),
        who.astype(jnp.int32),
        varying_over=axes,
        ordered=False,  # local: the axis agreed on its inputs already
        capacity=capacity,
    )
    return zero


def _with_token_shape(handle: Handle, token_shape: tuple[int, ...]) -> Handle:
    if isinstance(handle, ExpertHandle):
        return handle.with_rows(cast(RowHandle, _with_token_shape(handle.rows, token_shape)))
    if isinstance(handle, TwoLevelHandle):
        return TwoLevelHandle(handle.across, handle.within, token_shape)
    return DispatchHandle(
        handle.is_token_in_rank,
        handle.recv_counts,
        handle.axis_name,
        handle.level,
        token_shape,
        handle.overflow,
        handle.capacity,
    )


def _summed_pairs(y: jax.Array, handle: ExpertHandle) -> jax.Array:
    """Each received row's pair rows summed in float32 (the FFI's sum_pairs: an EP op never runs under vmap), in the
    dtype the row goes back in: y's, float32 for float16 (as float16 rows travel), the same sums the host paths'
    pair ops send."""
    wire = summed_row_dtype(y.dtype)
    with jax.named_scope(_pairs.SCOPE):
        return _pairs.reduce_pairs(y, handle.pair_row, handle.pair_of, handle.zero_padding, wire, True)


@jax.custom_vjp
def _combine(y, handle):
    return _combine_call(y, handle)


def _combine_fwd(y, handle):
    out = _combine_call(y, handle)
    return out, (handle, y.shape[0], out.reshape(-1)[:1])


def _combine_bwd(residuals, g):
    handle, capacity, forward_done = residuals
    # The VJP of combine is a dispatch of the cotangent along the same routing. It runs after the forward combine:
    # a cotangent that does not depend on the forward's output (a loss linear in it) would otherwise let XLA start
    # it first on some ranks and after on others, and every rank must run the EP ops in one order.
    dy = _cached_dispatch_call(g, handle, capacity, after=forward_done)
    return dy, _no_cotangent(handle)


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(y: jax.Array, handle: Handle) -> jax.Array:
    """Returns dispatched rows to their source ranks and sums the copies of each token (call inside shard_map).

    Args:
      y: [capacity, H] float32, bfloat16 or float16, rows in the order dispatch produced them (padding rows
        ignored); after dispatch(layout="expert"), [M, H] pair rows in its layout (rows outside the groups
        ignored), unweighted: multiply by its `weights` first if the router's weights should apply.
      handle: the handle of that dispatch's result.

    Returns:
      [..., H] in y's dtype with the leading dimensions of dispatch's x, accumulated in float32 (float16 rows
      travel as float32); tokens that went nowhere get zeros. Under two-level routing each node's partial sum is
      rounded to y's dtype once before it crosses nodes (as DeepEP's internode combine does: bfloat16 on the
      network). Pair rows: a rank sums a token's pairs in float32 and sends the sum back rounded once to y's dtype
      (float16: as float32).
    """
    check(hasattr(y, "ndim") and y.ndim == 2, f"y must be 2-D [capacity, hidden], got shape {getattr(y, 'shape', y)}")
    check(y.dtype in ROW_DTYPES, f"y must be float32, bfloat16 or float16, got {y.dtype}")
    check(
        isinstance(handle, (DispatchHandle, TwoLevelHandle, ExpertHandle)),
        "handle must be the handle of a dispatch's result",
    )
    if isinstance(handle, ExpertHandle):
        pairs = handle.pair_row.shape[0]
        check(y.shape[0] == pairs, f"y must have the dispatch's {pairs} pair rows, got {y.shape[0]}")
        if _plan.receive_writes_pairs():
            out = _combine(y, handle)
        else:
            out = _combine(_summed_pairs(y, handle), handle.rows).astype(y.dtype)
    else:
        rows = handle.within if isinstance(handle, TwoLevelHandle) else handle
        # Under "drop" the kernels keep y's first rows as the dispatch kept its first: a y of other rows would
        # return some kept rows as dropped (zeros) or dropped ones as kept, which no count can catch.
        check(
            rows.overflow != "drop" or rows.capacity is None or y.shape[0] == rows.capacity,
            f"y must have the dispatch's {rows.capacity} rows (its capacity, overflow='drop'), got {y.shape[0]}",
        )
        out = _combine(y, handle)
    token_shape = handle.token_shape
    return out if token_shape is None else out.reshape((*token_shape, out.shape[-1]))
