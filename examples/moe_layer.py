"""Baselines for the package's MoE layer: the same function with JAX's own collectives instead of jax_uccl_ep.

``jax_uccl_ep.layers`` is the MoE feed-forward block this example trains and the benchmarks time: its router
(``route``), SwiGLU experts as grouped matmuls (``swiglu_experts``), load-balancing loss, the expert-parallel layer
(``moe_ffn_local`` inside a ``shard_map``), the dense reference (``moe_ffn_reference``) and the low-latency decode
layer (``moe_ffn_decode``). This module holds only what the package does not provide, for comparison:

* ``moe_ffn_all_to_all``: expert parallelism with ``jax.lax.all_to_all`` on a fixed-capacity ``[R, C, D]`` buffer
  (GShard / MaxText's dropping path): every (token, expert) slot gets a row in a static buffer.
* ``moe_ffn_ragged``: expert parallelism with ``jax.lax.ragged_all_to_all`` (MaxText's dropless path): slots sorted
  by expert, exact ragged chunks. XLA:CPU has no ragged-all-to-all (jax 0.10): this one needs GPUs or TPUs.

and the glue that lets a script pick any of them by name (``LAYERS``, ``local_layer``), with ``moe_ffn_dense``
running the package's dense reference inside a ``shard_map``.

Every layer here takes what ``jax_uccl_ep.layers.moe_ffn_local`` takes, ``(params, x, config, *, axis_name)`` with
``params`` this rank's shard of ``layers.init_moe_params`` (laid out by ``layers.moe_param_specs``), ``x [..., D]``
this rank's tokens and a ``layers.MoEConfig``, and returns a ``layers.MoEOutput``; all compute the package's
function (its router, SwiGLU experts and this rank's load-balancing loss), so their outputs, gradients and training
curves agree to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_uccl_ep import layers
from jax_uccl_ep.layers import MoEConfig, MoEOutput, MoEStats

Params = dict[str, jax.Array]
LocalLayer = Callable[..., MoEOutput]


def _local_experts(fn: str, params: Params, config: MoEConfig, axis_name: str) -> tuple[int, int]:
    """(experts per rank, ranks) after checking that the expert weights are sharded over ``axis_name``."""
    local_experts = params["w_gate"].shape[0]
    num_ranks = jax.lax.axis_size(axis_name)
    if local_experts * num_ranks != config.num_experts:
        raise ValueError(
            f"{fn}: w_gate holds {local_experts} experts on each of {num_ranks} ranks, expected "
            f"num_experts / R = {config.num_experts} / {num_ranks}; shard the expert weights over '{axis_name}' "
            "(layers.moe_param_specs)"
        )
    return local_experts, num_ranks


def _routing(params: Params, tokens: jax.Array, config: MoEConfig) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The package's router on ``tokens [T, D]`` and its loss: (weights [T, K], expert indices [T, K], this rank's
    weighted load-balancing loss (0 without ``config.aux_loss_coef``), (token, slot) pairs per expert [E])."""
    weights, idx, scores = layers.route(params["router"], tokens, config)
    per_expert = jnp.bincount(idx.reshape(-1), length=config.num_experts).astype(jnp.int32)
    aux = jnp.zeros((), jnp.float32)
    if config.aux_loss_coef:
        aux = config.aux_loss_coef * layers.load_balancing_loss(scores, per_expert)
    return weights, idx, aux, per_expert


def _exclusive_cumsum(a: jax.Array, axis: int = 0) -> jax.Array:
    """``[0, a0, a0 + a1, ...]`` along ``axis`` (same shape as ``a``)."""
    return jnp.cumsum(a, axis=axis) - a


def all_to_all_capacity(tokens: int, config: MoEConfig, num_ranks: int) -> int:
    """``moe_ffn_all_to_all``'s slots per (sender, receiver) for ``config.capacity_factor``: the factor times the
    slots a rank sends each rank on average (``tokens * top_k / R``), at least 1 and at most ``tokens * top_k``
    (all of a rank's slots; never drops). None as the factor gives that maximum."""
    slots = tokens * config.top_k
    if config.capacity_factor is None:
        return slots
    if config.capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {config.capacity_factor}")
    return max(1, min(slots, math.ceil(config.capacity_factor * slots / num_ranks)))


def moe_ffn_all_to_all(
    params: Params, x: jax.Array, config: MoEConfig, *, axis_name: str, capacity: int | None = None
) -> MoEOutput:
    """The package's layer with ``jax.lax.all_to_all`` on a fixed-capacity buffer (GShard / MaxText style).

    Each rank puts every (token, expert) slot of its tokens in a static send buffer ``[R, C, D]``: block ``j``
    holds, in token order, the slots whose expert lives on rank ``j``. One ``all_to_all`` delivers block ``j`` to
    rank ``j`` (with each row's local expert index beside it), the local experts run on the ``R * C`` received rows,
    a second ``all_to_all`` sends the outputs back to the same rows of the sender's buffer, and each token sums its
    slots' outputs weighted by the router. A token whose two slots go to the same rank travels twice
    (``dispatch`` sends it once).

    Args:
      params, x, config, axis_name: as ``layers.moe_ffn_local`` (call inside ``jax.shard_map``).
      capacity: ``C``, slots a rank may send to each rank; None takes it from ``config.capacity_factor``
        (``all_to_all_capacity``; no factor: ``T * top_k``, which never drops). The slots past the first ``C`` for
        a destination (in token order) are dropped: they add nothing to their token's output.

    Returns:
      MoEOutput: y like x; this rank's aux loss; stats: [1] slots this rank received, [1] slots of this rank
      dropped (counted where they were sent from, not where they would have arrived), [E] this rank's routing counts.
    """
    local_experts, num_ranks = _local_experts("moe_ffn_all_to_all", params, config, axis_name)
    lead, d_model = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d_model)
    top_k = config.top_k
    slots = tokens.shape[0] * top_k
    c = all_to_all_capacity(tokens.shape[0], config, num_ranks) if capacity is None else capacity
    weights, idx, aux, per_expert = _routing(params, tokens, config)

    # 1. A row of the send buffer for each slot: block = destination rank, position = how many earlier slots
    #    (in token order) go to the same rank. Slots at position >= C get the row R * C, which scatters drop.
    expert = idx.reshape(slots)
    dest = expert // local_experts
    to_dest = jax.nn.one_hot(dest, num_ranks, dtype=jnp.int32)  # [S, R]
    position = jnp.sum(_exclusive_cumsum(to_dest, axis=0) * to_dest, axis=1)  # [S]
    row = jnp.where(position < c, dest * c + position, num_ranks * c)  # [S]
    token = jnp.arange(slots) // top_k
    send_x = jnp.zeros((num_ranks * c, d_model), x.dtype).at[row].set(tokens[token], mode="drop")
    send_expert = jnp.full((num_ranks * c,), -1, jnp.int32).at[row].set(expert % local_experts, mode="drop")

    # 2. Block j to rank j: rank j receives [R * C, D], C rows from each source rank, and their local experts.
    recv_x = jax.lax.all_to_all(send_x, axis_name, 0, 0, tiled=True)
    recv_expert = jax.lax.all_to_all(send_expert, axis_name, 0, 0, tiled=True)

    # 3. Local experts, unweighted (the router weights stay home); empty rows (expert -1) give zeros.
    y = layers.swiglu_experts(params, recv_x, recv_expert[:, None])[:, 0]  # [R * C, D] float32

    # 4. Back to the sender's rows; each slot reads its row (dropped slots read zeros) and tokens sum their slots.
    back = jax.lax.all_to_all(y.astype(x.dtype), axis_name, 0, 0, tiled=True)  # [R * C, D]
    slot_out = back.at[row].get(mode="fill", fill_value=0).reshape(-1, top_k, d_model)
    out = jnp.einsum("tk,tkd->td", weights, slot_out.astype(jnp.float32)).astype(x.dtype)
    received = jnp.sum(recv_expert >= 0).astype(jnp.int32).reshape(1)
    dropped = jnp.sum(position >= c).astype(jnp.int32).reshape(1)
    return MoEOutput(out.reshape(*lead, d_model), aux, MoEStats(received, dropped, per_expert))


def moe_ffn_ragged(params: Params, x: jax.Array, config: MoEConfig, *, axis_name: str) -> MoEOutput:
    """The package's layer with ``jax.lax.ragged_all_to_all`` (MaxText's dropless path); never drops.

    Each rank sorts its ``T * top_k`` (token, expert) slots by expert, so the slots for rank ``j``'s experts form
    one contiguous chunk. The ranks all-gather their per-expert counts (``[R, E]`` int32, tiny), from which every
    rank derives the sizes and offsets of every chunk. One ``ragged_all_to_all`` moves the chunks (exact rows, no
    padding on the wire) into a receive buffer ordered by source rank, then by local expert; the local experts run
    as grouped matmuls; a second ``ragged_all_to_all`` returns the outputs to the rows they came from; the sender
    un-sorts them and sums each token's slots weighted by the router.

    The receive buffer is static: ``R * T * top_k`` rows, the most a rank can get. XLA:CPU does not implement
    ragged-all-to-all (jax 0.10): run this on GPUs or TPUs. ``config.capacity_factor`` is ignored.

    Args:
      params, x, config, axis_name: as ``layers.moe_ffn_local`` (call inside ``jax.shard_map``).

    Returns:
      MoEOutput: y like x; this rank's aux loss; stats: [1] slots this rank received, [1] zero (dropless), [E] this
      rank's routing counts.
    """
    local_experts, num_ranks = _local_experts("moe_ffn_ragged", params, config, axis_name)
    lead, d_model = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d_model)
    top_k = config.top_k
    slots = tokens.shape[0] * top_k
    recv_rows = num_ranks * slots
    weights, idx, aux, per_expert = _routing(params, tokens, config)

    # 1. Slots sorted by expert: experts of rank j are [j * E/R, (j+1) * E/R), so the chunk for rank j is contiguous.
    expert = idx.reshape(slots)
    order = jnp.argsort(expert, stable=True)  # sorted position -> slot
    send_x = tokens[order // top_k]  # [S, D]

    # 2. Sizes and offsets. counts[i, e]: slots of rank i for expert e; sent[i, j]: rows rank i sends to rank j.
    counts = jax.lax.all_gather(per_expert, axis_name)  # [R, E]
    sent = counts.reshape(num_ranks, num_ranks, local_experts).sum(axis=-1)  # [src, dst]
    me = jax.lax.axis_index(axis_name)
    send_sizes = sent[me]  # [R]: to each rank
    recv_sizes = sent[:, me]  # [R]: from each rank
    input_offsets = _exclusive_cumsum(send_sizes)  # where each chunk starts in send_x
    recv_offsets = _exclusive_cumsum(recv_sizes)  # where each source's chunk starts in the receive buffer
    output_offsets = _exclusive_cumsum(sent, axis=0)[me]  # where my chunk starts in each receiver's buffer
    home_offsets = _exclusive_cumsum(sent, axis=1)[:, me]  # where each source's chunk for me starts in its send_x

    # 3. Exchange: the receive buffer holds the chunks of rank 0, 1, ... at recv_offsets (padding rows are zeros).
    recv_x = jax.lax.ragged_all_to_all(
        send_x,
        jnp.zeros((recv_rows, d_model), x.dtype),
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        axis_name=axis_name,
    )

    # 4. The local expert of each received row: within a source's chunk, rows come sorted by expert, so the
    #    buffer is a sequence of (source, local expert) segments in source-major order; -1 past the last one.
    local_counts = jax.lax.dynamic_slice_in_dim(counts, me * local_experts, local_experts, axis=1)  # [src, E/R]
    segment_end = jnp.cumsum(local_counts.reshape(-1))  # [R * E/R]
    segment = jnp.searchsorted(
        segment_end, jnp.arange(recv_rows, dtype=jnp.int32), side="right", method="compare_all"
    )  # R * E/R segments: a few compares per row
    local_expert = jnp.where(segment < segment_end.shape[0], segment % local_experts, -1).astype(jnp.int32)
    y = layers.swiglu_experts(params, recv_x, local_expert[:, None])[:, 0]  # [R * S, D] float32, padding zeros

    # 5. The reverse exchange: source i's rows go back to where they started in its send_x.
    back = jax.lax.ragged_all_to_all(
        y.astype(x.dtype),
        jnp.zeros((slots, d_model), x.dtype),
        recv_offsets,
        recv_sizes,
        home_offsets,
        send_sizes,
        axis_name=axis_name,
    )

    # 6. Un-sort to slot order and sum each token's slots with its router weights.
    slot_out = back[jnp.argsort(order)].reshape(-1, top_k, d_model)
    out = jnp.einsum("tk,tkd->td", weights, slot_out.astype(jnp.float32)).astype(x.dtype)
    received = jnp.sum(recv_sizes).astype(jnp.int32).reshape(1)
    return MoEOutput(out.reshape(*lead, d_model), aux, MoEStats(received, jnp.zeros((1,), jnp.int32), per_expert))


def moe_ffn_dense(params: Params, x: jax.Array, config: MoEConfig, *, axis_name: str) -> MoEOutput:
    """``layers.moe_ffn_reference`` inside a ``jax.shard_map``: all-gathers the expert weights over ``axis_name``,
    then runs every expert on every one of this rank's tokens (no dispatch). Its aux loss is this rank's, as
    ``moe_ffn_local``'s is; stats.rows_received is empty."""
    _local_experts("moe_ffn_dense", params, config, axis_name)
    gathered = {
        name: value if name == "router" else jax.lax.all_gather(value, axis_name, tiled=True)
        for name, value in params.items()
    }
    return layers.moe_ffn_reference(gathered, x, config)


# The implementations a script picks by name; each (params, x, config, *, axis_name) -> MoEOutput on this rank.
LAYERS: dict[str, LocalLayer] = {
    "uccl": layers.moe_ffn_local,
    "all_to_all": moe_ffn_all_to_all,
    "ragged": moe_ffn_ragged,
    "dense": moe_ffn_dense,
}


def local_layer(impl: str, config: MoEConfig, *, axis_name: str) -> Callable[[Params, jax.Array], MoEOutput]:
    """``(params, x) -> MoEOutput`` of implementation `impl` (a key of ``LAYERS``) on this rank, inside a
    ``jax.shard_map`` over `axis_name`."""
    if impl not in LAYERS:
        raise ValueError(f"unknown MoE implementation {impl!r}; choose from {sorted(LAYERS)}")
    layer = LAYERS[impl]

    def call(params: Params, x: jax.Array) -> MoEOutput:
        return layer(params, x, config, axis_name=axis_name)

    return call
