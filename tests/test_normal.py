"""Normal-mode dispatch/combine on CPU devices against the NumPy reference: values, layout, grads, errors."""

from __future__ import annotations

import os
import zlib

import cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from mp import launch_ok

import jax_uccl_ep as ep

HERE = os.path.abspath(__file__)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    ep.initialize()
    yield


def _mesh(num_ranks: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:num_ranks]), ("ep",))


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
    empty = (num_ranks - 1) if (empty_rank and num_ranks > 1) else None
    # A seed from the case itself, the same in every process and run (hash() of a str is salted per process).
    seed = zlib.crc32(repr((num_ranks, num_tokens, hidden, topk, empty_rank)).encode())
    assert (
        cases.check_case(_mesh(num_ranks), seed, num_tokens, hidden, topk, num_experts, dtype, empty_rank=empty) == []
    )


def test_fp8_pair_travels_with_its_scales():
    assert cases.check_fp8(_mesh(4), 11, 19, 256, 3, 8) == []


def test_gradients_match_dense_reference():
    assert cases.check_gradients(_mesh(4), 3, 12, 128, 3, 8) == []


def test_each_weight_gets_its_owners_cotangent_only():
    """The loss sums every received weight on every rank, padding and slots the rank does not own included, so the
    cotangent of each received weight is 1: each routed slot's weight gets exactly 1 (from its one owner) and a
    masked slot 0. Counting the cotangents of ranks that got the token for another slot gives 2 or more."""
    r, t, k, e = 4, 10, 3, 8
    rng = np.random.default_rng(17)
    idx = ref.random_routing(rng, r, t, k, e)
    x = rng.standard_normal((r, t, 128)).astype(np.float32)
    w = rng.random((r, t, k)).astype(np.float32)
    mesh = _mesh(r)

    def body(x, idx, w):
        res = ep.dispatch(x[0], idx[0], w[0], num_experts=e, axis_name="ep")
        return jnp.sum(res.topk_weights)[None]

    def loss(w):
        return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(x, idx, w))

    grad = np.asarray(jax.jit(jax.grad(loss))(w))
    assert (idx >= 0).any(-1).sum() > 0 and (idx < 0).any()  # routed and masked slots both present
    np.testing.assert_array_equal(grad, (idx >= 0).astype(np.float32))


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
    """Child: R = all devices of all processes; dispatch, combine and gradients against the reference."""
    import cases
    import jax
    import jax.numpy as jnp

    import jax_uccl_ep as ep

    ep.initialize()
    mesh = cases.mesh_of(jax.devices())
    num_ranks = mesh.devices.size
    problems = cases.check_case(mesh, seed, 21, 256, 4, 4 * num_ranks, jnp.float32)
    problems += cases.check_gradients(mesh, seed + 1, 9, 128, 3, 2 * num_ranks)
    ep.shutdown()
    return {"errors": problems, "ranks": num_ranks}


@pytest.mark.parametrize("provider,reorder,threads", [("shm", "0", "1"), ("tcp;ofi_rxm", "1", "1"), ("shm", "1", "3")])
def test_across_processes(provider, reorder, threads):
    # Several proxy threads: each message is striped over their channels, the acks ride channel 0.
    env = {
        "UCCL_EP_FI_PROVIDER": provider,
        "UCCL_EP_REORDER": reorder,
        "UCCL_EP_POISON": "1",
        "UCCL_EP_NUM_PROXY_THREADS": threads,
        "UCCL_EP_MAX_WRITE_BYTES": "4096",
    }
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
        i = np.stack(
            [
                np.stack([rng.choice(num_experts, topk, replace=False) for _ in range(num_tokens)])
                for _ in range(num_ranks)
            ]
        ).astype(np.int32)
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
