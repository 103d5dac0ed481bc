"""The expert-major pair layout of `dispatch(layout="expert")`: one row per (received token, local expert) pair.

Local expert e's pairs sit at ``[offsets[e], offsets[e] + counts[e])``, offsets multiples of the alignment A and
increasing with e; within a group, pairs follow the received rows' order (source rank, then token; two-level:
the two-level order). The layout is a counting sort of the received (row, slot) pairs: per-expert prefix counts
over the rows, no sort. The rows then move once into their slots (a gather from the received rows, or without zero
padding a copy of the slots inside the groups only), and back once, by a gather of each row's pairs (in combine the
FFI's sum of them): neither direction scatters rows, forward or backward.

Capacity: the pairs of a prefix of the rows (in row order) are kept while their groups, each rounded up to A, fit
in the buffer; the rows after it lose all their pairs (deterministic, as dispatch's row capacity).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ._ffi import ep_call, like_primal

# The named scope of the pair layout XLA runs after token rows (and of its reverse in combine), for profiles.
SCOPE = "ep_pair_layout"


class PairLayout(NamedTuple):
    """Where each received (row, slot) pair sits in the pair buffer, and back."""

    pair_row: jax.Array  # [M] int32: the received row of each pair slot; C (one past the rows) outside the groups
    pair_index: jax.Array  # [M] int32: row * K + slot of each pair slot (its router weight); C * K outside
    pair_of: jax.Array  # [C, K] int32: the pair slot of each (row, slot); M where it has none or was dropped
    expert_offsets: jax.Array  # [G] int32: first pair slot of each local expert, multiples of the alignment
    num_tokens_per_expert: jax.Array  # [G] int32: pairs kept per local expert
    rows_kept: jax.Array  # int32 scalar: received rows whose pairs were kept (a prefix of the rows)
    pairs_dropped: jax.Array  # int32 scalar: valid pairs that did not fit
    pairs_needed: jax.Array  # int32 scalar: aligned pair slots every received row would need


def never_dropping_pairs(rows: int, top_k: int, groups: int, alignment: int) -> int:
    """Pair slots that hold every pair `rows` received rows can bring: at most min(K, G) pairs a row (a token
    names each expert once, as a router's top-k does), each group rounded up to the alignment."""
    return rows * min(top_k, groups) + (alignment - 1) * groups


def every_slot_pairs(rows: int, top_k: int, groups: int, alignment: int) -> int:
    """Pair slots that hold every top-k slot of `rows` rows, a token naming one expert twice included: no routing
    can overflow them."""
    return rows * top_k + (alignment - 1) * groups


def _align(n: jax.Array, alignment: int) -> jax.Array:
    return (n + alignment - 1) // alignment * alignment


def valid_pairs(expert: jax.Array, num_rows: jax.Array | int, groups: int) -> jax.Array:
    """[C, K] bool: the slots of ``expert [C, K]`` that name a local expert, in rows before `num_rows` (the rows
    past it are padding)."""
    received = jnp.arange(expert.shape[0]) < num_rows
    return (expert >= 0) & (expert < groups) & received[:, None]


def pair_layout(expert: jax.Array, num_rows: jax.Array | int, groups: int, alignment: int, capacity: int) -> PairLayout:
    """The layout of ``expert [C, K]`` (local expert of each received row's slot, -1 for none; rows at or past
    `num_rows` are padding) in a buffer of `capacity` pair slots."""
    c, k = expert.shape
    received = jnp.arange(c) < num_rows  # [C]: rows past num_rows are padding
    valid = valid_pairs(expert, num_rows, groups)
    e = jnp.where(valid, expert, 0)
    one_hot = jax.nn.one_hot(e, groups, dtype=jnp.int32) * valid[..., None].astype(jnp.int32)  # [C, K, G]
    per_row = jnp.sum(one_hot, axis=1)  # [C, G] pairs of each row per expert
    through = jnp.cumsum(per_row, axis=0)  # [C, G] pairs of rows 0..c per expert
    # A row is kept while every row up to it fits, groups rounded up: the aligned total only grows with c.
    aligned_through = jnp.sum(_align(through, alignment), axis=1)  # [C]
    keep = aligned_through <= capacity
    rows_kept = jnp.sum((keep & received).astype(jnp.int32))
    counts = jnp.sum(per_row * keep[:, None].astype(jnp.int32), axis=0)  # [G]
    sizes = _align(counts, alignment)
    offsets = jnp.cumsum(sizes) - sizes
    # A slot's place in its group: its expert's pairs in earlier rows, then in earlier slots of its row.
    before_row = jnp.take_along_axis(through - per_row, e, axis=1)  # [C, K]
    same_earlier = jnp.sum(jnp.tril(e[:, :, None] == e[:, None, :], -1) & valid[:, None, :], axis=2)  # [C, K]
    slot = offsets[e] + before_row + same_earlier.astype(jnp.int32)
    placed = valid & keep[:, None]
    pair_of = jnp.where(placed, slot, capacity).astype(jnp.int32)
    rows = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32)[:, None], (c, k))
    flat = jnp.arange(c * k, dtype=jnp.int32).reshape(c, k)
    # Scatters of int32 indices only ([C*K] of them), never of rows; slots outside the groups keep the fill.
    pair_row = jnp.full((capacity,), c, jnp.int32).at[pair_of.reshape(-1)].set(rows.reshape(-1), mode="drop")
    pair_index = jnp.full((capacity,), c * k, jnp.int32).at[pair_of.reshape(-1)].set(flat.reshape(-1), mode="drop")
    total = jnp.sum(valid.astype(jnp.int32))
    return PairLayout(
        pair_row=pair_row,
        pair_index=pair_index,
        pair_of=pair_of,
        expert_offsets=offsets.astype(jnp.int32),
        num_tokens_per_expert=counts.astype(jnp.int32),
        rows_kept=rows_kept,
        pairs_dropped=total - jnp.sum(counts),
        pairs_needed=aligned_through[-1] if c else jnp.zeros((), jnp.int32),
    )


def _gather(rows: jax.Array, index: jax.Array) -> jax.Array:
    """rows[index], zeros where index is out of range (the layouts' fill values)."""
    return jnp.take(rows, index, axis=0, mode="fill", fill_value=0)


def _to_slots(rows: jax.Array, pair_row: jax.Array, zero_padding: bool) -> jax.Array:
    """``rows [C, ...]`` -> ``[M, ...]``, slot s holding row pair_row[s]: zeros outside the groups (XLA's gather,
    which writes every slot), or without `zero_padding` whatever the buffer held there (the FFI's expand_pairs,
    which copies the slots inside the groups only: most of a worst-case buffer is outside them)."""
    if zero_padding:
        return _gather(rows, pair_row)
    (pairs,) = ep_call(
        "expand_pairs",
        (jax.ShapeDtypeStruct((pair_row.shape[0], *rows.shape[1:]), rows.dtype),),
        rows,
        pair_row,
        ordered=False,  # local: no peers involved
        zero_padding=0,
    )
    return pairs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def expand(rows: jax.Array, pair_row: jax.Array, pair_of: jax.Array, zero_padding: bool) -> jax.Array:
    """Received ``rows [C, ...]`` -> pair rows ``[M, ...]`` (outside the groups: see _to_slots). Its transpose is
    `reduce_pairs`: a gather too."""
    return _to_slots(rows, pair_row, zero_padding)


def _expand_fwd(rows, pair_row, pair_of, zero_padding):
    return expand(rows, pair_row, pair_of, zero_padding), (pair_row, pair_of, rows[:0])


def _expand_bwd(zero_padding, residuals, d_pairs):
    pair_row, pair_of, rows_type = residuals
    # Without zero padding expand ran the FFI's copy (no vmap), so its transpose may run the FFI's sum.
    d_rows = reduce_pairs(d_pairs, pair_row, pair_of, zero_padding, rows_type.dtype, not zero_padding)
    return like_primal(d_rows, rows_type), None, None


expand.defvjp(_expand_fwd, _expand_bwd)


# The dtypes the FFI's sum_pairs takes and writes; others sum in XLA.
_SUMMED_BY_THE_FFI = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _from_slots(pairs: jax.Array, pair_of: jax.Array, dtype, ffi: bool) -> jax.Array:
    """``pairs [M, H]`` -> ``[C, H]`` in `dtype`, row r the float32 sum of the slots pair_of[r] names, rounded once:
    with `ffi` (not under vmap) the FFI's sum_pairs, which reads each row's slots once and writes the row once, else
    XLA's gather and sum over every (row, slot), the slower of the two on GPUs (bench/pair_layout.py)."""
    if not ffi or pairs.dtype not in _SUMMED_BY_THE_FFI or jnp.dtype(dtype) not in _SUMMED_BY_THE_FFI:
        c, k = pair_of.shape
        per_row = _gather(pairs, pair_of.reshape(-1)).reshape(c, k, pairs.shape[-1])
        return jnp.sum(per_row, axis=1, dtype=jnp.float32).astype(dtype)
    (rows,) = ep_call(
        "sum_pairs", (jax.ShapeDtypeStruct((pair_of.shape[0], pairs.shape[1]), dtype),), pairs, pair_of, ordered=False
    )
    return rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def reduce_pairs(
    pairs: jax.Array, pair_row: jax.Array, pair_of: jax.Array, zero_padding: bool, dtype, ffi: bool
) -> jax.Array:
    """Pair rows ``[M, H]`` -> ``[C, H]`` in `dtype`: each received row's sum of its pairs in float32, rounded once
    (with `ffi`, by the FFI's sum_pairs: not under vmap). Its transpose is `expand`: the cotangent's slots outside
    the groups as _to_slots leaves them (the pairs' own padding was unspecified too without `zero_padding`, so
    nothing reads it)."""
    return _from_slots(pairs, pair_of, dtype, ffi)


def _reduce_fwd(pairs, pair_row, pair_of, zero_padding, dtype, ffi):
    return reduce_pairs(pairs, pair_row, pair_of, zero_padding, dtype, ffi), (pair_row, pair_of, pairs[:0])


def _reduce_bwd(zero_padding, dtype, ffi, residuals, d_rows):
    pair_row, pair_of, pairs_type = residuals
    d_pairs = _to_slots(d_rows.astype(pairs_type.dtype), pair_row, zero_padding)  # cast the C rows, not M slots
    return like_primal(d_pairs, pairs_type), None, None


reduce_pairs.defvjp(_reduce_fwd, _reduce_bwd)


@jax.custom_vjp
def pair_weights(weights: jax.Array, pair_index: jax.Array, pair_of: jax.Array) -> jax.Array:
    """Received router weights ``[C, K]`` -> ``[M]`` float32, each pair slot's (0 outside the groups)."""
    return _gather(weights.reshape(-1).astype(jnp.float32), pair_index)


def _pair_weights_fwd(weights, pair_index, pair_of):
    return pair_weights(weights, pair_index, pair_of), (pair_of, weights[:0])


def _pair_weights_bwd(residuals, d_pairs):
    pair_of, weights_type = residuals
    d_weights = _gather(d_pairs, pair_of.reshape(-1)).reshape(pair_of.shape).astype(weights_type.dtype)
    return like_primal(d_weights, weights_type), None, None


pair_weights.defvjp(_pair_weights_fwd, _pair_weights_bwd)


def pack_slots(rows: jax.Array, counts: jax.Array) -> jax.Array:
    """``rows [G, S, D]`` (group g's first ``counts[g]`` slots hold its rows, the rest padding) as ``[G * S, D]``
    with the groups one after another from row 0 (the grouped matmul's layout, alignment 1) and zeros after them:
    a gather, so the grouped matmul's cost follows the rows there rather than G * S."""
    groups, slots = rows.shape[:2]
    counts = jnp.clip(counts.astype(jnp.int32), 0, slots)
    ends = jnp.cumsum(counts)
    packed_row = jnp.arange(groups * slots, dtype=jnp.int32)
    group = jnp.searchsorted(ends, packed_row, side="right").astype(jnp.int32)  # G past the groups
    inside = group < groups
    group = jnp.minimum(group, groups - 1)
    source = group * slots + packed_row - (ends[group] - counts[group])
    flat = rows.reshape(groups * slots, *rows.shape[2:])
    gathered = flat[jnp.where(inside, source, 0)]
    return jnp.where(inside.reshape(-1, *([1] * (rows.ndim - 2))), gathered, jnp.zeros((), rows.dtype))


def unpack_slots(packed: jax.Array, counts: jax.Array, slots: int) -> jax.Array:
    """`pack_slots` backwards: ``packed [G * S, D]`` (the groups from row 0) as ``[G, S, D]``, each group's rows in
    its first ``counts[g]`` slots and zeros in the rest."""
    groups = counts.shape[0]
    counts = jnp.clip(counts.astype(jnp.int32), 0, slots)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(slots, dtype=jnp.int32)
    inside = slot[None, :] < counts[:, None]  # [G, S]
    source = jnp.where(inside, starts[:, None] + slot[None, :], 0)
    out = packed[source.reshape(-1)].reshape(groups, slots, *packed.shape[1:])
    return jnp.where(inside.reshape(groups, slots, *([1] * (packed.ndim - 1))), out, jnp.zeros((), packed.dtype))
