"""Baselines for the package's MoE layer: the same function with JAX's own collectives instead of jax_uccl_ep.

``jax_uccl_ep.layers`` is the MoE feed-forward block this example trains and the benchmarks time: its router
(``route``), SwiGLU experts as grouped matmuls (``swiglu_experts``), load-balancing loss, the expert-parallel layer
(``moe_ffn_local`` inside a ``shard_map``), the dense reference (``moe_ffn_reference``) and the low-latency decode
layer (``moe_ffn_decode``). This module holds only what the package does not provide, for comparison:

* ``moe_ffn_all_to_all``: expert parallelism as MaxText runs it on GPUs: ``jax.lax.all_to_all`` of a
  fixed-capacity expert-major ``[E, C, D]`` buffer, the experts as batched matmuls (drops past the capacity).
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

import functools
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
    """``moe_ffn_all_to_all``'s slots per (sender, expert) for ``config.capacity_factor`` (MaxText's): the factor
    times the slots a rank sends each expert on average (``tokens * top_k / E``), at least 1 and at most ``tokens``
    (a token picks an expert once, so that never drops). None as the factor gives that maximum."""
    if config.capacity_factor is None:
        return tokens
    if config.capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {config.capacity_factor}")
    return max(1, min(tokens, math.ceil(config.capacity_factor * tokens * config.top_k / config.num_experts)))


def _batched_swiglu(params: Params, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The local experts on their own slots, as batched matmuls: ``x [E/R, C', D]`` -> ``[E/R, C', D]`` in
    `dtype`; zero rows (empty slots) give zeros."""
    gate = jnp.einsum("ecd,edf->ecf", x, params["w_gate"].astype(dtype))
    up = jnp.einsum("ecd,edf->ecf", x, params["w_up"].astype(dtype))
    h = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)
    return jnp.einsum("ecf,efd->ecd", h, params["w_down"].astype(dtype))


def moe_ffn_all_to_all(
    params: Params, x: jax.Array, config: MoEConfig, *, axis_name: str, capacity: int | None = None
) -> MoEOutput:
    """The package's layer as MaxText runs it on GPUs: a fixed-capacity expert-major buffer, ``jax.lax.all_to_all``,
    and the local experts as one batched matmul each (no grouped matmul).

    Each rank puts every (token, expert) slot of its tokens in a static send buffer ``[E, C, D]``: expert ``e``'s
    ``C`` slots hold, in token order, the first ``C`` tokens routed to it (the rest are dropped). One
    ``all_to_all`` delivers experts ``[j*E/R, (j+1)*E/R)``'s slots to rank ``j``, which runs each local expert on its
    ``R * C`` slots (``[E/R, R*C, D]``, batched einsums in ``config.experts_dtype``), a second ``all_to_all``
    sends the outputs back to the same slots, and each token sums its slots' outputs weighted by the router, in
    float32.

    Args:
      params, x, config, axis_name: as ``layers.moe_ffn_local`` (call inside ``jax.shard_map``).
      capacity: ``C``, slots a rank may send each expert; None takes it from ``config.capacity_factor``
        (``all_to_all_capacity``; no factor: ``T``, which never drops).

    Returns:
      MoEOutput: y like x; this rank's aux loss; stats: [1] slots this rank received, [1] slots of this rank
      dropped (counted where they were sent from, not where they would have arrived), [E] this rank's routing counts.
    """
    local_experts, num_ranks = _local_experts("moe_ffn_all_to_all", params, config, axis_name)
    lead, d_model = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d_model)
    top_k, num_experts = config.top_k, config.num_experts
    slots = tokens.shape[0] * top_k
    c = all_to_all_capacity(tokens.shape[0], config, num_ranks) if capacity is None else capacity
    dtype = config.experts_dtype(params["w_gate"].dtype)
    with jax.named_scope(layers.SCOPES["router"]):  # the layer's parts, as profiles name them
        weights, idx, aux, per_expert = _routing(params, tokens, config)

    # 1. A slot of the send buffer for each (token, expert): expert e's slots in token order; past C, the row E * C
    #    (out of range: the scatter drops it, the gather reads zeros).
    with jax.named_scope(layers.SCOPES["dispatch"]):
        expert = idx.reshape(slots)
        position = jnp.take_along_axis(
            _exclusive_cumsum(jax.nn.one_hot(expert, num_experts, dtype=jnp.int32)), expert[:, None], axis=1
        )[:, 0]
        row = jnp.where(position < c, expert * c + position, num_experts * c)  # [S]
        token = jnp.arange(slots) // top_k
        send = jnp.zeros((num_experts * c, d_model), dtype).at[row].set(tokens[token].astype(dtype), mode="drop")

        # 2. Rank j gets its experts' slots from every rank: [R, E/R, C, D] -> each local expert's R * C slots.
        recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)
        recv = recv.reshape(num_ranks, local_experts, c, d_model).transpose(1, 0, 2, 3)
    with jax.named_scope(layers.SCOPES["experts"]):
        out = _batched_swiglu(params, recv.reshape(local_experts, num_ranks * c, d_model), dtype)

    # 3. Back to the sender's slots; each (token, expert) reads its slot (dropped ones read zeros).
    with jax.named_scope(layers.SCOPES["combine"]):
        out = out.reshape(local_experts, num_ranks, c, d_model).transpose(1, 0, 2, 3)
        back = jax.lax.all_to_all(out.reshape(num_experts * c, d_model), axis_name, 0, 0, tiled=True)
        slot_out = back.at[row].get(mode="fill", fill_value=0).reshape(-1, top_k, d_model)
        y = jnp.einsum("tk,tkd->td", weights, slot_out, preferred_element_type=jnp.float32).astype(x.dtype)
    kept = (position < c).astype(jnp.int32)
    received = jax.lax.psum(jnp.zeros((num_ranks,), jnp.int32).at[expert // local_experts].add(kept), axis_name)
    received = jax.lax.dynamic_slice_in_dim(received, jax.lax.axis_index(axis_name), 1)
    dropped = jnp.sum(1 - kept).astype(jnp.int32).reshape(1)
    return MoEOutput(y.reshape(*lead, d_model), aux, MoEStats(received, dropped, per_expert))


def _ragged_rows(operand: jax.Array, plan: tuple[jax.Array, ...], rows: int, axis_name: str) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` of ``operand`` into ``rows`` zero rows by ``plan`` (input offsets, send sizes,
    output offsets, receive sizes)."""
    # Each rank's rows are its own, also where the operand (a cotangent) comes in marked invariant.
    out = jax.lax.pcast(jnp.zeros((rows, *operand.shape[1:]), operand.dtype), (axis_name,), to="varying")
    return jax.lax.ragged_all_to_all(operand, out, *plan, axis_name=axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ragged_exchange(
    operand: jax.Array, there: tuple[jax.Array, ...], back: tuple[jax.Array, ...], rows: tuple[int, int], axis_name: str
) -> jax.Array:
    """``_ragged_rows`` by ``there`` into ``rows[0]`` rows, whose gradient is the same exchange run by ``back`` into
    ``rows[1]`` rows (the operand's). Each rank already holds the reverse plan, so the backward pass runs no
    all_to_all of offsets. JAX's own transpose rule of ragged_all_to_all gave wrong gradients on GPUs (jax 0.11.2:
    the way back's, w_down's first), where the collective itself is right in both directions."""
    del back
    return _ragged_rows(operand, there, rows[0], axis_name)


def _ragged_exchange_fwd(operand, there, back, rows, axis_name):
    return _ragged_exchange(operand, there, back, rows, axis_name), (there, back)


def _ragged_exchange_bwd(rows, axis_name, residuals, cotangent):
    there, back = residuals
    operand_t = _ragged_rows(cotangent, back, rows[1], axis_name)
    return operand_t, tuple(None for _ in there), tuple(None for _ in back)


_ragged_exchange.defvjp(_ragged_exchange_fwd, _ragged_exchange_bwd)


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
    #    The way back (step 5) runs the same plan reversed, and each is the other's gradient.
    there = (input_offsets, send_sizes, output_offsets, recv_sizes)
    back = (recv_offsets, recv_sizes, home_offsets, send_sizes)
    recv_x = _ragged_exchange(send_x, there, back, (recv_rows, slots), axis_name)

    # 4. The local expert of each received row: within a source's chunk, rows come sorted by expert, so the
    #    buffer is a sequence of (source, local expert) segments in source-major order; -1 past the last one.
    local_counts = jax.lax.dynamic_slice_in_dim(counts, me * local_experts, local_experts, axis=1)  # [src, E/R]
    segment_end = jnp.cumsum(local_counts.reshape(-1))  # [R * E/R]
    segment = jnp.searchsorted(
        segment_end, jnp.arange(recv_rows, dtype=jnp.int32), side="right", method="compare_all"
    )  # R * E/R segments: a few compares per row
    local_expert = jnp.where(segment < segment_end.shape[0], segment % local_experts, -1).astype(jnp.int32)
    dtype = config.experts_dtype(params["w_gate"].dtype)
    y = layers.swiglu_experts(
        params, recv_x, local_expert[:, None], compute_dtype=dtype, backend=config.grouped_matmul
    )  # [R * S, D] float32, padding zeros

    # 5. The reverse exchange: source i's rows go back to where they started in its send_x.
    returned = _ragged_exchange(y.astype(x.dtype), back, there, (slots, recv_rows), axis_name)

    # 6. Un-sort to slot order and sum each token's slots with its router weights.
    slot_out = returned[jnp.argsort(order)].reshape(-1, top_k, d_model)
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
