"""Normal-mode dispatch/combine on CPU devices against the NumPy reference: values, layout, grads, errors."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_uccl_ep as ep
import reference as ref
from mp import launch_ok

HERE = os.path.abspath(__file__)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    ep.initialize()
    yield


def _mesh(num_ranks: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:num_ranks]), ("ep",))


def _run(num_ranks, x, topk_idx, topk_weights, num_experts, capacity=None):
    """Dispatch, a rank-dependent transform of the received rows, combine. Inputs are [R, T, ...] arrays."""
    mesh = _mesh(num_ranks)
    fp8 = isinstance(x, tuple)
    has_w = topk_weights is not None

    def body(x, idx, *w):
        res = ep.dispatch(x, idx[0], w[0][0] if has_w else None, num_experts=num_experts, axis_name="ep",
                          capacity=capacity) if False else None
        return res

    def step(x, idx, w):
        xs = (x[0][0], x[1][0]) if fp8 else x[0]
        res = ep.dispatch(xs, idx[0], w[0] if has_w else None, num_experts=num_experts, axis_name="ep",
                          capacity=capacity)
        rows = res.x[0].astype(jnp.float32) if fp8 else res.x
        rank = jax.lax.axis_index("ep")
        valid = jnp.arange(rows.shape[0]) < res.num_tokens
        # Padding rows get huge values: combine must ignore them.
        y = jnp.where(valid[:, None], rows * (rank + 1).astype(rows.dtype) + 1, 1e6).astype(
            jnp.float32 if fp8 else rows.dtype)
        combined = ep.combine(y, res.handle)
        out = (res.x, res.topk_idx, res.topk_weights if has_w else jnp.zeros((), jnp.float32),
               res.num_tokens[None], res.num_tokens_per_expert, combined)
        return jax.tree.map(lambda a: a[None], out)

    spec = P("ep")
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))
    w = topk_weights if has_w else jnp.zeros((num_ranks, 1), jnp.float32)
    return jax.tree.map(np.asarray, f(x, topk_idx, w))


CASES = [
    # ranks, tokens, hidden, topk, experts, dtype
    (1, 9, 128, 2, 4, jnp.float32),
    (2, 1, 256, 1, 2, jnp.float32),
    (2, 37, 128, 4, 8, jnp.bfloat16),
    (4, 23, 384, 4, 16, jnp.float32),
    (4, 16, 7168, 8, 32, jnp.bfloat16),
]


@pytest.mark.parametrize("num_ranks,num_tokens,hidden,topk,num_experts,dtype", CASES)
@pytest.mark.parametrize("empty_rank", [None, "last"])
def test_dispatch_combine_match_reference(num_ranks, num_tokens, hidden, topk, num_experts, dtype, empty_rank):
    rng = np.random.default_rng(hash((num_ranks, num_tokens, hidden, topk, empty_rank)) % 2**32)
    empty = (num_ranks - 1) if (empty_rank and num_ranks > 1) else None
    idx = ref.random_routing(rng, num_ranks, num_tokens, topk, num_experts, empty_rank=empty)
    x = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
    w = rng.random((num_ranks, num_tokens, topk)).astype(np.float32)
    x_dev = jnp.asarray(x, dtype)
    x_ref = np.asarray(x_dev.astype(jnp.float32))  # what actually went in
    recv_x, recv_idx, recv_w, n, per_expert, combined = _run(num_ranks, x_dev, jnp.asarray(idx), jnp.asarray(w),
                                                             num_experts)
    expected = ref.dispatch(x_ref, idx, w, num_experts)
    capacity = num_ranks * num_tokens
    for r, e in enumerate(expected):
        m = e["num_tokens"]
        assert n[r, 0] == m
        np.testing.assert_array_equal(recv_x[r, :m].astype(np.float32), e["x"])  # moved bit-exactly
        np.testing.assert_array_equal(recv_idx[r, :m], e["topk_idx"])
        np.testing.assert_array_equal(recv_w[r, :m], e["topk_weights"])
        np.testing.assert_array_equal(per_expert[r], e["num_tokens_per_expert"])
        # Padding: zeros and no expert.
        assert recv_x.shape[1] == capacity
        assert np.all(recv_x[r, m:].astype(np.float32) == 0)
        assert np.all(recv_idx[r, m:] == -1) and np.all(recv_w[r, m:] == 0)
        if empty is not None and r == empty:
            assert m == 0
    # Combine: each received row was transformed as rows*(rank+1)+1 on its receiving rank.
    ys = []
    for r, e in enumerate(expected):
        y = e["x"].astype(np.float64) * (r + 1) + 1
        ys.append(np.asarray(jnp.asarray(y, dtype).astype(jnp.float32)))
    want = ref.combine(ys, expected, num_tokens)
    tol = dict(rtol=1e-6, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(combined.astype(np.float32), want, **tol)
    never_sent = ~(idx >= 0).any(-1)
    assert np.all(combined[never_sent] == 0)


def test_fp8_pair_travels_with_its_scales():
    num_ranks, num_tokens, hidden, topk, num_experts = 4, 19, 256, 3, 8
    rng = np.random.default_rng(11)
    idx = ref.random_routing(rng, num_ranks, num_tokens, topk, num_experts)
    x = jnp.asarray(rng.standard_normal((num_ranks, num_tokens, hidden)) * 3, jnp.float8_e4m3fn)
    scales = jnp.asarray(rng.random((num_ranks, num_tokens, hidden // 128)) + 0.5, jnp.float32)
    recv, recv_idx, _, n, _, _ = _run(num_ranks, (x, scales), jnp.asarray(idx), None, num_experts)
    recv_x, recv_s = recv
    assert recv_x.dtype == jnp.float8_e4m3fn
    expected_x = ref.dispatch(np.asarray(x.astype(jnp.float32)), idx, None, num_experts)
    expected_s = ref.dispatch(np.asarray(scales), idx, None, num_experts)
    for r in range(num_ranks):
        m = expected_x[r]["num_tokens"]
        assert n[r, 0] == m
        np.testing.assert_array_equal(recv_x[r, :m].astype(np.float32), expected_x[r]["x"])
        np.testing.assert_array_equal(recv_s[r, :m], expected_s[r]["x"])
        np.testing.assert_array_equal(recv_idx[r, :m], expected_x[r]["topk_idx"])


def test_layout_counts():
    num_ranks, num_tokens, topk, num_experts = 4, 50, 4, 16
    rng = np.random.default_rng(5)
    idx = ref.random_routing(rng, num_ranks, num_tokens, topk, num_experts)

    def body(i):
        lay = ep.get_dispatch_layout(i[0], num_experts=num_experts, axis_name="ep")
        return jax.tree.map(lambda a: a[None], tuple(lay))

    f = jax.jit(jax.shard_map(body, mesh=_mesh(num_ranks), in_specs=P("ep"), out_specs=P("ep")))
    per_rank, per_expert, in_rank = map(np.asarray, f(jnp.asarray(idx)))
    for s in range(num_ranks):
        owners = np.where(idx[s] >= 0, idx[s] // (num_experts // num_ranks), -1)
        want_in_rank = np.stack([(owners == r).any(-1) for r in range(num_ranks)], -1)
        np.testing.assert_array_equal(in_rank[s], want_in_rank)
        np.testing.assert_array_equal(per_rank[s], want_in_rank.sum(0))
        np.testing.assert_array_equal(per_expert[s], np.bincount(idx[s][idx[s] >= 0], minlength=num_experts))


def test_gradients_match_dense_reference():
    num_ranks, num_tokens, hidden, topk, num_experts = 4, 12, 128, 3, 8
    rng = np.random.default_rng(3)
    idx = jnp.asarray(ref.random_routing(rng, num_ranks, num_tokens, topk, num_experts))
    x = jnp.asarray(rng.standard_normal((num_ranks, num_tokens, hidden)), jnp.float32)
    w = jnp.asarray(rng.random((num_ranks, num_tokens, topk)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((num_ranks, num_tokens, hidden)), jnp.float32)

    def ep_loss(x, w):
        def body(x, idx, w, c):
            res = ep.dispatch(x[0], idx[0], w[0], num_experts=num_experts, axis_name="ep")
            rank = jax.lax.axis_index("ep").astype(jnp.float32)
            y = jnp.tanh(res.x) * (rank + 1) * res.topk_weights.sum(-1, keepdims=True)
            out = ep.combine(y, res.handle)
            return jax.lax.psum(jnp.sum(out * c[0]), "ep")[None]

        f = jax.shard_map(body, mesh=_mesh(num_ranks), in_specs=P("ep"), out_specs=P("ep"))
        return f(x, idx, w, c)[0]

    def dense_loss(x, w):
        owner = jnp.where(idx >= 0, idx // (num_experts // num_ranks), 0).astype(jnp.float32)
        scale = jnp.sum(jnp.where(idx >= 0, w * (owner + 1), 0.0), -1, keepdims=True)
        return jnp.sum(jnp.tanh(x) * scale * c)

    got = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1)))(x, w)
    want = jax.value_and_grad(dense_loss, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1][0], want[1][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1][1], want[1][1], rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(got[1][1])).sum() > 0


def test_two_ep_meshes_in_one_program():
    rng = np.random.default_rng(8)
    num_tokens, hidden, topk, num_experts = 10, 128, 2, 8
    idx = ref.random_routing(rng, 4, num_tokens, topk, num_experts)
    x = rng.standard_normal((4, num_tokens, hidden)).astype(np.float32)
    mesh4 = _mesh(4)
    mesh2x2 = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "ep"))

    def roundtrip(x, i):
        res = ep.dispatch(x[0], i[0], num_experts=num_experts, axis_name="ep")
        return ep.combine(res.x, res.handle)[None]

    f4 = jax.shard_map(roundtrip, mesh=mesh4, in_specs=P("ep"), out_specs=P("ep"))
    f22 = jax.shard_map(roundtrip, mesh=mesh2x2, in_specs=P(("dp", "ep")), out_specs=P(("dp", "ep")))
    a, b = jax.jit(lambda x, i: (f4(x, i), f22(x, i)))(jnp.asarray(x), jnp.asarray(idx))
    # Over 4 ranks a token is summed once per owning rank; over 2x2, ranks {0,1} and {2,3} are separate groups.
    owners4 = np.where(idx >= 0, idx // 2, -1)
    copies4 = np.stack([(owners4 == r).any(-1) for r in range(4)], -1).sum(-1)
    owners2 = np.where(idx >= 0, idx // 4, -1)
    copies2 = np.stack([(owners2 == r).any(-1) for r in range(2)], -1).sum(-1)
    np.testing.assert_allclose(np.asarray(a), x * copies4[..., None], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(b), x * copies2[..., None], rtol=1e-6)


def test_back_to_back_calls_reuse_buffers_safely():
    # Many dispatch/combine rounds in one jit with no host sync; each round routes differently.
    num_ranks, num_tokens, hidden, topk, num_experts, rounds = 4, 8, 128, 2, 8, 6
    rng = np.random.default_rng(21)
    idx = np.stack([ref.random_routing(rng, num_ranks, num_tokens, topk, num_experts) for _ in range(rounds)], 1)
    x = rng.standard_normal((num_ranks, rounds, num_tokens, hidden)).astype(np.float32)

    def body(x, i):
        outs = []
        for k in range(rounds):
            res = ep.dispatch(x[0, k], i[0, k], num_experts=num_experts, axis_name="ep")
            outs.append(ep.combine(res.x * 2, res.handle))
        return jnp.stack(outs)[None]

    f = jax.jit(jax.shard_map(body, mesh=_mesh(num_ranks), in_specs=P("ep"), out_specs=P("ep")))
    got = np.asarray(f(jnp.asarray(x), jnp.asarray(idx)))
    owners = np.where(idx >= 0, idx // (num_experts // num_ranks), -1)
    copies = np.stack([(owners == r).any(-1) for r in range(num_ranks)], -1).sum(-1)
    np.testing.assert_allclose(got, 2 * x * copies[..., None], rtol=1e-6)


def multi_process_roundtrip(seed: int) -> dict:
    """Child: R = all devices of all processes; checks dispatch and combine against the reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    import jax_uccl_ep as ep
    import reference as ref

    ep.initialize()
    num_ranks = jax.device_count()
    num_tokens, hidden, topk, num_experts = 21, 256, 4, 4 * num_ranks
    rng = np.random.default_rng(seed)  # same on every process: each builds the global arrays
    idx = ref.random_routing(rng, num_ranks, num_tokens, topk, num_experts)
    x = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))

    def body(x, i):
        res = ep.dispatch(x[0], i[0], num_experts=num_experts, axis_name="ep")
        return res.x[None], res.num_tokens[None, None], ep.combine(res.x * 3, res.handle)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    sharding = jax.sharding.NamedSharding(mesh, P("ep"))
    gx = jax.make_array_from_callback(x.shape, sharding, lambda s: x[s])
    gi = jax.make_array_from_callback(idx.shape, sharding, lambda s: idx[s])
    recv, n, combined = (np.asarray(multihost_utils.process_allgather(a, tiled=True)) for a in f(gx, gi))
    expected = ref.dispatch(x, idx, None, num_experts)
    errors = []
    for r, e in enumerate(expected):
        m = e["num_tokens"]
        if n[r, 0] != m or not np.array_equal(recv[r, :m], e["x"]):
            errors.append(f"rank {r} dispatch differs")
    owners = np.where(idx >= 0, idx // 4, -1)
    copies = np.stack([(owners == r).any(-1) for r in range(num_ranks)], -1).sum(-1)
    if not np.allclose(combined, 3 * x * copies[..., None], rtol=1e-6):
        errors.append("combine differs")
    ep.shutdown()
    return {"errors": errors, "ranks": num_ranks}


@pytest.mark.parametrize("provider,reorder", [("shm", "0"), ("tcp;ofi_rxm", "1")])
def test_across_processes(provider, reorder):
    env = {"UCCL_EP_FI_PROVIDER": provider, "UCCL_EP_REORDER": reorder, "UCCL_EP_POISON": "1"}
    results = launch_ok(HERE, "multi_process_roundtrip", 2, args=[17], devices_per_process=2, env=env)
    for r in results:
        assert r["ranks"] == 4
        assert r["errors"] == []


def independent_chains(iterations: int) -> dict:
    """Child: gradients through dispatch with weights (two independent combines in the backward pass)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_uccl_ep as ep

    ep.initialize()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
    num_ranks = jax.device_count()
    num_tokens, hidden, topk, num_experts = 256, 64, 2, 2 * num_ranks
    sharding = jax.sharding.NamedSharding(mesh, P("ep"))
    errors = []

    def loss(x, w, i):
        def body(x, w, i):
            res = ep.dispatch(x[0], i[0], w[0], num_experts=num_experts, axis_name="ep")
            y = jnp.tanh(res.x) * res.topk_weights.sum(-1, keepdims=True)
            return jax.lax.psum(jnp.sum(ep.combine(y, res.handle)), "ep")[None]

        return jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(x, w, i)[0]

    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for it in range(iterations):
        rng = np.random.default_rng(it)
        x = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
        w = rng.random((num_ranks, num_tokens, topk)).astype(np.float32)
        i = np.stack([np.stack([rng.choice(num_experts, topk, replace=False) for _ in range(num_tokens)])
                      for _ in range(num_ranks)]).astype(np.int32)
        args = [jax.make_array_from_callback(a.shape, sharding, lambda s, a=a: a[s]) for a in (x, w, i)]
        try:
            jax.block_until_ready(g(*args))
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(str(e)[:300])
            break
    ep.shutdown()
    return {"errors": errors}


def test_backward_pass_ops_keep_one_order_across_processes():
    results = launch_ok(HERE, "independent_chains", 4, args=[15], env={"UCCL_EP_TIMEOUT_S": "20"})
    for r in results:
        assert r["errors"] == []
