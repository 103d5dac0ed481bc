"""A Mixture-of-Experts feed-forward layer in plain JAX, with expert parallelism through jax_uccl_ep.

The layer is a pure function of a parameter pytree, so Flax (``nn.Module`` holding the arrays), Equinox or plain
JAX code can call it. Two formulations of the same math are provided:

* ``moe_ffn``: the expert-parallel layer. Each rank of the EP mesh axis holds ``num_experts / R`` experts; tokens
  travel to the ranks that own their experts with ``jax_uccl_ep.dispatch`` and come back with
  ``jax_uccl_ep.combine``. Call it inside ``jax.shard_map``.
* ``moe_ffn_dense``: the reference. It gathers every expert's weights and evaluates every expert on every token,
  masking with the router's choice. No dispatch, the same result up to float rounding; use it for parity tests.

For a token ``x`` the layer computes ``sum_k w_k * expert_{i_k}(x)`` where ``(i_k, w_k)`` are the router's top-k
experts and their weights (renormalized to sum to one), and ``expert_e(x) = gelu(x @ w1[e]) @ w2[e]``.

Parameters (global shapes; inside shard_map the expert weights have ``num_experts / R`` rows)::

    {"router": [d_model, num_experts],           # replicated
     "w1":     [num_experts, d_model, d_ff],     # sharded over the EP axis (moe_param_specs)
     "w2":     [num_experts, d_ff, d_model]}     # sharded over the EP axis
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_uccl_ep as ep

Params = dict[str, jax.Array]


def init_moe_params(
    key: jax.Array, *, d_model: int, d_ff: int, num_experts: int, dtype: Any = jnp.float32
) -> Params:
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


def moe_ffn(
    params: Params,
    x: jax.Array,
    *,
    num_experts: int,
    top_k: int,
    axis_name: str,
    capacity: int | None = None,
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

    Returns:
      ``[T, D]``: for each token, the router-weighted sum of its top-k experts' outputs.
    """
    local_experts = params["w1"].shape[0]
    num_ranks = jax.lax.axis_size(axis_name)
    if local_experts * num_ranks != num_experts:
        raise ValueError(
            f"moe_ffn: w1 holds {local_experts} experts on each of {num_ranks} ranks, expected "
            f"num_experts / R = {num_experts} / {num_ranks}; shard the expert weights over '{axis_name}'"
        )
    weights, idx = route(params["router"], x, top_k)

    # 1. Send each token to every rank that owns one of its experts. On arrival, recv_idx holds *local* expert
    #    indices (-1 for slots owned elsewhere) and recv_weights the matching router weights (0 elsewhere).
    recv = ep.dispatch(x, idx, weights, num_experts=num_experts, axis_name=axis_name, capacity=capacity)
    recv_x, recv_idx, recv_weights, handle = recv.x, recv.topk_idx, recv.topk_weights, recv.handle

    # 2. Run the local experts. For clarity every local expert sees every received row (padding rows included)
    #    and a [rows, local_experts] weight matrix keeps only the chosen (row, expert) pairs. That costs
    #    local_experts times the FLOPs of the chosen pairs: fine for a few experts per rank; large models sort
    #    rows by expert and use a grouped matmul (jax.lax.ragged_dot) instead.
    out = expert_mlp(params["w1"], params["w2"], recv_x)  # [E/R, capacity, D]
    coef = slot_weights(recv_idx, recv_weights, local_experts)  # [capacity, E/R]
    y = jnp.einsum("ne,end->nd", coef, out.astype(jnp.float32)).astype(x.dtype)

    # 3. Send the weighted rows home; combine sums the copies of each token (one per rank it visited).
    return ep.combine(y, handle)


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
