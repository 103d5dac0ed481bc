"""Plain-NumPy reference for normal-mode dispatch and combine, written from the spec, not from the code."""

from __future__ import annotations

import numpy as np


def owner(expert: int, num_experts: int, num_ranks: int) -> int:
    return expert // (num_experts // num_ranks)


def dispatch(x, topk_idx, topk_weights, num_experts, per_node=None):
    """x [R, T, ...], topk_idx/topk_weights [R, T, K] -> per destination rank a dict of expected outputs.

    Rows arrive once per rank owning any of the token's experts, ordered by source rank, then token. With
    `per_node` (two-level routing over nodes of that many consecutive ranks) ordered by the source's index on its
    node, then its node, then token.
    """
    num_ranks, num_tokens, k = topk_idx.shape
    per_rank = num_experts // num_ranks
    out = []
    for dst in range(num_ranks):
        rows, idx, w, src = [], [], [], []
        for s in range(num_ranks):
            for t in range(num_tokens):
                experts = topk_idx[s, t]
                mine = [(e >= 0 and owner(e, num_experts, num_ranks) == dst) for e in experts]
                if not any(mine):
                    continue
                rows.append(x[s, t])
                idx.append([e - dst * per_rank if m else -1 for e, m in zip(experts, mine)])
                if topk_weights is not None:
                    w.append([topk_weights[s, t, j] if m else 0.0 for j, m in enumerate(mine)])
                src.append((s, t))
        if per_node is not None:
            order = sorted(range(len(src)), key=lambda i: (src[i][0] % per_node, src[i][0] // per_node, src[i][1]))
            rows, idx, src = [rows[i] for i in order], [idx[i] for i in order], [src[i] for i in order]
            w = [w[i] for i in order] if topk_weights is not None else w
        counts = np.zeros(per_rank, np.int64)
        for row in idx:
            for e in row:
                if e >= 0:
                    counts[e] += 1
        out.append(
            {
                "x": np.array(rows).reshape((len(rows),) + x.shape[2:]),
                "topk_idx": np.array(idx, np.int64).reshape(len(rows), k),
                "topk_weights": None if topk_weights is None else np.array(w, np.float64).reshape(len(rows), k),
                "num_tokens": len(rows),
                "num_tokens_per_expert": counts,
                "sources": src,
            }
        )
    return out


def combine(ys, dispatched, num_tokens):
    """ys: per rank [capacity, H] rows in dispatch order -> [R, T, H] float64 sums per source token."""
    num_ranks = len(ys)
    h = ys[0].shape[1]
    out = np.zeros((num_ranks, num_tokens, h), np.float64)
    for dst in range(num_ranks):
        for row, (s, t) in enumerate(dispatched[dst]["sources"]):
            out[s, t] += np.asarray(ys[dst][row], np.float64)
    return out


def dispatch_by_expert(x, topk_idx, topk_weights, num_experts, alignment, capacity, per_node=None):
    """dispatch(layout="expert") from its spec: per destination rank, one row per (received token, local expert
    slot) in a buffer of `capacity` rows, each expert's rows from a multiple of `alignment`, in the received order
    (as dispatch() above orders rows); rows are kept in that order while every expert's count, rounded up to the
    alignment, still fits in the buffer, later rows lose all their pairs."""
    out = []
    for e in dispatch(x, topk_idx, topk_weights, num_experts, per_node):
        groups = len(e["num_tokens_per_expert"])
        counts = np.zeros(groups, np.int64)
        kept = 0
        for row in e["topk_idx"]:
            more = counts.copy()
            for expert in row:
                if expert >= 0:
                    more[expert] += 1
            if int(np.sum(-(-more // alignment) * alignment)) > capacity:
                break
            counts, kept = more, kept + 1
        sizes = -(-counts // alignment) * alignment
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        rows = np.zeros((capacity,) + x.shape[2:], np.float64)
        weights = np.zeros(capacity, np.float64)
        sources = [None] * capacity  # (source rank, token) of each pair row
        fill = offsets.copy()
        for i in range(kept):
            for k, expert in enumerate(e["topk_idx"][i]):
                if expert < 0:
                    continue
                slot = fill[expert]
                fill[expert] += 1
                rows[slot] = e["x"][i]
                weights[slot] = 0.0 if topk_weights is None else e["topk_weights"][i, k]
                sources[slot] = e["sources"][i]
        valid_pairs = int(np.sum(e["topk_idx"] >= 0))
        out.append(
            {
                "x": rows,
                "weights": weights,
                "expert_offsets": offsets,
                "num_tokens_per_expert": counts,
                "num_tokens": kept,
                "num_dropped": valid_pairs - int(counts.sum()),
                "sources": sources,
            }
        )
    return out


def combine_pairs(ys, dispatched, num_tokens):
    """ys: per rank [M, H] pair rows in dispatch_by_expert's layout -> [R, T, H] float64 sums per source token."""
    out = np.zeros((len(ys), num_tokens, ys[0].shape[1]), np.float64)
    for dst, e in enumerate(dispatched):
        for slot, source in enumerate(e["sources"]):
            if source is not None:
                out[source] += np.asarray(ys[dst][slot], np.float64)
    return out


def random_routing(rng, num_ranks, num_tokens, topk, num_experts, *, mask_prob=0.2, skew=True, empty_rank=None):
    """Distinct experts per token, some slots masked (-1); skewed popularity; optionally one rank gets nothing."""
    per_rank = num_experts // num_ranks
    allowed = np.arange(num_experts)
    if empty_rank is not None:
        allowed = allowed[(allowed // per_rank) != empty_rank]
    popularity = rng.pareto(1.0, allowed.size) + 0.05 if skew else np.ones(allowed.size)
    p = popularity / popularity.sum()
    k_real = min(topk, allowed.size)
    idx = np.full((num_ranks, num_tokens, topk), -1, np.int32)
    for s in range(num_ranks):
        for t in range(num_tokens):
            chosen = rng.choice(allowed, size=k_real, replace=False, p=p)
            idx[s, t, :k_real] = chosen
            idx[s, t, rng.random(topk) < mask_prob] = -1
            rng.shuffle(idx[s, t])
    return idx


# ------------------------------------------------------------------------------------------------ the MoE layer
# The layer's router, load-balancing loss and experts from the spec (jax_uccl_ep.layers' docstrings and Switch
# Transformer's paper), in float64, sharing nothing with the package.


def moe_route(router, x, top_k, score="softmax", renormalize=True):
    """Tokens x [T, D] -> (weights [T, K], experts [T, K] in descending score, scores [T, E]). softmax: over the
    experts; sigmoid: each expert's own; renormalize: a token's K weights sum to one."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    if score == "softmax":
        scores = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores /= scores.sum(axis=1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    idx = np.argsort(-scores, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, idx, axis=1)
    if renormalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return weights, idx, scores


def switch_aux_loss(scores, idx):
    """Switch Transformer's load-balancing loss of one rank's tokens: E * sum_e f_e * P_e, with f_e the fraction of
    the T*K (token, slot) pairs that chose expert e and P_e the mean router score of e over the T tokens; 1 when the
    pairs and the scores are spread evenly. Returns (loss, pairs per expert [E])."""
    num_experts = scores.shape[1]
    counts = np.bincount(np.asarray(idx).ravel(), minlength=num_experts)
    fraction = counts / idx.size
    return num_experts * float(np.sum(fraction * scores.mean(axis=0))), counts


def swiglu(params, e, x):
    """Expert e on rows x [N, D] in float64: (silu(x @ w_gate) * (x @ w_up)) @ w_down."""
    p = {k: np.asarray(params[k], np.float64) for k in ("w_gate", "w_up", "w_down")}
    x = np.asarray(x, np.float64)
    gate, up = x @ p["w_gate"][e], x @ p["w_up"][e]
    return (gate / (1.0 + np.exp(-gate)) * up) @ p["w_down"][e]


def moe_layer(params, x, top_k, *, score="softmax", renormalize=True, keep=None):
    """The layer on one rank's tokens x [T, D]: (y [T, D], Switch loss (unweighted), pairs per expert [E],
    experts [T, K]). `keep` [T, K] bool: pairs that count (dropped ones add nothing to y)."""
    weights, idx, scores = moe_route(params["router"], x, top_k, score, renormalize)
    aux, counts = switch_aux_loss(scores, idx)
    x = np.asarray(x, np.float64)
    y = np.zeros_like(x)
    for e in np.unique(idx):
        for k in range(top_k):
            rows = np.nonzero((idx[:, k] == e) & (True if keep is None else keep[:, k]))[0]
            if rows.size:
                y[rows] += weights[rows, k, None] * swiglu(params, e, x[rows])
    return y, aux, counts, idx
