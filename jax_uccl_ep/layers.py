"""An expert-parallel Mixture-of-Experts feed-forward layer, built on dispatch and combine.

``moe_ffn(params, x, mesh=mesh, config=MoEConfig(...))`` takes activations ``x [..., S, D]`` as a model holds them
(sharded over the mesh's EP axis along their first dimension), opens the ``jax.shard_map`` itself, and returns
``MoEOutput(y, aux_loss, stats)``. Inside a ``shard_map`` of your own, call ``moe_ffn_local`` on this rank's
shard instead. ``moe_ffn_reference`` computes the same function densely (every expert on every token), for
parity checks. ``moe_ffn_decode`` is the low-latency variant for decoding (forward only).

Each token goes to its top-k experts: ``y = sum_k w_k * expert_{i_k}(x)`` with SwiGLU experts
``expert_e(x) = (silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]``. Rank r of the EP axis (size R) owns experts
``[r*E/R, (r+1)*E/R)``; dispatch hands each rank its (token, local expert) pairs grouped by expert
(``layout="expert"``), and they run as grouped matmuls over its experts (``grouped.grouped_matmul``: Pallas Mosaic
kernels on Hopper GPUs in bf16, ``jax.lax.ragged_dot`` elsewhere), in ``MoEConfig.compute_dtype`` (bf16 on GPUs by
default) while the parameters stay in theirs: each pair's output is weighted in float32 and rounded to the compute
dtype, a rank sums a token's pairs in float32, the sum travels back in the compute dtype, and combine adds the
ranks' sums in float32. Parameters (global shapes; ``moe_param_specs`` shards the experts)::

    {"router": [D, E], "w_gate": [E, D, F], "w_up": [E, D, F], "w_down": [E, F, D]}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from . import _pairs, _plan
from ._checks import axis_size, check, summed_row_dtype
from ._ffi import axes_of, ep_call, like_primal, mark_varying, varying_axes, varying_like, zeros_typed
from ._runtime import JobShapes
from .grouped import GroupedBackend, _rows_in_groups, grouped_backend, grouped_matmul
from .low_latency import low_latency_combine, low_latency_dispatch
from .normal import combine, dispatch

__all__ = [
    "MoEConfig",
    "MoEOutput",
    "MoEStats",
    "SCOPES",
    "capacity_for",
    "init_moe_params",
    "load_balancing_loss",
    "load_sized_pairs",
    "moe_ffn",
    "moe_ffn_decode",
    "moe_ffn_local",
    "moe_ffn_reference",
    "moe_job_shapes",
    "moe_param_specs",
    "route",
    "swiglu_expert_slots",
    "swiglu_experts",
    "swiglu_pairs",
]

Params = dict[str, jax.Array]

# The layer's parts as named scopes: a profile attributes each compiled op, forward and backward, to the part whose
# scope its op_name holds (examples/train_moe.py --profile-parts). The XLA pair layout after token rows is its own.
SCOPES = {
    "router": "moe_router",
    "dispatch": "moe_dispatch",
    "pair_layout": _pairs.SCOPE,
    "experts": "moe_experts",
    "combine": "moe_combine",
}


@dataclass(frozen=True)
class MoEConfig:
    """What the layer computes. Units: experts, tokens."""

    num_experts: int
    top_k: int
    score: Literal["softmax", "sigmoid"] = "softmax"  # router scores: softmax over experts, or independent sigmoids
    renormalize: bool = True  # the top-k weights of a token sum to one (at top_k 1 each is 1: the router then
    # learns from the aux loss only, as Switch's top-1 does not renormalize)
    aux_loss_coef: float = 0.0  # load-balancing loss (Switch Transformer's) times this; 0 leaves it out
    capacity_factor: float | None = None  # (token, expert) pairs a rank may take, per its tokens' top-k slots
    # (None: never drops)
    overflow: Literal["drop", "error"] = "drop"  # rows past that capacity: dropped (MaxText's), or an error
    pair_buffer_factor: float | None = None  # never dropping (capacity_factor None): a rank's experts run on a
    # pair buffer of this factor x its mean pairs (capacity_for) whenever its pairs fit, else on the worst-case one
    # (None: always the worst case, R * tokens * min(top_k, E / R) pairs); see moe_ffn_local. Slower on 4x H200
    # (46.2 against 41.6 ms a step, bench/RESULTS.md): the grouped matmuls skip the empty tiles already
    fp8_dispatch: bool = False  # rows travel as FP8 (dispatch's use_fp8; the backward stays in x's dtype)
    compute_dtype: Any = None  # the experts' matmuls (and dispatched rows): None = bfloat16 on GPUs, else params'
    grouped_matmul: GroupedBackend = "auto"  # the experts' grouped matmuls: Mosaic kernels where they run, else XLA's

    def __post_init__(self) -> None:
        def whole(value: Any) -> bool:
            return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

        if not whole(self.num_experts) or self.num_experts < 1:
            raise ValueError(f"jax_uccl_ep: MoEConfig.num_experts must be a positive int, got {self.num_experts!r}")
        if not whole(self.top_k) or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"jax_uccl_ep: MoEConfig.top_k must be an int in [1, num_experts={self.num_experts}], got "
                f"{self.top_k!r}"
            )
        for name in ("capacity_factor", "pair_buffer_factor"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"jax_uccl_ep: MoEConfig.{name} must be positive and finite, or None, got {value}")
        if self.capacity_factor is not None and self.pair_buffer_factor is not None:
            raise ValueError(
                "jax_uccl_ep: MoEConfig sets both capacity_factor (a fixed pair buffer that drops past it) and "
                "pair_buffer_factor (a never-dropping layer's buffer for the common case): set one"
            )

    def experts_dtype(self, param_dtype: Any, platform: Literal["cpu", "gpu"] | None = None) -> jnp.dtype:
        """The dtype the experts compute in (and the layer's rows travel in) for parameters of `param_dtype`:
        compute_dtype, else bfloat16 on GPUs (as models train) and the parameters' own elsewhere. `platform`
        (default: JAX's backend, which starts it) names where the layer runs."""
        if self.compute_dtype is not None:
            return jnp.dtype(self.compute_dtype)
        gpu = (platform or jax.default_backend()) == "gpu"
        return jnp.dtype(jnp.bfloat16) if gpu else jnp.dtype(param_dtype)


class MoEStats(NamedTuple):
    """Per-call counts, one entry per EP rank."""

    rows_received: jax.Array  # [R] int32: token rows each rank received and kept
    pairs_dropped: jax.Array  # [R] int32: (token, expert) pairs past a rank's capacity, dropped
    tokens_per_expert: jax.Array  # [E] int32: (token, expert) pairs routed to each expert, over the whole axis


class MoEOutput(NamedTuple):
    y: jax.Array  # like x
    aux_loss: jax.Array  # float32 scalar (0 when aux_loss_coef is 0)
    stats: MoEStats


def moe_job_shapes(
    config: MoEConfig,
    *,
    tokens_per_rank: int,
    d_model: int,
    platform: Literal["cpu", "gpu"],
    param_dtype: Any = jnp.float32,
    backward: bool = True,
    decode_tokens_per_rank: int = 0,
    decode_fp8: bool = True,
    ep_ranks: int | None = None,
) -> JobShapes:
    """What this layer's EP ops move, for ``jax_uccl_ep.initialize(shapes=...)`` to size every buffer for it:
    moe_ffn / moe_ffn_local on `tokens_per_rank` tokens of `d_model` channels a rank (a shard's tokens, the EP
    axis's and any data axis's split taken off), rows in the experts' dtype with their router weights, FP8 where
    ``config.fp8_dispatch``, gradients where `backward`; and moe_ffn_decode at ``max_tokens_per_rank =
    decode_tokens_per_rank`` (0: no decoding) with ``use_fp8 = decode_fp8``. `platform` ("cpu" or "gpu") decides
    the experts' dtype where ``config.compute_dtype`` does not; initialize() can pass it:
    ``initialize(shapes=lambda platform: moe_job_shapes(..., platform=platform))``. ep_ranks: the EP axis's ranks
    where it is not every rank of the job."""
    dtype = config.experts_dtype(param_dtype, platform)
    return JobShapes(
        num_tokens=tokens_per_rank,
        hidden=d_model,
        topk=config.top_k,
        num_experts=config.num_experts,
        dtype=dtype,
        fp8=config.fp8_dispatch,
        with_weights=True,
        combine_dtype=dtype,
        backward=backward,
        low_latency_max_tokens=decode_tokens_per_rank,
        low_latency_fp8=decode_fp8,
        ep_ranks=ep_ranks,
    )


def init_moe_params(key: jax.Array, *, d_model: int, d_ff: int, num_experts: int, dtype: Any = jnp.float32) -> Params:
    """Random parameters of one layer (global shapes: all experts), scaled by fan-in."""
    k_router, k_gate, k_up, k_down = jax.random.split(key, 4)
    normal = jax.random.normal
    return {
        "router": normal(k_router, (d_model, num_experts), dtype) * d_model**-0.5,
        "w_gate": normal(k_gate, (num_experts, d_model, d_ff), dtype) * d_model**-0.5,
        "w_up": normal(k_up, (num_experts, d_model, d_ff), dtype) * d_model**-0.5,
        "w_down": normal(k_down, (num_experts, d_ff, d_model), dtype) * d_ff**-0.5,
    }


def moe_param_specs(axis_name: str | tuple[str, ...]) -> dict[str, P]:
    """PartitionSpecs of the parameters: the router replicated, the experts split over the EP axis."""
    return {"router": P(), "w_gate": P(axis_name), "w_up": P(axis_name), "w_down": P(axis_name)}


def capacity_for(
    num_tokens: int, top_k: int, num_ranks: int, capacity_factor: float, num_experts: int | None = None
) -> int:
    """(token, expert) pairs a rank takes at most for `capacity_factor` (MaxText's: per expert factor x
    ``num_tokens * top_k / num_experts`` from each of the ranks, times the rank's experts): factor x the pairs a
    rank gets on average, ``num_tokens * top_k`` for `num_tokens` tokens on each rank (each rank sends its tokens'
    top_k pairs, spread over the ranks), at least 1 and at most the never-dropping ``num_ranks * num_tokens *
    min(top_k, num_experts / num_ranks)`` (top_k without num_experts)."""
    if capacity_factor <= 0:
        raise ValueError(f"jax_uccl_ep: capacity_factor must be positive, got {capacity_factor}")
    pairs = math.ceil(capacity_factor * num_tokens * top_k)
    per_token = top_k if num_experts is None else min(top_k, num_experts // num_ranks)
    return max(1, min(num_ranks * num_tokens * per_token, pairs))


def load_sized_pairs(config: MoEConfig, num_tokens: int, num_ranks: int) -> int | None:
    """The pair buffer (pairs) on which moe_ffn_local runs a rank's experts while its pairs fit, for `num_tokens`
    tokens on each of `num_ranks` ranks (MoEConfig.pair_buffer_factor), or None where the layer runs the expert
    layout instead: no factor, a capacity factor, or a factor whose buffer would hold every pair anyway."""
    if config.capacity_factor is not None or config.pair_buffer_factor is None:
        return None
    small = capacity_for(num_tokens, config.top_k, num_ranks, config.pair_buffer_factor, config.num_experts)
    groups = config.num_experts // num_ranks
    return small if small < _pairs.never_dropping_pairs(num_ranks * num_tokens, config.top_k, groups, 1) else None


def route(router: jax.Array, x: jax.Array, config: MoEConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The router on tokens ``x [T, D]``: (weights [T, K] float32, expert indices [T, K] int32, scores [T, E]
    float32)."""
    logits = jnp.dot(x, router, preferred_element_type=jnp.float32)
    if config.score == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif config.score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"jax_uccl_ep: MoEConfig.score must be 'softmax' or 'sigmoid', got {config.score!r}")
    weights, idx = jax.lax.top_k(scores, config.top_k)
    if config.renormalize:
        weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-20)
    return weights, idx.astype(jnp.int32), scores


def load_balancing_loss(scores: jax.Array, pairs_per_expert: jax.Array) -> jax.Array:
    """Switch Transformer's auxiliary loss on one rank's tokens: ``E * sum_e f_e * p_e``, f_e the fraction of
    (token, slot) pairs routed to expert e (`pairs_per_expert` [E] counts them), p_e its mean router score
    (`scores` [T, E]). 1 when balanced."""
    fraction = pairs_per_expert.astype(jnp.float32) / jnp.sum(pairs_per_expert)
    return scores.shape[-1] * jnp.sum(fraction * jnp.mean(scores, axis=0))


def _routing_stats(scores: jax.Array, idx: jax.Array, config: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """(the weighted load-balancing loss, 0 without aux_loss_coef; (token, slot) pairs per expert [E] int32)."""
    per_expert = jnp.zeros((config.num_experts,), jnp.int32).at[idx.reshape(-1)].add(1)
    aux = jnp.zeros((), jnp.float32)
    if config.aux_loss_coef:
        aux = config.aux_loss_coef * load_balancing_loss(scores, per_expert)
    return aux, per_expert


def swiglu_experts(
    params: Params,
    rows: jax.Array,
    expert: jax.Array,
    weights: jax.Array | None = None,
    *,
    num_rows: jax.Array | int | None = None,
    pair_buffer: int | None = None,
    compute_dtype: Any = None,
    backend: GroupedBackend = "auto",
) -> jax.Array:
    """Each row of ``rows [N, D]`` through its chosen local experts only, weighted and summed: ``[N, D]`` float32,
    ``sum_k weights[n, k] * expert_{expert[n, k]}(rows[n])`` (``weights [N, K]``; None: all 1), slots with expert -1
    adding nothing, rows at or past `num_rows` (default N) zeros. For rows in any order: the (row, slot) pairs are
    laid out by expert as dispatch(layout="expert") lays them out (a counting sort, one gather), run through
    `swiglu_pairs` in `compute_dtype` (default: the parameters'), weighted and summed back into rows in float32
    (gathers both ways, forward and backward: no scatter of the pair buffer).

    The pair buffer holds every slot (N * K pairs) unless `pair_buffer` (pairs) is smaller: then the pairs run on a
    buffer of that size whenever they fit in it and on the full one otherwise (``lax.cond`` on their count, in the
    forward and the backward pass alike), so nothing drops and the elementwise work over the buffer follows the
    small size while the routing allows. The backward keeps the small path's residuals only; the full path, when
    taken, computes its forward again. Both paths are compiled."""
    n, k = expert.shape
    groups = params["w_gate"].shape[0]
    dtype = jnp.dtype(params["w_gate"].dtype if compute_dtype is None else compute_dtype)
    if weights is None:
        weights = varying_like(jnp.ones((n, k), jnp.float32), rows)
    num_rows = n if num_rows is None else num_rows
    if pair_buffer is not None and pair_buffer < 1:
        raise ValueError(f"jax_uccl_ep.swiglu_experts: pair_buffer must be at least 1 pair or None, got {pair_buffer}")
    full = _pairs.every_slot_pairs(n, k, groups, 1)
    if pair_buffer is None or pair_buffer >= full:
        return _through_pairs(params, rows, weights, expert, num_rows, full, dtype, backend)
    return _through_pairs_sized(params, rows, weights, expert, num_rows, (pair_buffer, full), dtype, backend)


def _through_pairs(params, rows, weights, expert, num_rows, capacity: int, dtype, backend) -> jax.Array:
    """swiglu_experts on a pair buffer of `capacity` pairs."""
    layout = _pairs.pair_layout(expert, num_rows, params["w_gate"].shape[0], 1, capacity)
    # Zeroed padding: a public function, also run eagerly or under vmap, which the FFI copy (zero_padding=False)
    # does not support.
    pairs = _pairs.expand(rows.astype(dtype), layout.pair_row, layout.pair_of, True)
    y = swiglu_pairs(params, pairs, layout.num_tokens_per_expert, compute_dtype=dtype, backend=backend)
    pair_weights = _pairs.pair_weights(weights, layout.pair_index, layout.pair_of)
    weighted = y.astype(jnp.float32) * pair_weights[:, None]
    return _pairs.reduce_pairs(weighted, layout.pair_row, layout.pair_of, True, jnp.float32, False)


def _through_pairs_sized(params, rows, weights, expert, num_rows, buffers: tuple[int, int], dtype, backend):
    """swiglu_experts on the small pair buffer where the pairs fit, else on the full one (see there)."""
    small, full = buffers
    groups = params["w_gate"].shape[0]  # a shape, not the traced params: run_bwd outlives this trace

    def on(capacity, expert, num_rows):
        return lambda p, r, w: _through_pairs(p, r, w, expert, num_rows, capacity, dtype, backend)

    def fits(expert, num_rows):
        return jnp.sum(_pairs.valid_pairs(expert, num_rows, groups)) <= small

    pullback_trees: list[Any] = []  # the small path's pullback, as a tree over its residuals

    def small_with_pullback(expert, num_rows):
        def branch(p, r, w):
            out, pullback = jax.vjp(on(small, expert, num_rows), p, r, w)
            leaves, tree = jax.tree.flatten(pullback)
            pullback_trees.append(tree)
            return out, leaves

        return branch

    @jax.custom_vjp
    def run(p, r, w, expert, num_rows):
        return jax.lax.cond(fits(expert, num_rows), on(small, expert, num_rows), on(full, expert, num_rows), p, r, w)

    def run_fwd(p, r, w, expert, num_rows):
        with_pullback = small_with_pullback(expert, num_rows)
        leaf_types = jax.eval_shape(lambda *a: with_pullback(*a)[1], p, r, w)

        def full_without(p, r, w):
            return on(full, expert, num_rows)(p, r, w), [zeros_typed(t) for t in leaf_types]

        out, leaves = jax.lax.cond(fits(expert, num_rows), with_pullback, full_without, p, r, w)
        return out, (leaves, p, r, w, expert, num_rows)

    def run_bwd(res, g):
        leaves, p, r, w, expert, num_rows = res

        def small_pullback(leaves, p, r, w, g):
            return jax.tree.unflatten(pullback_trees[-1], leaves)(g)

        def full_pullback(leaves, p, r, w, g):
            return jax.vjp(on(full, expert, num_rows), p, r, w)[1](g)

        grads = jax.lax.cond(fits(expert, num_rows), small_pullback, full_pullback, leaves, p, r, w, g)
        return (*grads, None, None)

    run.defvjp(run_fwd, run_bwd)
    return run(params, rows, weights, expert, jnp.asarray(num_rows, jnp.int32))


def swiglu_pairs(
    params: Params,
    pairs: jax.Array,
    group_sizes: jax.Array,
    *,
    compute_dtype: Any = None,
    backend: GroupedBackend = "auto",
) -> jax.Array:
    """The local experts on expert-major pair rows ``pairs [M, D]`` (dispatch(layout="expert")'s ``x``: expert e's
    rows follow expert e-1's, ``group_sizes [G]`` of them; rows past the groups give zeros): ``[M, D]`` in
    `compute_dtype` (default: the parameters'), as two grouped matmuls (gate and up together, then down)."""
    dtype = jnp.dtype(params["w_gate"].dtype if compute_dtype is None else compute_dtype)
    w_gate_up = jnp.concatenate([params["w_gate"], params["w_up"]], axis=-1).astype(dtype)  # [G, D, 2F]
    gate_up = grouped_matmul(pairs.astype(dtype), w_gate_up, group_sizes, out_dtype=dtype, backend=backend)
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    h = (jax.nn.silu(gate) * up).astype(dtype)
    return grouped_matmul(h, params["w_down"].astype(dtype), group_sizes, out_dtype=dtype, backend=backend)


@jax.custom_vjp
def _weighted_swiglu(gate_up: jax.Array, weights: jax.Array, num_rows: jax.Array) -> jax.Array:
    """``silu(gate) * up * weight`` of each of the first `num_rows` rows of ``gate_up [M, 2F]`` (gate its first F
    columns) and ``weights [M]``, in float32, rounded once to gate_up's dtype: ``[M, F]``. The rows past `num_rows`
    are neither read nor written (the FFI's swiglu), and their cotangents are left as they are too: for the layer's
    pair buffer, whose consumers read only the groups' rows."""
    (h,) = ep_call(
        "swiglu",
        (jax.ShapeDtypeStruct((gate_up.shape[0], gate_up.shape[1] // 2), gate_up.dtype),),
        gate_up,
        weights,
        num_rows,
        ordered=False,  # local: no peers involved
    )
    return h


def _weighted_swiglu_fwd(gate_up, weights, num_rows):
    return _weighted_swiglu(gate_up, weights, num_rows), (gate_up, weights, num_rows)


def _weighted_swiglu_bwd(residuals, dh):
    gate_up, weights, num_rows = residuals
    d_gate_up, d_weights = ep_call(
        "swiglu_grad",
        (jax.ShapeDtypeStruct(gate_up.shape, gate_up.dtype), jax.ShapeDtypeStruct(weights.shape, jnp.float32)),
        gate_up,
        weights,
        dh.astype(gate_up.dtype),
        num_rows,
        ordered=False,
    )
    return like_primal(d_gate_up, gate_up), like_primal(d_weights, weights), None


_weighted_swiglu.defvjp(_weighted_swiglu_fwd, _weighted_swiglu_bwd)


def _weighted_swiglu_pairs(
    params: Params, pairs: jax.Array, group_sizes: jax.Array, weights: jax.Array, dtype: Any, backend: GroupedBackend
) -> jax.Array:
    """`swiglu_pairs` with each pair row weighted by ``weights [M]`` (its router weight), for the layer: the weight
    scales the row between the matmuls (a row's scale commutes with the down projection), and every step between
    them, and their backward, touches only the groups' rows. Rows past the groups are left unspecified; the
    layer's combine reads only the groups' rows."""
    group_sizes = group_sizes.astype(jnp.int32)
    w_gate_up = jnp.concatenate([params["w_gate"], params["w_up"]], axis=-1).astype(dtype)  # [G, D, 2F]
    gate_up = grouped_matmul(
        pairs.astype(dtype), w_gate_up, group_sizes, out_dtype=dtype, backend=backend, zero_padding=False
    )
    weights = weights.astype(jnp.float32)
    if jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):  # the op's types
        h = _weighted_swiglu(gate_up, weights, jnp.sum(group_sizes))
    else:  # float16: XLA's elementwise step, over every row
        gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
        h = (jax.nn.silu(gate) * up * weights[:, None]).astype(dtype)
    if grouped_backend(backend, dtype, warn=False) == "xla":
        # XLA's ragged_dot may hand its weight gradient to a library kernel (cuDNN's, on GPUs before Hopper) that
        # masks rows by multiplying: give it zeros past the groups, a pass that costs little beside its dense work.
        h = _rows_in_groups(h, group_sizes)
    w_down = params["w_down"].astype(dtype)
    return grouped_matmul(h, w_down, group_sizes, out_dtype=dtype, backend=backend, zero_padding=False)


def swiglu_expert_slots(
    params: Params,
    rows: jax.Array,
    counts: jax.Array,
    *,
    compute_dtype: Any = None,
    backend: GroupedBackend = "auto",
) -> jax.Array:
    """The local experts on per-expert slot buffers ``rows [G, S, D]`` (low-latency dispatch's output: expert g's
    rows in its first ``counts[g]`` slots, padding after them that may hold anything): ``[G, S, D]`` in
    `compute_dtype` (default: the parameters'), zeros in the padding. Where the grouped matmul runs its Mosaic
    kernels the rows are packed first (a gather each way), so the cost follows the rows received rather than
    G * S slots; elsewhere (CPU devices, XLA's ragged_dot) as batched matmuls over the slots, the padding zeroed."""
    dtype = jnp.dtype(params["w_gate"].dtype if compute_dtype is None else compute_dtype)
    groups, slots = rows.shape[:2]
    if grouped_backend(backend, dtype, warn=False) == "mosaic":
        counts = jnp.clip(counts.astype(jnp.int32), 0, slots)  # the groups pack_slots lays out
        packed = _pairs.pack_slots(rows.astype(dtype), counts)
        y = swiglu_pairs(params, packed, counts, compute_dtype=dtype, backend=backend)
        return _pairs.unpack_slots(y, counts, slots)
    valid = jnp.arange(slots)[None, :] < counts[:, None]  # a negative count: no rows, as pack_slots has it
    rows = jnp.where(valid[..., None], rows, 0).astype(dtype)
    w = {k: params[k].astype(dtype) for k in ("w_gate", "w_up", "w_down")}
    gate = jnp.einsum("lnd,ldf->lnf", rows, w["w_gate"], preferred_element_type=jnp.float32)
    up = jnp.einsum("lnd,ldf->lnf", rows, w["w_up"], preferred_element_type=jnp.float32)
    h = (jax.nn.silu(gate) * up).astype(dtype)
    y = jnp.einsum("lnf,lfd->lnd", h, w["w_down"], preferred_element_type=jnp.float32).astype(dtype)
    return jnp.where(valid[..., None], y, jnp.zeros((), dtype))


def _check_params(params: Params, x: jax.Array, num_experts: int, axis_name: Any, where: str) -> None:
    """This rank's parameters and tokens as the layer takes them (init_moe_params' shapes, the experts split over
    the EP axis), each mismatch named."""
    missing = {"router", "w_gate", "w_up", "w_down"} - set(params)
    if missing:
        raise ValueError(f"jax_uccl_ep.{where}: params lack {sorted(missing)} (see init_moe_params)")
    ranks = axis_size(axis_name)  # outside a shard_map: says so
    shapes = {k: tuple(params[k].shape) for k in ("router", "w_gate", "w_up", "w_down")}
    for k in shapes:
        if not jnp.issubdtype(params[k].dtype, jnp.floating):
            raise ValueError(f"jax_uccl_ep.{where}: params[{k!r}] must be floating point, got {params[k].dtype}")
    if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 1):
        raise ValueError(
            f"jax_uccl_ep.{where}: x must be floating point [..., d_model], got {getattr(x, 'dtype', x)} of shape "
            f"{getattr(x, 'shape', None)}"
        )
    if len(shapes["w_gate"]) != 3 or len(shapes["router"]) != 2:
        raise ValueError(f"jax_uccl_ep.{where}: params shapes {shapes} are not init_moe_params'")
    local, d, f = shapes["w_gate"]
    if local * ranks != num_experts:
        raise ValueError(
            f"jax_uccl_ep.{where}: this rank holds {local} experts of {num_experts} on an EP axis of {ranks} ranks; "
            f"shard the expert weights over {axis_name!r} (moe_param_specs)"
        )
    want = {"router": (d, num_experts), "w_gate": (local, d, f), "w_up": (local, d, f), "w_down": (local, f, d)}
    for k, shape in want.items():
        if shapes[k] != shape:
            raise ValueError(
                f"jax_uccl_ep.{where}: params[{k!r}] has shape {shapes[k]} on this rank, expected {shape} (d_model "
                f"{d}, d_ff {f}, {num_experts} experts, {local} a rank; see init_moe_params)"
            )
    if x.shape[-1] != d:
        raise ValueError(f"jax_uccl_ep.{where}: x's last dimension is {x.shape[-1]}, the params' d_model {d}")


def moe_ffn_local(params: Params, x: jax.Array, config: MoEConfig, *, axis_name: str | tuple[str, ...]) -> MoEOutput:
    """The layer on this rank's shard, inside a ``jax.shard_map`` over `axis_name`: `params` holds this rank's
    experts ([E/R, ...]) and the router; ``x [..., D]`` this rank's tokens. stats hold this rank's counts ([1]
    rows, [E] pairs), aux_loss this rank's loss (moe_ffn averages both over the axis).

    On CPU devices XLA may start an all-reduce on some devices while their peers wait in an EP op, and stop (a
    (dp 2, ep 4) mesh of 8 devices: 1 training step in 10 with moe_ffn_local in the user's shard_map, about half
    with moe_ffn's own statistics), so there the layer orders what touches it after its EP ops: whatever reads its
    outputs comes after combine, and its parameters' gradients reduce over the other axes x varies over (a
    data-parallel axis) after the last EP op of the backward pass. The model's other collectives are the model's
    to order (docs/RELIABILITY.md). GPUs run each device's ops in one order, the same on every device."""
    _check_params(params, x, config.num_experts, axis_name, "moe_ffn_local")
    ordered = _orders_collectives_after_ep_ops()
    if ordered:
        params, x = _tied_to_tokens(params, x, axis_name)
    out = _moe_ffn_local(params, x, config, axis_name)
    return jax.lax.optimization_barrier(out) if ordered else out


def _orders_collectives_after_ep_ops() -> bool:
    """Whether the layer orders XLA's collectives after its EP ops: on CPU devices (the runtime's platform, or JAX's
    default backend before initialize())."""
    plan = _plan.current()
    return (plan.platform if plan is not None else jax.default_backend()) == "cpu"


def _tied_to_tokens(params: Params, x: jax.Array, axis_name: str | tuple[str, ...]) -> tuple[Params, jax.Array]:
    """The parameters made varying over the axes other than `axis_name` that x varies over (their gradients then
    reduce over those axes where this cast's transpose runs, after the layer's backward, rather than where the
    weights first meet the tokens inside it), then tied to x by a barrier."""
    others = tuple(sorted(a for a in varying_axes(x) if a not in axes_of(axis_name)))
    return jax.lax.optimization_barrier((mark_varying(params, others), x))


def _moe_ffn_local(params: Params, x: jax.Array, config: MoEConfig, axis_name: str | tuple[str, ...]) -> MoEOutput:
    lead, d = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d)
    with jax.named_scope(SCOPES["router"]):
        weights, idx, scores = route(params["router"], tokens, config)
        aux, per_expert = _routing_stats(scores, idx, config)
    capacity = None
    ranks = jax.lax.axis_size(axis_name)
    if config.capacity_factor is not None:
        capacity = capacity_for(tokens.shape[0], config.top_k, ranks, config.capacity_factor, config.num_experts)
    dtype = config.experts_dtype(params["w_gate"].dtype)
    small = load_sized_pairs(config, tokens.shape[0], ranks)
    if small is not None:
        y, rows, dropped = _moe_ffn_load_sized(params, tokens, weights, idx, small, dtype, config, axis_name)
        return MoEOutput(y.astype(x.dtype).reshape(*lead, d), aux, MoEStats(rows, dropped, per_expert))
    with jax.named_scope(SCOPES["dispatch"]):
        res = dispatch(
            tokens.astype(dtype),
            idx,
            weights,
            num_experts=config.num_experts,
            axis_name=axis_name,
            capacity=capacity,
            overflow=config.overflow,
            use_fp8=config.fp8_dispatch,
            layout="expert",
            zero_padding=False,  # every consumer below reads only the groups' rows
        )
    pairs = cast(jax.Array, res.x)  # x went in as one array (use_fp8 casts on the way): its pairs come back as one
    with jax.named_scope(SCOPES["experts"]):
        # Each pair weighted by its router weight between the matmuls; combine sums the pairs in float32.
        y = _weighted_swiglu_pairs(
            params, pairs, res.num_tokens_per_expert, cast(jax.Array, res.weights), dtype, config.grouped_matmul
        )
    with jax.named_scope(SCOPES["combine"]):
        y = combine(y, res.handle).astype(x.dtype).reshape(*lead, d)
    return MoEOutput(y, aux, MoEStats(res.num_tokens.reshape(1), res.num_dropped.reshape(1), per_expert))


def _moe_ffn_load_sized(
    params, tokens, weights, idx, small, dtype, config, axis_name
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """moe_ffn_local's never-dropping layer with MoEConfig.pair_buffer_factor: token rows dispatched (they never
    drop), the experts on a pair buffer of `small` pairs while this rank's pairs fit in it (swiglu_experts), each
    row's weighted sum sent back once. (y [T, D], rows received [1], pairs dropped [1]: none)."""
    with jax.named_scope(SCOPES["dispatch"]):
        res = dispatch(
            tokens.astype(dtype),  # the rows travel in the experts' dtype
            idx,
            weights,
            num_experts=config.num_experts,
            axis_name=axis_name,
            use_fp8=config.fp8_dispatch,
        )
    rows = cast(jax.Array, res.x)  # one array in, one back (use_fp8 casts on the way)
    with jax.named_scope(SCOPES["experts"]):  # the pair layout too: swiglu_experts lays its pairs out itself
        y = swiglu_experts(
            params,
            rows,
            res.topk_idx,
            res.topk_weights,
            num_rows=res.num_tokens,
            pair_buffer=small,
            compute_dtype=dtype,
            backend=config.grouped_matmul,
        )
    with jax.named_scope(SCOPES["combine"]):
        y = combine(y.astype(dtype), res.handle)
    return y, res.num_tokens.reshape(1), res.num_dropped.reshape(1)


def _token_axes(spec: P, axis_name: str, ndim: int) -> tuple[str, ...]:
    """The mesh axes `spec` (x's PartitionSpec) splits x's tokens over; it must split them over `axis_name` and must
    not split D (x's last dimension)."""
    entries = tuple(spec)
    check(
        len(entries) < ndim or entries[ndim - 1] is None,
        f"token_spec {spec} splits D, x's last dimension: the layer needs whole rows of x on every rank",
    )
    axes: list[str] = []
    for entry in entries[: ndim - 1]:
        for a in entry if isinstance(entry, tuple) else (entry,):
            if a is not None and a not in axes:
                axes.append(a)
    check(
        axis_name in axes,
        f"token_spec {spec} does not split x's tokens over the EP axis {axis_name!r}: every EP rank routes its own "
        "tokens (P(axis_name), or with a data-parallel axis P(('dp', axis_name)))",
    )
    return tuple(axes)


def moe_ffn(
    params: Params,
    x: jax.Array,
    *,
    mesh: Mesh,
    config: MoEConfig,
    axis_name: str = "ep",
    token_spec: P | None = None,
) -> MoEOutput:
    """The expert-parallel layer on global arrays: opens a ``jax.shard_map`` over `mesh` and runs
    ``moe_ffn_local`` on every rank.

    Args:
      params: global parameters (``init_moe_params``), laid out by ``moe_param_specs(axis_name)`` or replicated.
      x: ``[B, ..., D]`` activations; by default the first dimension is split over `axis_name` (every rank routes
        its own tokens). `token_spec` gives another PartitionSpec for x (its leading dimensions must be split over
        `axis_name` in some way, and no dimension may split D).
      config: the layer's MoEConfig.
      axis_name: the EP mesh axis (its size must divide num_experts).

    Returns:
      MoEOutput: y like x; aux_loss averaged over the ranks that route tokens (each computes it over its own
      tokens); stats.rows_received [R] and stats.pairs_dropped [R] of each EP rank, and stats.tokens_per_expert [E],
      summed over the other mesh axes that split the tokens (a data-parallel axis in token_spec).
    """
    spec = token_spec if token_spec is not None else P(axis_name)
    token_axes = _token_axes(spec, axis_name, x.ndim)
    others = tuple(a for a in token_axes if a != axis_name)

    # On CPU devices moe_ffn_local puts the statistics' reductions below (they read its outputs) and its parameters'
    # gradient reductions after its EP ops (tests/stress/collectives_beside_ep_ops.py).
    def body(p, x):
        out = moe_ffn_local(p, x, config, axis_name=axis_name)
        aux = jax.lax.pmean(out.aux_loss, token_axes)
        per_expert = jax.lax.psum(out.stats.tokens_per_expert, token_axes)
        rows, dropped = out.stats.rows_received, out.stats.pairs_dropped
        if others:
            rows, dropped = jax.lax.psum(rows, others), jax.lax.psum(dropped, others)
        return out.y, aux, rows, dropped, per_expert

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(moe_param_specs(axis_name), spec),
        out_specs=(spec, P(), P(axis_name), P(axis_name), P()),
    )
    y, aux, rows, dropped, per_expert = f(params, x)
    return MoEOutput(y, aux, MoEStats(rows, dropped, per_expert))


def moe_ffn_reference(params: Params, x: jax.Array, config: MoEConfig) -> MoEOutput:
    """The same layer without expert parallelism: every expert on every token (all parameters in one place),
    masked by the router's choice. For parity tests; ``E`` times the expert FLOPs."""
    lead, d = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d)
    weights, idx, scores = route(params["router"], tokens, config)
    gate = jnp.einsum("td,edf->etf", tokens, params["w_gate"], preferred_element_type=jnp.float32)
    up = jnp.einsum("td,edf->etf", tokens, params["w_up"], preferred_element_type=jnp.float32)
    h = (jax.nn.silu(gate) * up).astype(x.dtype)
    out = jnp.einsum("etf,efd->etd", h, params["w_down"], preferred_element_type=jnp.float32)
    coef = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(idx, config.num_experts, dtype=jnp.float32))
    y = jnp.einsum("te,etd->td", coef, out).astype(x.dtype).reshape(*lead, d)
    aux, per_expert = _routing_stats(scores, idx, config)
    none = jnp.zeros((0,), jnp.int32)
    return MoEOutput(y, aux, MoEStats(none, none, per_expert))


def moe_ffn_decode(
    params: Params,
    x: jax.Array,
    config: MoEConfig,
    *,
    axis_name: str | tuple[str, ...],
    max_tokens_per_rank: int,
    use_fp8: bool = True,
) -> jax.Array:
    """The layer for decoding, inside a ``jax.shard_map``: low-latency dispatch (FP8 rows by default, else rows in
    the experts' dtype, as moe_ffn's) into static
    per-expert buffers, the local experts over them (`swiglu_expert_slots`: the grouped matmul on the rows received
    where its Mosaic kernels run, batched matmuls over the slots elsewhere) in ``config.compute_dtype``, low-latency
    combine weighted by the router: the dispatch carries the router weights, so each expert's rank weights and sums a
    token's rows and returns one row per token and rank. ``x [..., D]`` with at most `max_tokens_per_rank` tokens.
    Forward only."""
    _check_params(params, x, config.num_experts, axis_name, "moe_ffn_decode")
    lead, d = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d)
    weights, idx, _ = route(params["router"], tokens, config)
    dtype = config.experts_dtype(params["w_gate"].dtype)
    rows_dtype = summed_row_dtype(dtype)  # the experts' dtype, as moe_ffn's rows, where low latency takes it
    recv, count, handle = low_latency_dispatch(
        tokens.astype(rows_dtype),
        idx,
        num_experts=config.num_experts,
        max_tokens_per_rank=max_tokens_per_rank,
        axis_name=axis_name,
        use_fp8=use_fp8,
        topk_weights=weights,
    )
    if isinstance(recv, tuple):  # use_fp8: FP8 rows and their scales
        from .fp8 import per_token_cast_back

        rows, scales = recv
        local, slots = rows.shape[:2]
        rows = per_token_cast_back(rows.reshape(local * slots, d), scales.reshape(local * slots, -1))
        rows = rows.reshape(local, slots, d).astype(dtype)
    else:
        rows = recv
    y = swiglu_expert_slots(params, rows, count, compute_dtype=dtype, backend=config.grouped_matmul)
    return low_latency_combine(y.astype(rows_dtype), idx, None, handle).astype(x.dtype).reshape(*lead, d)
