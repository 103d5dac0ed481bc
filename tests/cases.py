"""Checks shared by the CPU and GPU tests: run an op on a mesh, compare with the NumPy reference.

Functions return lists of problems instead of asserting, so child processes can report them.
"""

from __future__ import annotations

import contextlib
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import reference as ref
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_uccl_ep as ep


def mesh_of(devices) -> Mesh:
    return Mesh(np.array(devices), ("ep",))


def shard(mesh: Mesh, a):
    """A global [R, ...] array from host data, one slice per device of the EP axis (any process count)."""
    a = np.asarray(a) if not isinstance(a, jax.Array) else a
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("ep")), lambda i: host[i])


_kv_gathers = 0


def gather(a) -> np.ndarray:
    """The whole [R, ...] array on every process. With UCCL_EP_TEST_KV_GATHER=1 through jax.distributed's key-value
    store instead of an XLA collective: processes sharing one GPU (tests/test_proxy_gpu.py) cannot use NCCL."""
    if os.environ.get("UCCL_EP_TEST_KV_GATHER") != "1" or jax.process_count() == 1:
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    global _kv_gathers
    _kv_gathers += 1
    from jax._src import distributed

    client = distributed.global_state.client
    key = f"uccl_ep_test_gather/{_kv_gathers}"
    for shard_ in a.addressable_shards:
        index = shard_.index[0].start or 0
        client.key_value_set_bytes(f"{key}/{index}", pickle.dumps(np.asarray(shard_.data)))
    starts = sorted({index[0].start or 0 for index in a.sharding.devices_indices_map(a.shape).values()})
    blocks = [pickle.loads(client.blocking_key_value_get_bytes(f"{key}/{i}", 60_000)) for i in starts]
    return np.concatenate(blocks, axis=0)


def roundtrip(mesh: Mesh, x, topk_idx, topk_weights, num_experts: int, capacity: int | None = None):
    """Dispatch, a rank-dependent transform of the received rows, combine; inputs and outputs are [R, ...]."""
    fp8 = isinstance(x, tuple)
    has_w = topk_weights is not None

    def step(*args):
        if fp8:
            xs, ss, idx, w = args
            xs = (xs[0], ss[0])
        else:
            xs, idx, w = args
            xs = xs[0]
        res = ep.dispatch(
            xs, idx[0], w[0] if has_w else None, num_experts=num_experts, axis_name="ep", capacity=capacity
        )
        rows = res.x[0].astype(jnp.float32) if fp8 else res.x
        rank = jax.lax.axis_index("ep")
        valid = jnp.arange(rows.shape[0]) < res.num_tokens
        # Padding rows get huge values: combine must ignore them.
        y = jnp.where(valid[:, None], rows * (rank + 1).astype(rows.dtype) + 1, 1e6).astype(rows.dtype)
        combined = ep.combine(y, res.handle)
        out = (
            res.x,
            res.topk_idx,
            res.topk_weights if has_w else jnp.zeros((), jnp.float32),
            res.num_tokens[None],
            res.num_tokens_per_expert,
            combined,
        )
        return jax.tree.map(lambda a: a[None], out)

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    num_ranks = mesh.devices.size
    w = topk_weights if has_w else np.zeros((num_ranks, 1), np.float32)
    inputs = (list(x) if fp8 else [x]) + [topk_idx, w]
    outs = f(*[shard(mesh, a) for a in inputs])
    return jax.tree.map(gather, outs)


def check_layout(mesh: Mesh, seed: int, num_tokens: int, topk: int, num_experts: int) -> list[str]:
    """get_dispatch_layout on every rank against counts taken here from the same routing (a slot per expert, a
    token once per rank however many of its slots go there)."""
    num_ranks = mesh.devices.size
    idx = ref.random_routing(np.random.default_rng(seed), num_ranks, num_tokens, topk, num_experts)

    def step(idx):
        lay = ep.get_dispatch_layout(idx[0], num_experts=num_experts, axis_name="ep")
        return jax.tree.map(lambda a: a[None], tuple(lay))

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    per_rank, per_expert, in_rank = jax.tree.map(gather, f(shard(mesh, idx)))
    problems = []
    owner = np.where(idx >= 0, idx // (num_experts // num_ranks), -1)
    for r in range(num_ranks):
        want_in_rank = np.stack([(owner[r] == q).any(-1) for q in range(num_ranks)], -1)
        want_expert = np.bincount(idx[r][idx[r] >= 0], minlength=num_experts)
        if not np.array_equal(in_rank[r], want_in_rank):
            problems.append(f"rank {r}: is_token_in_rank differs")
        if not np.array_equal(per_rank[r], want_in_rank.sum(0)):
            problems.append(f"rank {r}: num_tokens_per_rank {per_rank[r]} != {want_in_rank.sum(0)}")
        if not np.array_equal(per_expert[r], want_expert):
            problems.append(f"rank {r}: num_tokens_per_expert differs")
    return problems


def two_level_per_node(num_ranks: int) -> int | None:
    """Ranks per node when normal mode routes in two levels over a mesh of `num_ranks` ranks (rows then arrive in
    two-level order), else None. The tests that expect two-level routing assert that it is on."""
    plan = ep.two_level()
    return plan.per_node if plan is not None and plan.num_ranks == num_ranks else None


def check_roundtrip(outs, x_ref, idx, w, num_experts, dtype, *, fp8_scales=None, empty=None) -> list[str]:
    """Compares roundtrip() outputs with the reference; x_ref is what went in, as float32 [R, T, H]."""
    recv_x, recv_idx, recv_w, n, per_expert, combined = outs
    if fp8_scales is not None:
        recv_x, recv_s = recv_x
    problems = []
    num_ranks, num_tokens = idx.shape[:2]
    per_node = two_level_per_node(num_ranks)
    expected = ref.dispatch(x_ref, idx, w, num_experts, per_node)
    exp_scales = ref.dispatch(fp8_scales, idx, None, num_experts, per_node) if fp8_scales is not None else None
    for r, e in enumerate(expected):
        m = e["num_tokens"]
        if n[r, 0] != m:
            problems.append(f"rank {r}: num_tokens {n[r, 0]} != {m}")
            continue
        if not np.array_equal(np.asarray(recv_x[r, :m], np.float32), e["x"]):
            problems.append(f"rank {r}: received rows differ")
        if not np.array_equal(recv_idx[r, :m], e["topk_idx"]):
            problems.append(f"rank {r}: topk_idx differs")
        if w is not None and not np.array_equal(recv_w[r, :m], e["topk_weights"].astype(np.float32)):
            problems.append(f"rank {r}: topk_weights differ")
        if not np.array_equal(per_expert[r], e["num_tokens_per_expert"]):
            problems.append(f"rank {r}: num_tokens_per_expert differs")
        if exp_scales is not None and not np.array_equal(recv_s[r, :m], exp_scales[r]["x"]):
            problems.append(f"rank {r}: scales differ")
        if recv_x.shape[1] != num_ranks * num_tokens:
            problems.append(f"rank {r}: capacity {recv_x.shape[1]}")
        if not (np.all(np.asarray(recv_x[r, m:], np.float32) == 0) and np.all(recv_idx[r, m:] == -1)):
            problems.append(f"rank {r}: padding rows not zero / -1")
        if w is not None and not np.all(recv_w[r, m:] == 0):
            problems.append(f"rank {r}: padding weights not zero")
        if empty is not None and r == empty and m != 0:
            problems.append(f"rank {r} should receive nothing")
    # Combine: each received row was transformed as rows*(rank+1)+1 on its receiving rank, in the rows' dtype.
    ys = []
    for r, e in enumerate(expected):
        y = e["x"].astype(np.float64) * (r + 1) + 1
        ys.append(np.asarray(jnp.asarray(y, dtype).astype(jnp.float32)))
    want = ref.combine(ys, expected, num_tokens)
    tol = dict(rtol=1e-6, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=5e-2)
    if not np.allclose(np.asarray(combined, np.float32), want, **tol):
        err = np.abs(np.asarray(combined, np.float32) - want).max()
        problems.append(f"combine differs (max abs error {err})")
    never_sent = ~(idx >= 0).any(-1)
    if not np.all(np.asarray(combined, np.float32)[never_sent] == 0):
        problems.append("tokens sent nowhere are not zero after combine")
    return problems


def random_case(seed, num_ranks, num_tokens, hidden, topk, num_experts, dtype, *, empty_rank=None):
    rng = np.random.default_rng(seed)
    idx = ref.random_routing(rng, num_ranks, num_tokens, topk, num_experts, empty_rank=empty_rank)
    x = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
    w = rng.random((num_ranks, num_tokens, topk)).astype(np.float32)
    x_dev = np.asarray(jnp.asarray(x, dtype))  # host copy in the op's dtype
    x_ref = np.asarray(x_dev.astype(np.float32))
    return x_dev, x_ref, idx, w


def check_case(mesh, seed, num_tokens, hidden, topk, num_experts, dtype, *, empty_rank=None, routing=None) -> list[str]:
    """A normal-mode round trip of random rows against the reference; `routing` [R, T, topk] instead of random."""
    num_ranks = mesh.devices.size
    x_dev, x_ref, idx, w = random_case(
        seed, num_ranks, num_tokens, hidden, topk, num_experts, dtype, empty_rank=empty_rank
    )
    idx = idx if routing is None else np.asarray(routing, np.int32)
    outs = roundtrip(mesh, x_dev, idx, w, num_experts)
    return check_roundtrip(outs, x_ref, idx, w, num_experts, dtype, empty=empty_rank)


def reference_suite(mesh, seed: int, *, empty_rank: int) -> dict[str, list[str]]:
    """The normal-mode reference checks a layout test runs: float32, bfloat16 with an empty rank, one expert per
    token, FP8, gradients; seeds from `seed` on."""
    r = mesh.devices.size
    return {
        "f32": check_case(mesh, seed, 21, 128, 3, 4 * r, jnp.float32),
        "bf16_empty_rank": check_case(mesh, seed + 1, 40, 256, 4, 8 * r, jnp.bfloat16, empty_rank=empty_rank),
        "one_expert_per_token": check_case(mesh, seed + 2, 16, 128, 1, r, jnp.float32),
        "fp8": check_fp8(mesh, seed + 3, 19, 256, 3, 4 * r),
        "gradients": check_gradients(mesh, seed + 4, 12, 128, 2, 2 * r),
    }


def check_fp8(mesh, seed, num_tokens, hidden, topk, num_experts) -> list[str]:
    num_ranks = mesh.devices.size
    rng = np.random.default_rng(seed)
    idx = ref.random_routing(rng, num_ranks, num_tokens, topk, num_experts)
    x = np.asarray(jnp.asarray(rng.standard_normal((num_ranks, num_tokens, hidden)) * 3, jnp.float8_e4m3fn))
    scales = (rng.random((num_ranks, num_tokens, hidden // 128)) + 0.5).astype(np.float32)
    outs = roundtrip(mesh, (x, scales), idx, None, num_experts)
    x_ref = np.asarray(x.astype(np.float32))
    # The rows arrive as FP8 and the transform runs on them cast to float32, so combine sums float32 rows: its
    # reference is float32 too (exact rows, float32 tolerance).
    problems = check_roundtrip(outs, x_ref, idx, None, num_experts, jnp.float32, fp8_scales=scales)
    if outs[0][0].dtype != jnp.float8_e4m3fn:
        problems.append(f"FP8 rows came back as {outs[0][0].dtype}")
    return problems


def check_gradients(mesh, seed, num_tokens, hidden, topk, num_experts) -> list[str]:
    """jax.grad through dispatch (x and weights) and combine against a dense formulation."""
    num_ranks = mesh.devices.size
    rng = np.random.default_rng(seed)
    idx_h = ref.random_routing(rng, num_ranks, num_tokens, topk, num_experts)
    x_h = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
    w_h = rng.random((num_ranks, num_tokens, topk)).astype(np.float32)
    c_h = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
    idx, x, w, c = (shard(mesh, a) for a in (idx_h, x_h, w_h, c_h))

    def ep_loss(x, w, idx, c):
        def body(x, idx, w, c):
            res = ep.dispatch(x[0], idx[0], w[0], num_experts=num_experts, axis_name="ep")
            rank = jax.lax.axis_index("ep").astype(jnp.float32)
            y = jnp.tanh(res.x) * (rank + 1) * res.topk_weights.sum(-1, keepdims=True)
            out = ep.combine(y, res.handle)
            return jax.lax.psum(jnp.sum(out * c[0]), "ep")[None]

        f = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        return f(x, idx, w, c)[0]

    def dense_loss(x, w):
        owner = np.where(idx_h >= 0, idx_h // (num_experts // num_ranks), 0).astype(np.float32)
        scale = jnp.sum(jnp.where(idx_h >= 0, w * (owner + 1), 0.0), -1, keepdims=True)
        return jnp.sum(jnp.tanh(x) * scale * c_h)

    value, (gx, gw) = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1)))(x, w, idx, c)
    want_value, (want_gx, want_gw) = jax.value_and_grad(dense_loss, argnums=(0, 1))(x_h, w_h)
    problems = []
    if not np.allclose(float(value), float(want_value), rtol=1e-4):
        problems.append(f"loss {float(value)} != {float(want_value)}")
    if not np.allclose(gather(gx), np.asarray(want_gx), rtol=1e-4, atol=1e-5):
        problems.append("grad x differs")
    if not np.allclose(gather(gw), np.asarray(want_gw), rtol=1e-4, atol=1e-5):
        problems.append("grad weights differs")
    if np.abs(gather(gw)).sum() == 0:
        problems.append("grad weights is zero")
    return problems


def low_latency_reference(idx, num_experts):
    """Per destination rank, per local expert: the (source rank, token) rows it receives, in that order."""
    num_ranks = idx.shape[0]
    local = num_experts // num_ranks
    out = []
    for r in range(num_ranks):
        out.append([list(zip(*np.nonzero((idx == r * local + l).any(-1)))) for l in range(local)])
    return out


def check_low_latency(
    mesh,
    seed,
    num_tokens,
    n,
    hidden,
    topk,
    num_experts,
    *,
    split=False,
    zero_padding=True,
    carry_weights=False,
    routing=None,
    **kw,
) -> list[str]:
    """low_latency_dispatch, a per-expert transform, low_latency_combine (fused or split into halves) against
    the reference: counts, layout, source tags, rows (FP8 within e4m3's bound) and the weighted combine. With
    carry_weights the dispatch carries the router weights (each row's in handle.weights) and combine sums on the
    experts' ranks. `routing` [R, T, topk] in place of a random one."""
    num_ranks = mesh.devices.size
    rng = np.random.default_rng(seed)
    idx = ref.random_routing(rng, num_ranks, num_tokens, topk, num_experts)
    idx = idx if routing is None else np.asarray(routing, np.int32)
    xb = np.asarray(jnp.asarray(rng.standard_normal((num_ranks, num_tokens, hidden)), jnp.bfloat16))
    w = rng.random((num_ranks, num_tokens, topk)).astype(np.float32)
    use_fp8 = kw.get("use_fp8", True)
    args = dict(num_experts=num_experts, max_tokens_per_rank=n, axis_name="ep", **kw)

    def body(x, idx, w):
        carried = {"topk_weights": w[0]} if carry_weights else {}
        if split:
            pending = ep.low_latency_dispatch_send(x[0], idx[0], **args, **carried)
            recv, count, handle = ep.low_latency_dispatch_recv(pending)
        else:
            recv, count, handle = ep.low_latency_dispatch(x[0], idx[0], **args, **carried)
        if use_fp8:
            rows, scales = recv
            if kw.get("use_ue8m0"):
                scales = ep.unpack_ue8m0(scales)
            local, slab, h = rows.shape
            deq = (rows.astype(jnp.float32).reshape(local, slab, h // 128, 128) * scales[..., None]).reshape(rows.shape)
        else:
            deq = recv.astype(jnp.float32)
        # Expert l of rank r multiplies by r * L + l + 1: every expert distinct.
        local = deq.shape[0]
        factor = (jax.lax.axis_index("ep") * local + jnp.arange(local) + 1).astype(jnp.float32)[:, None, None]
        y = (deq * factor).astype(jnp.bfloat16)
        combine_w = None if carry_weights else w[0]
        if split:
            out = ep.low_latency_combine_recv(ep.low_latency_combine_send(y, handle), idx[0], combine_w)
        else:
            out = ep.low_latency_combine(y, idx[0], combine_w, handle)
        weights = handle.weights if carry_weights else jnp.zeros(handle.src_slot.shape, jnp.float32)
        return tuple(a[None] for a in (deq, count, handle.layout, handle.src_token, handle.src_slot, out, weights))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    outs = f(*(shard(mesh, a) for a in (xb, idx, w)))
    deq, count, layout, src_token, src_slot, out, row_w = (gather(a) for a in outs)
    x32 = xb.astype(np.float32)
    expected = low_latency_reference(idx, num_experts)
    local = num_experts // num_ranks
    problems = []
    want = np.zeros_like(x32)
    for r in range(num_ranks):
        for l in range(local):
            rows = expected[r][l]
            m = len(rows)
            if count[r, l] != m:
                problems.append(f"rank {r} expert {l}: count {count[r, l]} != {m}")
                continue
            per_source = [sum(1 for s, _ in rows if s == src) for src in range(num_ranks)]
            if list(layout[r, l]) != per_source:
                problems.append(f"rank {r} expert {l}: layout {list(layout[r, l])} != {per_source}")
            src = np.array([s for s, _ in rows], int)
            tok = np.array([t for _, t in rows], int)
            if not np.array_equal(src_token[r, l, :m], tok):
                problems.append(f"rank {r} expert {l}: source tokens differ")
                continue
            if not np.all(src_token[r, l, m:] == -1):
                problems.append(f"rank {r} expert {l}: padding source tokens are not -1")
            # The slot each row returns to in the combine: its token's k-th choice on the source is this expert.
            slot = src_slot[r, l, :m]
            if not (np.array_equal(slot // topk, tok) and np.all(idx[src, tok, slot % topk] == r * local + l)):
                problems.append(f"rank {r} expert {l}: source slots do not name this expert")
            if carry_weights and not np.array_equal(row_w[r, l, :m], w[src, tok, slot % topk]):
                problems.append(f"rank {r} expert {l}: the rows' weights are not their slots' router weights")
            if carry_weights and zero_padding and not np.all(row_w[r, l, m:] == 0):
                problems.append(f"rank {r} expert {l}: padding rows' weights are not 0")
            got, sent = deq[r, l, :m], x32[src, tok]
            if use_fp8:  # e4m3: relative error <= 2^-4 of the value, plus the block's underflow
                bound = np.abs(sent) * 2**-4 + 1e-3 * np.abs(sent).max(initial=0)
                if not np.all(np.abs(got - sent) <= bound):
                    problems.append(f"rank {r} expert {l}: FP8 rows off by {np.abs(got - sent).max()}")
            elif not np.array_equal(got, sent):
                problems.append(f"rank {r} expert {l}: rows differ")
            if zero_padding and not np.all(deq[r, l, m:] == 0):
                problems.append(f"rank {r} expert {l}: padding rows are not zero")
            e = r * local + l
            y = np.asarray(jnp.asarray(got * (e + 1), jnp.bfloat16).astype(jnp.float32))
            k = np.argmax(idx[src, tok] == e, axis=-1)
            np.add.at(want, (src, tok), w[src, tok, k][:, None] * y)
    out = np.asarray(out, np.float32)
    if not np.allclose(out, want, rtol=2e-2, atol=2e-2):
        problems.append(f"combine differs by {np.abs(out - want).max()}")
    if not np.all(out[~(idx >= 0).any(-1)] == 0):
        problems.append("tokens sent nowhere are not zero after combine")
    return problems


def low_latency_round_trip(
    mesh: Mesh,
    x,
    idx,
    w,
    num_experts: int,
    *,
    combine_idx=None,
    max_tokens=None,
    carry_weights=False,
    split_combine=False,
):
    """Low-latency dispatch (no FP8), identity experts, combine, on host data [R, ...]: (combined [R, T, H], counts
    [R, L]) on every process; combine_idx replaces the routing given to combine; with carry_weights the dispatch
    carries the weights and combine sums on the experts' ranks; split_combine runs combine as its two halves."""

    def body(x, i, ci, w):
        recv, count, handle = ep.low_latency_dispatch(
            x[0],
            i[0],
            num_experts=num_experts,
            max_tokens_per_rank=max_tokens or x.shape[1],
            axis_name="ep",
            use_fp8=False,
            topk_weights=w[0] if carry_weights else None,
        )
        weights = None if carry_weights else w[0]
        if split_combine:
            out = ep.low_latency_combine_recv(ep.low_latency_combine_send(recv, handle), ci[0], weights)
        else:
            out = ep.low_latency_combine(recv, ci[0], weights, handle)
        return out[None], count[None]

    ci = idx if combine_idx is None else combine_idx
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    return [gather(a) for a in f(*(shard(mesh, a) for a in (x, idx, ci, w)))]


def low_latency_weighted_sum(x, idx, w) -> np.ndarray:
    """What a low-latency round trip through identity experts returns: each token times its slots' weights' sum."""
    return x * np.where(idx >= 0, w, 0).sum(-1, keepdims=True)


def check_low_latency_fp8_cast(
    mesh, seed, num_tokens, hidden, topk, num_experts, *, dtype=jnp.bfloat16, round_scale=False, nonfinite=False
) -> list[str]:
    """The FP8 rows and scales a low-latency dispatch delivers against per_token_cast_to_fp8 of their source tokens
    (the dispatch casts on the way). Blocks of very different magnitudes, an all-zero block and values in e4m3's
    subnormal range. The rule is the same, the last bit of a float32 step may not be (XLA, the CPU and the GPU
    kernels each round their own way): scales within 1e-6 relative and an FP8 code the neighbouring one (a value at
    a tie) in at most 1 of 500 values, 1 of 100 per row; with round_scale (exact powers of two, exact products)
    every scale and code must match. With `nonfinite`, one block holds a NaN and another an inf: their scales must
    be NaN and inf (JAX's vectorized max may drop a NaN, so those blocks are checked by that rule instead)."""
    num_ranks = mesh.devices.size
    rng = np.random.default_rng(seed)
    idx = ref.random_routing(rng, num_ranks, num_tokens, topk, num_experts)
    mag = np.exp(rng.uniform(-8, 8, (num_ranks, num_tokens, hidden // 128, 1)))
    x = rng.standard_normal((num_ranks, num_tokens, hidden // 128, 128)) * mag
    x[:, :, 0, :] *= np.where(rng.random(128) < 0.5, 1e-4, 1.0)  # values ~2^-13 of the block's largest: subnormals
    x[:, 0, -1, :] = 0.0  # an all-zero block keeps a finite scale
    if nonfinite:
        x[:, 1, -1, 5], x[:, 2, 0, 7] = np.nan, np.inf
    x = np.asarray(jnp.asarray(x.reshape(num_ranks, num_tokens, hidden), dtype))
    args = dict(
        num_experts=num_experts, max_tokens_per_rank=num_tokens, axis_name="ep", use_fp8=True, round_scale=round_scale
    )

    def body(x, idx):
        (rows, scales), count, handle = ep.low_latency_dispatch(x[0], idx[0], **args)
        return rows.view(jnp.uint8)[None], scales[None], count[None], handle.src_slot[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    rows, scales, count, src_slot = (gather(a) for a in f(shard(mesh, x), shard(mesh, idx)))
    want_rows, want_scales = jax.vmap(lambda t: ep.per_token_cast_to_fp8(t, round_scale=round_scale))(jnp.asarray(x))
    want_rows = np.asarray(want_rows.view(jnp.uint8)).copy()
    want_scales = np.asarray(want_scales).copy()
    blocks = np.asarray(x, np.float32).reshape(num_ranks, num_tokens, hidden // 128, 128)
    nan_block, inf_block = np.isnan(blocks).any(-1), np.isinf(blocks).any(-1) & ~np.isnan(blocks).any(-1)
    want_scales[nan_block], want_scales[inf_block] = np.nan, np.inf
    want_rows.reshape(blocks.shape)[nan_block] = 0x7F
    problems, checked, off = [], 0, 0
    local = num_experts // num_ranks
    # Rows of expert l on rank r are grouped by source ascending, then token: the reference names each row's source.
    expected = low_latency_reference(idx, num_experts)
    for r in range(num_ranks):
        for l in range(local):
            if count[r, l] != len(expected[r][l]):
                problems.append(f"rank {r} expert {l}: count {count[r, l]} != {len(expected[r][l])}")
            for i, (s, t) in enumerate(expected[r][l][: count[r, l]]):
                if src_slot[r, l, i] // topk != t or idx[s, t, src_slot[r, l, i] % topk] != r * local + l:
                    problems.append(f"rank {r} expert {l} row {i}: from token {src_slot[r, l, i] // topk}, not {t}")
                    continue
                if not (
                    np.array_equal(scales[r, l, i], want_scales[s, t], equal_nan=True)
                    if round_scale
                    else np.allclose(scales[r, l, i], want_scales[s, t], rtol=1e-6, atol=0, equal_nan=True)
                ):
                    problems.append(f"rank {r} expert {l} row {i}: scales differ from per_token_cast_to_fp8's")
                got, want = rows[r, l, i].astype(np.int16), want_rows[s, t].astype(np.int16)
                got[got & 0x7F == 0x7F], want[want & 0x7F == 0x7F] = 0x7F, 0x7F  # NaN, either sign
                differ = got != want
                checked += got.size
                if differ.any() and (round_scale or differ.sum() > got.size // 100):
                    problems.append(f"rank {r} expert {l} row {i}: {differ.sum()} FP8 codes differ")
                if differ.any():
                    off += int(differ.sum())
                    if np.abs(got - want)[differ].max() > 1 or np.any((got ^ want)[differ] & 0x80):
                        problems.append(f"rank {r} expert {l} row {i}: FP8 codes differ by more than one step")
    if off > checked // 500:
        problems.append(f"{off} of {checked} FP8 codes are a step off (allowed: 1 in 500)")
    if checked == 0:
        problems.append("no rows were checked")
    return problems


def check_drop(mesh, seed, num_tokens, hidden, topk, num_experts, capacity) -> list[str]:
    """overflow="drop" against the reference: each rank keeps the first `capacity` rows of its reference order and
    counts the rest in num_dropped; combine sums only the kept rows' transforms; the gradient of a loss through
    dispatch and combine flows through the kept rows only."""
    num_ranks = mesh.devices.size
    x, _, idx, w = random_case(seed, num_ranks, num_tokens, hidden, topk, num_experts, jnp.float32)
    c = np.random.default_rng(seed + 1).standard_normal(x.shape).astype(np.float32)
    full = ref.dispatch(x, idx, w, num_experts, per_node=two_level_per_node(num_ranks))
    kept = [dict(d, sources=d["sources"][:capacity]) for d in full]

    def body(x, idx, w, c):
        # Each rank differentiates its own loss (its tokens' sums): no XLA collective, which NCCL refuses on a
        # shared GPU; the EP ops' backward passes carry the cotangents.
        def local_loss(x):
            res = ep.dispatch(
                x, idx[0], w[0], num_experts=num_experts, axis_name="ep", capacity=capacity, overflow="drop"
            )
            scale = (jax.lax.axis_index("ep") + 1).astype(jnp.float32)
            out = ep.combine(jnp.tanh(res.x) * scale, res.handle)
            counts = (res.num_tokens, res.num_dropped, res.num_tokens_per_expert)
            return jnp.sum(out * c[0]), (res.x, res.topk_idx, res.topk_weights, counts, out)

        gx, outs = jax.grad(local_loss, has_aux=True)(x[0])
        return jax.tree.map(lambda a: a[None], (outs, gx))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    outs, gx = f(*(shard(mesh, a) for a in (x, idx, w, c)))
    recv_x, recv_idx, recv_w, (n, dropped, per_expert), out = jax.tree.map(gather, outs)
    gx = gather(gx)
    problems = []
    if not any(d["num_tokens"] > capacity for d in full):
        problems.append("the case drops nothing: it tests no overflow")
    want_out = np.zeros(x.shape, np.float64)
    want_gx = np.zeros(x.shape, np.float64)
    for r, (d, k) in enumerate(zip(full, kept)):
        keep = min(d["num_tokens"], capacity)
        if n[r] != keep or dropped[r] != d["num_tokens"] - keep:
            problems.append(f"rank {r}: kept {n[r]} and dropped {dropped[r]} of {d['num_tokens']} rows")
            continue
        if not np.array_equal(recv_x[r][:keep], d["x"][:keep]) or np.any(recv_x[r][keep:] != 0):
            problems.append(f"rank {r}: kept rows differ from the first {keep} of the reference order")
        if not np.array_equal(recv_idx[r][:keep], d["topk_idx"][:keep]) or np.any(recv_idx[r][keep:] != -1):
            problems.append(f"rank {r}: topk_idx of the kept rows differ")
        if not np.allclose(recv_w[r][:keep], d["topk_weights"][:keep]):
            problems.append(f"rank {r}: topk_weights of the kept rows differ")
        want_experts = np.bincount(d["topk_idx"][:keep][d["topk_idx"][:keep] >= 0], minlength=per_expert.shape[1])
        if not np.array_equal(per_expert[r], want_experts):
            problems.append(f"rank {r}: num_tokens_per_expert {per_expert[r]} counts other rows than the kept ones")
        for s, t in k["sources"]:
            want_out[s, t] += np.tanh(x[s, t].astype(np.float64)) * (r + 1)
            want_gx[s, t] += (1 - np.tanh(x[s, t].astype(np.float64)) ** 2) * (r + 1) * c[s, t]
    if not np.allclose(out, want_out, rtol=1e-5, atol=1e-5):
        problems.append("combine differs from the sum over kept rows")
    if not np.allclose(gx, want_gx, rtol=1e-4, atol=1e-5):
        problems.append("gradient differs from the one through kept rows")
    return problems


def overflow_error(mesh, seed, num_tokens, hidden, num_experts, capacity) -> str:
    """The error text of a dispatch whose rank 0 receives every token (num_ranks * num_tokens rows) under
    overflow="error", or "" if the op (and, on GPUs, check_errors()) raised nothing."""
    num_ranks = mesh.devices.size
    x, _, _, w = random_case(seed, num_ranks, num_tokens, hidden, 2, num_experts, jnp.float32)
    idx = np.full((num_ranks, num_tokens, 2), -1, np.int32)
    idx[:, :, 0] = 0  # expert 0 lives on rank 0
    try:
        roundtrip(mesh, x, idx, w[..., :2], num_experts, capacity=capacity)
        ep.check_errors()
        return ""
    except Exception as e:  # noqa: BLE001
        return str(e)


def _expert_factor(offsets, counts, num_rows: int, groups: int):
    """Inside shard_map: [M] float32, (global expert + 1) on each pair row of the expert-major layout (from its
    offsets and counts), 0 outside the groups: each expert transforms its rows differently, so a row placed in
    another expert's group changes the result."""
    m = jnp.arange(num_rows)[:, None]
    in_group = (m >= offsets[None, :]) & (m < (offsets + counts)[None, :])
    first = jax.lax.axis_index("ep") * groups
    return jnp.sum(jnp.where(in_group, first + jnp.arange(groups)[None, :] + 1, 0), axis=1).astype(jnp.float32)


def check_expert_layout(
    mesh,
    seed,
    num_tokens,
    hidden,
    topk,
    num_experts,
    dtype,
    *,
    alignment=1,
    capacity=None,
    fp8_pair=False,
    repeats=0.0,
) -> list[str]:
    """dispatch(layout="expert") and its combine against reference.dispatch_by_expert: pair rows, their order,
    offsets, counts, weights, drops, and the combined sums of a per-expert transform weighted by the pairs'
    weights. With `fp8_pair` the rows travel as an FP8 pair (rows and scales checked exactly); with `repeats` that
    fraction of the tokens name their first expert twice (slots 0 and 1: two pairs of one row, in k order)."""
    num_ranks = mesh.devices.size
    groups = num_experts // num_ranks
    x_dev, x_ref, idx, w = random_case(seed, num_ranks, num_tokens, hidden, topk, num_experts, dtype)
    if repeats:
        twice = (np.random.default_rng(seed + 2).random(idx.shape[:2]) < repeats) & (idx[..., 0] >= 0)
        idx[..., 1] = np.where(twice, idx[..., 0], idx[..., 1])
    scales = None
    if fp8_pair:
        rng = np.random.default_rng(seed + 1)
        x_dev = np.asarray(jnp.asarray(x_ref * 3, jnp.float8_e4m3fn))
        x_ref = np.asarray(x_dev.astype(np.float32))
        scales = (rng.random((num_ranks, num_tokens, hidden // 128)) + 0.5).astype(np.float32)
    pairs = capacity or num_ranks * num_tokens * min(topk, groups) + (alignment - 1) * groups
    out_dtype = jnp.float32 if fp8_pair else dtype

    def body(x, s, idx, w):
        xs = (x[0], s[0]) if fp8_pair else x[0]
        r = ep.dispatch(
            xs,
            idx[0],
            w[0],
            num_experts=num_experts,
            axis_name="ep",
            layout="expert",
            expert_alignment=alignment,
            capacity=capacity,
            overflow="drop",
        )
        # (a width of 1 without FP8: the tests' key-value gather skips arrays of no elements)
        rows, row_scales = r.x if fp8_pair else (r.x, jnp.zeros((pairs, 1), jnp.float32))
        factor = _expert_factor(r.expert_offsets, r.num_tokens_per_expert, pairs, groups)
        y = (rows.astype(jnp.float32) * (factor * r.weights)[:, None]).astype(out_dtype)
        combined = ep.combine(y, r.handle)
        counts = jnp.stack([r.num_tokens, r.num_dropped])
        return (
            rows[None],
            row_scales[None],
            r.weights[None],
            r.expert_offsets[None],
            r.num_tokens_per_expert[None],
            counts[None],
            combined[None],
        )

    s_host = scales if fp8_pair else np.zeros((num_ranks, num_tokens, 0), np.float32)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    outs = f(*(shard(mesh, a) for a in (x_dev, s_host, idx, w)))
    rows, row_scales, weights, offsets, counts, nums, combined = (gather(o) for o in outs)

    per_node = two_level_per_node(num_ranks)
    expected = ref.dispatch_by_expert(x_ref, idx, w, num_experts, alignment, pairs, per_node)
    exp_scales = ref.dispatch_by_expert(scales, idx, w, num_experts, alignment, pairs, per_node) if fp8_pair else None
    problems = []
    for r, e in enumerate(expected):
        for name, got, want in [
            ("expert_offsets", offsets[r], e["expert_offsets"]),
            ("num_tokens_per_expert", counts[r], e["num_tokens_per_expert"]),
            ("num_tokens", nums[r, 0], e["num_tokens"]),
            ("num_dropped", nums[r, 1], e["num_dropped"]),
        ]:
            if not np.array_equal(got, want):
                problems.append(f"rank {r}: {name} {got} != {want}")
        if not np.array_equal(np.asarray(rows[r], np.float32), e["x"].astype(np.float32)):
            bad = np.flatnonzero((np.asarray(rows[r], np.float32) != e["x"]).any(-1))
            problems.append(f"rank {r}: pair rows differ at {bad[:8]} of {len(bad)}")
        if not np.array_equal(weights[r], e["weights"].astype(np.float32)):
            problems.append(f"rank {r}: weights differ")
        if fp8_pair and not np.array_equal(row_scales[r], exp_scales[r]["x"].astype(np.float32)):
            problems.append(f"rank {r}: pair scales differ")
    ys = []
    for r, e in enumerate(expected):
        factor = np.zeros(pairs)
        for g in range(groups):
            lo = e["expert_offsets"][g]
            factor[lo : lo + e["num_tokens_per_expert"][g]] = r * groups + g + 1
        y = e["x"] * (factor * e["weights"].astype(np.float32))[:, None]
        ys.append(np.asarray(jnp.asarray(y, out_dtype).astype(jnp.float32)))
    want = ref.combine_pairs(ys, expected, num_tokens)
    tol = dict(rtol=1e-5, atol=1e-5) if out_dtype == jnp.float32 else dict(rtol=2e-2, atol=5e-2)
    if not np.allclose(np.asarray(combined, np.float32), want, **tol):
        err = np.abs(np.asarray(combined, np.float32) - want).max()
        problems.append(f"combine of the pair rows differs (max abs error {err})")
    return problems


def check_expert_gradients(mesh, seed, num_tokens, hidden, topk, num_experts, *, use_fp8=False) -> list[str]:
    """jax.grad through dispatch(layout="expert") (x and weights) and its combine against a dense formulation:
    each token's output is sum_k w_k * tanh(x) * (expert_k + 1)."""
    num_ranks = mesh.devices.size
    groups = num_experts // num_ranks
    rng = np.random.default_rng(seed)
    idx_h = ref.random_routing(rng, num_ranks, num_tokens, topk, num_experts)
    x_h = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
    w_h = (rng.random((num_ranks, num_tokens, topk)) + 0.1).astype(np.float32)
    c_h = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
    idx, x, w, c = (shard(mesh, a) for a in (idx_h, x_h, w_h, c_h))

    def ep_loss(x, w, idx, c):
        def body(x, idx, w, c):
            r = ep.dispatch(
                x[0], idx[0], w[0], num_experts=num_experts, axis_name="ep", layout="expert", use_fp8=use_fp8
            )
            factor = _expert_factor(r.expert_offsets, r.num_tokens_per_expert, r.x.shape[0], groups)
            y = jnp.tanh(r.x) * (factor * r.weights)[:, None]
            out = ep.combine(y, r.handle)
            return jax.lax.psum(jnp.sum(out * c[0]), "ep")[None]

        f = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        return f(x, idx, w, c)[0]

    def dense_loss(x, w):
        factor = jnp.sum(jnp.where(idx_h >= 0, w * (idx_h + 1), 0.0), -1, keepdims=True)
        return jnp.sum(jnp.tanh(x) * factor * c_h)

    value, (gx, gw) = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1)))(x, w, idx, c)
    want_value, (want_gx, want_gw) = jax.value_and_grad(dense_loss, argnums=(0, 1))(x_h, w_h)
    problems = []
    if use_fp8:
        # The FP8 wire rounds each value by up to 2^-4 of its block's scale (the backward takes the casts as the
        # identity): relative errors of the whole gradient, well under what a misplaced row or weight makes (~1).
        for name, got, want in [
            ("loss", value, want_value),
            ("grad x", gather(gx), want_gx),
            ("grad w", gather(gw), want_gw),
        ]:
            err = np.linalg.norm(np.asarray(got) - np.asarray(want)) / np.linalg.norm(np.asarray(want))
            if not err < 0.05:
                problems.append(f"{name} differs by {err:.3f} (relative)")
        return problems
    if not np.allclose(float(value), float(want_value), rtol=1e-4):
        problems.append(f"loss {float(value)} != {float(want_value)}")
    if not np.allclose(gather(gx), np.asarray(want_gx), rtol=1e-4, atol=1e-5):
        problems.append(f"grad x differs (max abs error {np.abs(gather(gx) - np.asarray(want_gx)).max()})")
    if not np.allclose(gather(gw), np.asarray(want_gw), rtol=1e-4, atol=1e-5):
        problems.append(f"grad weights differs (max abs error {np.abs(gather(gw) - np.asarray(want_gw)).max()})")
    return problems


@contextlib.contextmanager
def _as_gpu_pair_paths(gpu_writes: bool):
    """On CPU devices, the pair ops as a GPU path runs them: no host-path pair op sums a row's pairs (XLA does), and
    with `gpu_writes` the receive writes the pairs where _plan.gpu_writes_pairs allows (the NVLink path where
    dispatch pulls, the GPU-initiated proxy), else token rows then XLA's layout. Programs traced inside are traced
    afresh."""
    import dataclasses

    from jax_uccl_ep import _plan

    saved, plan = _plan.receive_writes_pairs, _plan.current()
    _plan.receive_writes_pairs = lambda: False
    _plan.set_current(dataclasses.replace(plan, gpu_writes_pairs=gpu_writes))
    jax.clear_caches()
    try:
        yield
    finally:
        _plan.receive_writes_pairs = saved
        _plan.set_current(plan)
        jax.clear_caches()


def pairs_laid_out_in_xla():
    """dispatch(layout="expert") as the GPU paths run it (token rows, then the pair layout in XLA, _pairs.py) on
    CPU devices, whose receive otherwise writes the pairs itself."""
    return _as_gpu_pair_paths(gpu_writes=False)


def pairs_written_then_summed_before_combine():
    """dispatch(layout="expert") as the GPU paths run it where the receive writes the pairs (where
    _plan.gpu_writes_pairs allows; combine sums each row's pairs first, then sends token rows back) on CPU
    devices, whose receive otherwise sums them too."""
    return _as_gpu_pair_paths(gpu_writes=True)


def check_pair_writers_agree(
    mesh, seed, num_tokens, hidden, topk, num_experts, dtype, *, alignment=1, capacity=None, use_fp8=False
) -> list[str]:
    """The receive's pair buffer against the XLA layout of the same routing (the GPU paths'): the pair rows, weights,
    offsets, counts, drops and the handle's slots equal, combine and the gradients of x and the weights within
    float32 rounding (the two sum a row's pairs in other orders)."""
    x_dev, _, idx, w = random_case(seed, mesh.devices.size, num_tokens, hidden, topk, num_experts, dtype)
    cot = np.random.default_rng(seed + 7).standard_normal(x_dev.shape).astype(np.float32)

    def body(x, idx, w, c):
        def loss(x, w):
            r = ep.dispatch(
                x,
                idx[0],
                w,
                num_experts=num_experts,
                axis_name="ep",
                layout="expert",
                expert_alignment=alignment,
                capacity=capacity,
                overflow="drop",
                use_fp8=use_fp8,
            )
            y = (jnp.tanh(r.x.astype(jnp.float32)) * r.weights[:, None]).astype(x.dtype)
            out = ep.combine(y, r.handle)
            fields = (r.x, r.weights, r.expert_offsets, r.num_tokens_per_expert, r.num_tokens, r.num_dropped)
            return jnp.sum(out.astype(jnp.float32) * c[0]), (out, fields, r.handle.pair_row, r.handle.pair_of)

        (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x[0], w[0])
        return jax.tree.map(lambda a: jnp.asarray(a)[None], (aux, grads))

    def run():
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        outs = f(*(shard(mesh, a) for a in (x_dev, idx, w, cot)))
        return [np.asarray(gather(o), np.float32) for o in jax.tree.leaves(outs)]

    received = run()
    with pairs_laid_out_in_xla():
        laid_out = run()
    names = ["combine", "pair rows", "weights", "expert_offsets", "num_tokens_per_expert", "num_tokens"]
    names += ["num_dropped", "pair_row", "pair_of", "grad x", "grad weights"]
    problems = []
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, got, want in zip(names, received, laid_out, strict=True):
        exact = name not in ("combine", "grad x", "grad weights")
        same = np.array_equal(got, want) if exact else np.allclose(got, want, **tol)
        if not same:
            problems.append(f"{name}: the receive's {got.ravel()[:6]} != XLA's {want.ravel()[:6]}")
    if received[6].sum() == 0 and capacity is not None:
        problems.append("the capacity case dropped no pair: it proves nothing about the drop rule")
    return problems


# sum_pairs cases: (received rows, pair slots, hidden, top-k, pairs' dtype, rows' dtype). The layer's wire (bf16
# rows of 4096 bytes: 16-byte vectors), bf16 summed to float32 (expand's transpose), float32 rows of 48 bytes summed
# to 24-byte bf16 ones (an element a lane on GPUs), and odd rows with more slots than a warp's lanes.
SUM_PAIRS_CASES = [
    (300, 1000, 2048, 8, jnp.bfloat16, jnp.bfloat16),
    (200, 700, 128, 4, jnp.bfloat16, jnp.float32),
    (97, 400, 12, 3, jnp.float32, jnp.bfloat16),
    (50, 200, 7, 40, jnp.float32, jnp.float32),
]


def sum_pairs_problems(seed: int, rows: int, slots: int, hidden: int, topk: int, pairs_dtype, rows_dtype) -> list[str]:
    """Each received row's sum of its pairs (the FFI's sum_pairs, as combine runs reduce_pairs) against NumPy
    float64 on random pairs, a random 40% of each row's slots naming none (the layout's M, or past it), rows that
    name none (zeros), a row naming one slot K times (each naming adds); and XLA's gather and sum on the same
    inputs. Returns what disagrees."""
    from jax_uccl_ep import _pairs

    rng = np.random.default_rng(seed)
    pairs = jnp.asarray(rng.standard_normal((slots, hidden)) * 4, pairs_dtype)
    pair_of = rng.integers(0, slots, (rows, topk)).astype(np.int32)
    pair_of[rng.random((rows, topk)) < 0.4] = slots
    pair_of[:3] = slots
    pair_of[3, 0], pair_of[4, 0] = slots + 1, 2**31 - 1
    pair_of[5] = pair_of[5, 0] if pair_of[5, 0] < slots else 0
    p64 = np.asarray(pairs.astype(jnp.float32), np.float64)
    named = (pair_of >= 0) & (pair_of < slots)
    want = (p64[np.clip(pair_of, 0, slots - 1)] * named[..., None]).sum(axis=1)
    scale = np.abs(p64).max() * topk
    rtol = 2.0**-8 if rows_dtype == jnp.bfloat16 else 1e-6
    problems = []
    for zero_padding, how in ((False, "sum_pairs"), (True, "XLA")):
        fn = jax.jit(lambda p, o, z=zero_padding: _pairs.reduce_pairs(p, None, o, z, rows_dtype, not z))
        got = fn(pairs, jnp.asarray(pair_of))
        if got.dtype != jnp.dtype(rows_dtype) or got.shape != (rows, hidden):
            problems.append(f"{how}: {got.dtype}{got.shape}, want {jnp.dtype(rows_dtype)}{(rows, hidden)}")
            continue
        got64 = np.asarray(got.astype(jnp.float32), np.float64)
        if got64[:3].any():
            problems.append(f"{how}: rows that name no slot are not zeros")
        bad = np.abs(got64 - want) > rtol * np.abs(want) + 1e-6 * scale
        if bad.any():
            r, h = np.argwhere(bad)[0]
            problems.append(f"{how}: {int(bad.sum())} elements off, first [{r}, {h}] {got64[r, h]} want {want[r, h]}")
    return problems
