"""A Mixture-of-Experts feed-forward layer in plain JAX, with expert parallelism through jax_uccl_ep.

The layer is a pure function of a parameter pytree, so Flax (``nn.Module`` holding the arrays), Equinox or plain
JAX code can call it. Four formulations of the same math are provided:

* ``moe_ffn``: the expert-parallel layer. Each rank of the EP mesh axis holds ``num_experts / R`` experts; tokens
  travel to the ranks that own their experts with ``jax_uccl_ep.dispatch`` and come back with
  ``jax_uccl_ep.combine``. Call it inside ``jax.shard_map``.
* ``moe_ffn_all_to_all``: the same expert parallelism with ``jax.lax.all_to_all`` on a fixed-capacity buffer
  (GShard / MaxText's dropping path): every (token, expert) slot gets a row in a static ``[R, C, D]`` buffer.
* ``moe_ffn_ragged``: the same with ``jax.lax.ragged_all_to_all`` (MaxText's dropless path): slots sorted by expert,
  exact ragged chunks, grouped matmuls. XLA:CPU has no ragged-all-to-all (jax 0.10): this one needs GPUs or TPUs.
* ``moe_ffn_low_latency``: inference/decoding with ``jax_uccl_ep.low_latency_dispatch`` / ``low_latency_combine``:
  each token goes to each chosen expert's slot in static expert-major buffers (the same shapes every step), the
  experts run batched per expert, and combine applies the router weights. Forward only (no VJP).
* ``moe_ffn_dense``: the reference. It gathers every expert's weights and evaluates every expert on every token,
  masking with the router's choice. No dispatch, the same result up to float rounding; use it for parity tests.

The three expert-parallel layers can evaluate their local experts two ways (``expert_compute``): "masked" runs
every local expert on every received row and keeps the chosen (row, expert) pairs (simple, ``E/R`` times the
FLOPs); "grouped" sorts the (row, expert) pairs by expert and runs grouped matmuls (``jax.lax.ragged_dot``).

For a token ``x`` the layer computes ``sum_k w_k * expert_{i_k}(x)`` where ``(i_k, w_k)`` are the router's top-k
experts and their weights (renormalized to sum to one), and ``expert_e(x) = gelu(x @ w1[e]) @ w2[e]``.

Parameters (global shapes; inside shard_map the expert weights have ``num_experts / R`` rows)::

    {"router": [d_model, num_experts],           # replicated
     "w1":     [num_experts, d_model, d_ff],     # sharded over the EP axis (moe_param_specs)
     "w2":     [num_experts, d_ff, d_model]}     # sharded over the EP axis
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_uccl_ep as ep

Params = dict[str, jax.Array]
ExpertCompute = Literal["masked", "grouped"]


def init_moe_params(key: jax.Array, *, d_model: int, d_ff: int, num_experts: int, dtype: Any = jnp.float32) -> Params:
    """Random parameters of one MoE layer (global shapes: all ``num_experts`` experts)."""
    k_router, k_w1, k_w2 = jax.random.split(key, 3)
    return {
        "router": jax.random.normal(k_router, (d_model, num_experts), dtype) * d_model**-0.5,
        "w1": jax.random.normal(k_w1, (num_experts, d_model, d_ff), dtype) * d_model**-0.5,
        "w2": jax.random.normal(k_w2, (num_experts, d_ff, d_model), dtype) * d_ff**-0.5,
    }


def moe_param_specs(axis_name: str) -> dict[str, P]:
    """PartitionSpecs of the parameters: the router is replicated, experts are split over ``axis_name``."""
    return {"router": P(), "w1": P(axis_name), "w2": P(axis_name)}


def route(router: jax.Array, x: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """The router: linear -> softmax -> top-k, weights renormalized to sum to one.

    Returns:
      (topk_weights [T, K] float32, topk_idx [T, K] int32 global expert indices).
    """
    logits = jnp.dot(x, router, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top_probs, top_idx = jax.lax.top_k(probs, top_k)
    weights = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
    return weights, top_idx.astype(jnp.int32)


def expert_mlp(w1: jax.Array, w2: jax.Array, x: jax.Array) -> jax.Array:
    """Every expert of ``w1 [E, D, F]``, ``w2 [E, F, D]`` applied to every row of ``x [N, D]``: ``[E, N, D]``."""
    h = jax.nn.gelu(jnp.einsum("nd,edf->enf", x, w1))
    return jnp.einsum("enf,efd->end", h, w2)


def slot_weights(topk_idx: jax.Array, topk_weights: jax.Array, num_experts: int) -> jax.Array:
    """``[N, E]``: for each row, the router weight of each expert (summed over its top-k slots; 0 if unchosen).

    Slots with index -1 (unused, or an expert on another rank after dispatch) match no column and so add nothing.
    """
    one_hot = jax.nn.one_hot(topk_idx, num_experts, dtype=topk_weights.dtype)  # [N, K, E]; -1 -> all zeros
    return jnp.einsum("nk,nke->ne", topk_weights, one_hot)


def grouped_expert_mlp(w1: jax.Array, w2: jax.Array, x: jax.Array, expert: jax.Array) -> jax.Array:
    """Each row of ``x [N, D]`` through its chosen experts only, with grouped matmuls: ``[N, S, D]``.

    ``expert [N, S]`` holds, for each row, S expert indices into ``w1 [G, D, F]`` / ``w2 [G, F, D]`` (-1: none).
    The (row, slot) pairs are sorted by expert so that each expert's rows are contiguous, both matmuls run as
    ``jax.lax.ragged_dot`` over those groups, and the outputs are put back in (row, slot) order. Pairs with -1
    sort last, belong to no group and come out as zeros.
    """
    n, s = expert.shape
    groups = w1.shape[0]
    flat = expert.reshape(n * s)
    key = jnp.where(flat < 0, groups, flat)  # unused pairs after every group
    order = jnp.argsort(key, stable=True)  # pair indices, by expert
    group_sizes = jnp.bincount(key, length=groups).astype(jnp.int32)  # counts of key == groups are left out
    rows = x[order // s]  # [N * S, D]
    h = jax.nn.gelu(jax.lax.ragged_dot(rows, w1, group_sizes))
    y = jax.lax.ragged_dot(h, w2, group_sizes)  # rows past sum(group_sizes) are zeros
    y = jnp.where((key[order] < groups)[:, None], y, 0)
    return y[jnp.argsort(order)].reshape(n, s, -1)  # back to (row, slot) order


def apply_local_experts(
    w1: jax.Array,
    w2: jax.Array,
    x: jax.Array,
    expert: jax.Array,
    weights: jax.Array,
    expert_compute: ExpertCompute,
) -> jax.Array:
    """``sum_s weights[n, s] * expert_{expert[n, s]}(x[n])`` for every row ``n`` of ``x [N, D]``, float32 ``[N, D]``.

    ``expert [N, S]``: indices into the local experts ``w1 [G, D, F]``, ``w2 [G, F, D]``, -1 for none (adds 0).
    ``expert_compute``: "masked" evaluates every expert on every row and weights with a ``[N, G]`` matrix that is
    zero for unchosen pairs (``G`` times the FLOPs of the chosen pairs); "grouped" evaluates only the chosen pairs
    (``grouped_expert_mlp``).
    """
    if expert_compute == "masked":
        out = expert_mlp(w1, w2, x)  # [G, N, D]
        coef = slot_weights(expert, weights.astype(jnp.float32), w1.shape[0])  # [N, G]
        return jnp.einsum("ng,gnd->nd", coef, out.astype(jnp.float32))
    if expert_compute == "grouped":
        out = grouped_expert_mlp(w1, w2, x, expert)  # [N, S, D]
        return jnp.einsum("ns,nsd->nd", weights.astype(jnp.float32), out.astype(jnp.float32))
    raise ValueError(f"expert_compute must be 'masked' or 'grouped', got {expert_compute!r}")


def _local_experts(fn: str, params: Params, num_experts: int, axis_name: str) -> tuple[int, int]:
    """(experts per rank, ranks) after checking that the expert weights are sharded over ``axis_name``."""
    local_experts = params["w1"].shape[0]
    num_ranks = jax.lax.axis_size(axis_name)
    if local_experts * num_ranks != num_experts:
        raise ValueError(
            f"{fn}: w1 holds {local_experts} experts on each of {num_ranks} ranks, expected "
            f"num_experts / R = {num_experts} / {num_ranks}; shard the expert weights over '{axis_name}'"
        )
    return local_experts, num_ranks


def _exclusive_cumsum(a: jax.Array, axis: int = 0) -> jax.Array:
    """``[0, a0, a0 + a1, ...]`` along ``axis`` (same shape as ``a``)."""
    return jnp.cumsum(a, axis=axis) - a


def moe_ffn(
    params: Params,
    x: jax.Array,
    *,
    num_experts: int,
    top_k: int,
    axis_name: str,
    capacity: int | None = None,
    expert_compute: ExpertCompute = "masked",
) -> jax.Array:
    """The expert-parallel MoE feed-forward layer (call inside ``jax.shard_map`` over ``axis_name``).

    Args:
      params: this rank's shard of the layer's parameters: ``router [D, E]`` (replicated), ``w1 [E/R, D, F]``,
        ``w2 [E/R, F, D]`` (the experts this rank owns: global experts ``[r*E/R, (r+1)*E/R)``).
      x: ``[T, D]`` this rank's tokens, float32 or bfloat16.
      num_experts: total number of experts E (divisible by the axis size R).
      top_k: experts per token.
      axis_name: the EP mesh axis.
      capacity: rows each rank can receive; None (the default) is ``R * T``, which never drops a token.
      expert_compute: "masked" (every local expert on every received row) or "grouped" (ragged_dot over the
        chosen pairs); see ``apply_local_experts``.

    Returns:
      ``[T, D]``: for each token, the router-weighted sum of its top-k experts' outputs.
    """
    _local_experts("moe_ffn", params, num_experts, axis_name)
    weights, idx = route(params["router"], x, top_k)

    # 1. Send each token to every rank that owns one of its experts. On arrival, recv_idx holds *local* expert
    #    indices (-1 for slots owned elsewhere) and recv_weights the matching router weights (0 elsewhere).
    recv = ep.dispatch(x, idx, weights, num_experts=num_experts, axis_name=axis_name, capacity=capacity)
    recv_x, recv_idx, recv_weights, handle = recv.x, recv.topk_idx, recv.topk_weights, recv.handle

    # 2. Run the local experts, weighted. "masked" (the default): for clarity every local expert sees every
    #    received row (padding rows included) and a [rows, local_experts] weight matrix keeps only the chosen
    #    (row, expert) pairs. That costs local_experts times the FLOPs of the chosen pairs: fine for a few experts
    #    per rank. "grouped" sorts the pairs by expert and uses grouped matmuls (jax.lax.ragged_dot) instead.
    y = apply_local_experts(params["w1"], params["w2"], recv_x, recv_idx, recv_weights, expert_compute)
    y = y.astype(x.dtype)

    # 3. Send the weighted rows home; combine sums the copies of each token (one per rank it visited).
    return ep.combine(y, handle)


def moe_ffn_low_latency(
    params: Params,
    x: jax.Array,
    *,
    num_experts: int,
    top_k: int,
    axis_name: str,
    max_tokens_per_rank: int | None = None,
    use_fp8: bool = False,
) -> jax.Array:
    """The MoE feed-forward for decoding (call inside ``jax.shard_map``): ``moe_ffn``'s math through low-latency
    mode. Forward only.

    Args:
      params, x, num_experts, top_k, axis_name: as ``moe_ffn`` (``x [T, D]`` this rank's tokens).
      max_tokens_per_rank: N, the static token budget per rank (default T); every step with at most N tokens
        uses the same buffers, as a decode loop or a CUDA graph wants.
      use_fp8: send tokens as FP8 with per-128-channel scales (dequantized before the experts).

    Returns:
      ``[T, D]`` in x's dtype.
    """
    local_experts, num_ranks = _local_experts("moe_ffn_low_latency", params, num_experts, axis_name)
    weights, idx = route(params["router"], x, top_k)
    n = max_tokens_per_rank or x.shape[0]
    # 1. Every (token, expert) pair lands in that expert's slab: recv [L, R * N, D], rows [0, count[l]) valid.
    recv, _, handle = ep.low_latency_dispatch(
        x, idx, num_experts=num_experts, max_tokens_per_rank=n, axis_name=axis_name, use_fp8=use_fp8
    )
    if use_fp8:
        rows, scales = recv
        slab = rows.shape[1]
        recv = ep.per_token_cast_back(rows.reshape(local_experts * slab, -1), scales.reshape(local_experts * slab, -1))
        recv = recv.reshape(local_experts, slab, -1)
    # Rows [recv_count[l], R * N) are padding (zeros on CPU devices, not written on GPUs): the experts run on them too,
    # since the shapes are static, and combine never reads their outputs; zeroing them would cost a pass over
    # the whole slab every step.
    recv = recv.astype(x.dtype)
    # 2. Each local expert on its own slab: [L, R * N, D].
    h = jax.nn.gelu(jnp.einsum("lnd,ldf->lnf", recv, params["w1"]))
    y = jnp.einsum("lnf,lfd->lnd", h, params["w2"]).astype(x.dtype)
    # 3. Back to the tokens, weighted by the router (float32 accumulation).
    return ep.low_latency_combine(y, idx, weights, handle)


def moe_ffn_all_to_all(
    params: Params,
    x: jax.Array,
    *,
    num_experts: int,
    top_k: int,
    axis_name: str,
    capacity: int | None = None,
    expert_compute: ExpertCompute = "masked",
) -> jax.Array:
    """``moe_ffn`` with ``jax.lax.all_to_all`` on a fixed-capacity buffer (GShard / MaxText style); same signature.

    Each rank puts every (token, expert) slot of its tokens in a static send buffer ``[R, C, D]``: block ``j``
    holds, in token order, the slots whose expert lives on rank ``j``. One ``all_to_all`` delivers block ``j`` to
    rank ``j`` (with each row's local expert index beside it), the local experts run on the ``R * C`` received rows,
    a second ``all_to_all`` sends the outputs back to the same rows of the sender's buffer, and each token sums its
    slots' outputs weighted by the router. A token whose two slots go to the same rank travels twice (``moe_ffn``
    sends it once).

    Args:
      params, x, num_experts, top_k, axis_name: as ``moe_ffn``.
      capacity: ``C``, slots a rank may send to each rank. None (the default) is ``T * top_k``, which never drops.
        With a smaller ``C``, the slots past the first ``C`` for a destination (in token order) are dropped: they
        add nothing to their token's output.
      expert_compute: "masked" (every local expert on every received row, as ``moe_ffn``) or "grouped".

    Returns:
      ``[T, D]``: for each token, the router-weighted sum of its (kept) top-k experts' outputs.
    """
    local_experts, num_ranks = _local_experts("moe_ffn_all_to_all", params, num_experts, axis_name)
    tokens, d_model = x.shape
    slots = tokens * top_k
    c = slots if capacity is None else capacity
    weights, idx = route(params["router"], x, top_k)

    # 1. A row of the send buffer for each slot: block = destination rank, position = how many earlier slots
    #    (in token order) go to the same rank. Slots at position >= C get the row R * C, which scatters drop.
    expert = idx.reshape(slots)
    dest = expert // local_experts
    to_dest = jax.nn.one_hot(dest, num_ranks, dtype=jnp.int32)  # [S, R]
    position = jnp.sum(_exclusive_cumsum(to_dest, axis=0) * to_dest, axis=1)  # [S]
    row = jnp.where(position < c, dest * c + position, num_ranks * c)  # [S]
    token = jnp.arange(slots) // top_k
    send_x = jnp.zeros((num_ranks * c, d_model), x.dtype).at[row].set(x[token], mode="drop")
    send_expert = jnp.full((num_ranks * c,), -1, jnp.int32).at[row].set(expert % local_experts, mode="drop")

    # 2. Block j to rank j: rank j receives [R * C, D], C rows from each source rank, and their local experts.
    recv_x = jax.lax.all_to_all(send_x, axis_name, 0, 0, tiled=True)
    recv_expert = jax.lax.all_to_all(send_expert, axis_name, 0, 0, tiled=True)

    # 3. Local experts, unweighted (the router weights stay home); empty rows (expert -1) give zeros.
    ones = jnp.ones((num_ranks * c, 1), jnp.float32)
    y = apply_local_experts(params["w1"], params["w2"], recv_x, recv_expert[:, None], ones, expert_compute)

    # 4. Back to the sender's rows; each slot reads its row (dropped slots read zeros) and tokens sum their slots.
    back = jax.lax.all_to_all(y.astype(x.dtype), axis_name, 0, 0, tiled=True)  # [R * C, D]
    slot_out = back.at[row].get(mode="fill", fill_value=0).reshape(tokens, top_k, d_model)
    return jnp.einsum("tk,tkd->td", weights, slot_out.astype(jnp.float32)).astype(x.dtype)


def moe_ffn_ragged(
    params: Params,
    x: jax.Array,
    *,
    num_experts: int,
    top_k: int,
    axis_name: str,
    expert_compute: ExpertCompute = "grouped",
) -> jax.Array:
    """``moe_ffn`` with ``jax.lax.ragged_all_to_all`` (MaxText's dropless path); same signature, never drops.

    Each rank sorts its ``T * top_k`` (token, expert) slots by expert, so the slots for rank ``j``'s experts form
    one contiguous chunk. The ranks all-gather their per-expert counts (``[R, E]`` int32, tiny), from which every
    rank derives the sizes and offsets of every chunk. One ``ragged_all_to_all`` moves the chunks (exact rows, no
    padding on the wire) into a receive buffer ordered by source rank, then by local expert; the local experts run
    as grouped matmuls; a second ``ragged_all_to_all`` returns the outputs to the rows they came from; the sender
    un-sorts them and sums each token's slots weighted by the router.

    The receive buffer is static: ``R * T * top_k`` rows, the most a rank can get. XLA:CPU does not implement
    ragged-all-to-all (jax 0.10): run this on GPUs or TPUs.

    Args:
      params, x, num_experts, top_k, axis_name: as ``moe_ffn``.
      expert_compute: "grouped" (the default: ``jax.lax.ragged_dot`` over the chosen rows) or "masked" (every
        local expert on every row of the receive buffer).

    Returns:
      ``[T, D]``: for each token, the router-weighted sum of its top-k experts' outputs.
    """
    local_experts, num_ranks = _local_experts("moe_ffn_ragged", params, num_experts, axis_name)
    tokens, d_model = x.shape
    slots = tokens * top_k
    recv_rows = num_ranks * slots
    weights, idx = route(params["router"], x, top_k)

    # 1. Slots sorted by expert: experts of rank j are [j * E/R, (j+1) * E/R), so the chunk for rank j is contiguous.
    expert = idx.reshape(slots)
    order = jnp.argsort(expert, stable=True)  # sorted position -> slot
    send_x = x[order // top_k]  # [S, D]

    # 2. Sizes and offsets. counts[i, e]: slots of rank i for expert e; sent[i, j]: rows rank i sends to rank j.
    counts = jax.lax.all_gather(jnp.bincount(expert, length=num_experts).astype(jnp.int32), axis_name)  # [R, E]
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
    ones = jnp.ones((recv_rows, 1), jnp.float32)
    y = apply_local_experts(params["w1"], params["w2"], recv_x, local_expert[:, None], ones, expert_compute)

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
    slot_out = back[jnp.argsort(order)].reshape(tokens, top_k, d_model)
    return jnp.einsum("tk,tkd->td", weights, slot_out.astype(jnp.float32)).astype(x.dtype)


def moe_ffn_dense(
    params: Params,
    x: jax.Array,
    *,
    num_experts: int,
    top_k: int,
    axis_name: str | None = None,
) -> jax.Array:
    """Reference for ``moe_ffn``: evaluates every expert on every token and masks; no dispatch.

    With ``axis_name`` (inside ``jax.shard_map``), ``params`` are sharded like ``moe_ffn``'s and the expert weights
    are all-gathered over the axis first. With ``axis_name=None``, ``params`` hold all experts (plain JAX, any
    device layout).
    """
    w1, w2 = params["w1"], params["w2"]
    if axis_name is not None:
        w1 = jax.lax.all_gather(w1, axis_name, tiled=True)
        w2 = jax.lax.all_gather(w2, axis_name, tiled=True)
    if w1.shape[0] != num_experts:
        raise ValueError(f"moe_ffn_dense: expected {num_experts} experts, w1 has {w1.shape[0]}")
    weights, idx = route(params["router"], x, top_k)
    out = expert_mlp(w1, w2, x)  # [E, T, D]
    coef = slot_weights(idx, weights, num_experts)  # [T, E]
    return jnp.einsum("te,etd->td", coef, out.astype(jnp.float32)).astype(x.dtype)
