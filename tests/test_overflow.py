"""Capacity overflow without a restart: overflow="drop" keeps each rank's first `capacity` rows (by source rank,
then token), counts the rest and returns zeros for them in combine; overflow="error" fails the op on every rank and
leaves the runtime usable. One process with 4 CPU devices, and two processes of 2 devices each."""

from __future__ import annotations

import os

import cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mp import describe, launch

import jax_uccl_ep as ep
from jax_uccl_ep import layers

HERE = os.path.abspath(__file__)
R = 4


@pytest.fixture(scope="module", autouse=True)
def runtime():
    ep.initialize()
    yield


def _mesh() -> Mesh:
    return cases.mesh_of(jax.devices()[:R])


@pytest.mark.parametrize(
    "num_tokens,topk,num_experts,capacity",
    [(24, 3, 16, 20), (17, 2, 8, 9), (12, 4, 32, 1)],
    ids=["some-rows", "most-rows", "capacity-1"],
)
def test_drop_keeps_the_first_rows_and_combines_only_those(num_tokens, topk, num_experts, capacity):
    problems = cases.check_drop(_mesh(), 11 + capacity, num_tokens, 128, topk, num_experts, capacity)
    assert not problems, problems


def test_drop_that_drops_nothing_is_the_plain_dispatch():
    # Capacity for every row that arrives: the same rows and sums as without a capacity.
    mesh = _mesh()
    x, x_ref, idx, w = cases.random_case(3, R, 10, 128, 2, 8, jnp.float32)

    def body(x, idx, w):
        a = ep.dispatch(x[0], idx[0], w[0], num_experts=8, axis_name="ep", capacity=R * 10, overflow="drop")
        b = ep.dispatch(x[0], idx[0], w[0], num_experts=8, axis_name="ep")
        return jax.tree.map(lambda v: v[None], (a.x, b.x, a.num_dropped, ep.combine(a.x, a.handle)))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    a, b, dropped, out = (np.asarray(v) for v in f(*(cases.shard(mesh, v) for v in (x, idx, w))))
    np.testing.assert_array_equal(a, b)
    assert not dropped.any()
    owners = np.where(idx >= 0, idx // 2, -1)
    copies = np.stack([(owners == r).any(-1) for r in range(R)], -1).sum(-1)
    np.testing.assert_allclose(out, x_ref * copies[..., None], rtol=1e-6)


def test_error_leaves_the_runtime_usable():
    mesh = _mesh()
    message = cases.overflow_error(mesh, 5, 6, 128, 8, capacity=5)
    assert f"rank 0 received {R * 6} tokens but capacity is 5" in message
    assert "overflow='drop'" in message  # says what to do
    # No shutdown/initialize: the next ops are exact.
    assert not cases.check_case(mesh, 6, 10, 128, 2, 8, jnp.float32)
    assert not cases.check_drop(mesh, 7, 24, 128, 3, 16, 20)


@pytest.mark.parametrize("rows", [3, 24])
def test_combine_under_drop_takes_y_of_the_dispatch_capacity_only(rows):
    """Under "drop" combine keeps y's first rows as the dispatch kept its first: a y of other rows would return
    kept rows as zeros (shorter) or dropped ones as kept (longer), so it is refused, naming the capacity; y of the
    capacity runs."""
    mesh = _mesh()
    x = jnp.asarray(np.random.default_rng(4).standard_normal((R * 6, 16)), jnp.float32)
    idx = jnp.zeros((R * 6, 1), jnp.int32)  # every token to expert 0: rank 0 receives 24 rows, keeps 8

    def body(x, idx, y_rows):
        r = ep.dispatch(x, idx, num_experts=8, axis_name="ep", capacity=8, overflow="drop")
        y = r.x[:y_rows] if y_rows <= 8 else jnp.concatenate([r.x, jnp.ones((y_rows - 8, 16))])
        return ep.combine(y, r.handle)

    def run(y_rows):
        f = jax.shard_map(lambda a, b: body(a, b, y_rows), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        return np.asarray(jax.jit(f)(x, idx))

    with pytest.raises(
        ValueError, match=rf"y must have the dispatch's 8 rows \(its capacity, overflow='drop'\), got {rows}"
    ):
        run(rows)
    out = run(8)
    kept = (out != 0).any(-1)
    np.testing.assert_allclose(out[kept], np.asarray(x)[kept], rtol=1e-6)
    assert kept.sum() == 8


def test_overflow_policy_is_checked():
    mesh = _mesh()
    x = jnp.ones((R, 4, 128))
    idx = jnp.zeros((R, 4, 1), jnp.int32)
    f = jax.shard_map(
        lambda x, i: ep.dispatch(x[0], i[0], num_experts=R, axis_name="ep", overflow="truncate").x[None],
        mesh=mesh,
        in_specs=P("ep"),
        out_specs=P("ep"),
    )
    with pytest.raises(ValueError, match="overflow must be 'error' or 'drop', got 'truncate'"):
        jax.jit(f)(x, idx)


def _masked_reference(params, x, config, keep):
    """The dense layer with the router's weights of dropped (token, slot) pairs set to 0 (`keep` [T, K] bool)."""
    tokens = x.reshape(-1, x.shape[-1])
    # Softmax top-k, renormalized, from the spec (not layers.route: the layer is what this checks).
    weights, idx = jax.lax.top_k(jax.nn.softmax(tokens @ params["router"], axis=-1), config.top_k)
    weights = jnp.where(keep, weights / jnp.sum(weights, axis=-1, keepdims=True), 0.0)
    gate = jnp.einsum("td,edf->etf", tokens, params["w_gate"])
    up = jnp.einsum("td,edf->etf", tokens, params["w_up"])
    out = jnp.einsum("etf,efd->etd", jax.nn.silu(gate) * up, params["w_down"])
    coef = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(idx, config.num_experts))
    return jnp.einsum("te,etd->td", coef, out).reshape(x.shape)


def test_the_layer_overflowing_its_capacity_factor_names_what_to_raise():
    """overflow="error" in the layer: the error speaks of the knob a layer user holds (MoEConfig.capacity_factor),
    and the runtime stays usable."""
    config = layers.MoEConfig(num_experts=16, top_k=3, capacity_factor=0.25, overflow="error")
    mesh = _mesh()
    specs = layers.moe_param_specs("ep")
    host = layers.init_moe_params(jax.random.key(10), d_model=128, d_ff=64, num_experts=16)
    params = {n: jax.device_put(v, NamedSharding(mesh, specs[n])) for n, v in host.items()}
    x = jax.device_put(jax.random.normal(jax.random.key(11), (8, 6, 128)), NamedSharding(mesh, P("ep")))
    with pytest.raises(Exception, match=r"the layer: a larger MoEConfig.capacity_factor\) or overflow='drop'"):
        jax.block_until_ready(jax.jit(lambda p, x: layers.moe_ffn(p, x, mesh=mesh, config=config).y)(params, x))
    assert cases.check_case(mesh, 78, 20, 256, 2, 2 * R, jnp.float32) == []


def test_layer_with_a_capacity_factor_drops_rows_and_matches_the_masked_reference():
    b, s, d, e, k = 8, 6, 128, 16, 3
    config = layers.MoEConfig(num_experts=e, top_k=k, capacity_factor=0.5)
    mesh = _mesh()
    kp, kx = jax.random.split(jax.random.key(9))
    host = layers.init_moe_params(kp, d_model=d, d_ff=64, num_experts=e)
    x = jax.random.normal(kx, (b, s, d))
    specs = layers.moe_param_specs("ep")
    params = {n: jax.device_put(v, NamedSharding(mesh, specs[n])) for n, v in host.items()}
    xs = jax.device_put(x, NamedSharding(mesh, P("ep")))

    def loss(p, x):
        out = layers.moe_ffn(p, x, mesh=mesh, config=config)
        return jnp.sum(out.y**2), out

    (value, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, xs)

    # Which (token, slot) pairs survive, from the routing alone: rank r takes the tokens that have an expert on it
    # in order (by source rank, then token) while their pairs on it fit in `capacity` pairs; from the first that
    # does not fit on, none.
    tokens_per_rank = b * s // R
    capacity = layers.capacity_for(tokens_per_rank, k, R, 0.5, e)
    # Half the pairs a rank gets on average: every rank sends tokens_per_rank * k pairs, spread over the R ranks.
    assert capacity == int(np.ceil(0.5 * tokens_per_rank * k))
    _, idx, _ = reference.moe_route(np.asarray(host["router"]), np.asarray(x).reshape(-1, d), k)
    owner = idx.reshape(R, tokens_per_rank, k) // (e // R)
    keep = np.zeros_like(owner, bool)
    taken, full = np.zeros(R, int), np.zeros(R, bool)
    rows_kept, pairs_all = np.zeros(R, int), np.zeros(R, int)
    for src in range(R):
        for t in range(tokens_per_rank):
            for r in sorted(set(owner[src, t].tolist())):
                mine = owner[src, t] == r
                pairs_all[r] += mine.sum()
                full[r] |= taken[r] + mine.sum() > capacity
                if not full[r]:
                    keep[src, t] |= mine
                    taken[r] += mine.sum()
                    rows_kept[r] += 1
    want_dropped = pairs_all - taken
    assert want_dropped.sum() > 0  # the case overflows
    np.testing.assert_array_equal(np.asarray(out.stats.pairs_dropped), want_dropped)
    np.testing.assert_array_equal(np.asarray(out.stats.rows_received), rows_kept)

    keep = jnp.asarray(keep.reshape(-1, k))
    want_value, want_grads = jax.value_and_grad(lambda p: jnp.sum(_masked_reference(p, x, config, keep) ** 2))(host)
    np.testing.assert_allclose(np.asarray(out.y), np.asarray(_masked_reference(host, x, config, keep)), atol=2e-5)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for n in host:
        np.testing.assert_allclose(np.asarray(grads[n]), np.asarray(want_grads[n]), rtol=1e-4, atol=1e-5, err_msg=n)


def overflow_across_processes() -> dict:
    """Child (2 processes x 2 devices): overflow="error" on rank 0 raises in every process, the next ops are exact
    without a restart; then overflow="drop" against the reference."""
    import cases
    import jax
    import jax.numpy as jnp

    import jax_uccl_ep as ep

    ep.initialize()
    mesh = cases.mesh_of(sorted(jax.devices(), key=lambda d: d.id))
    r = mesh.devices.size
    result = {"error": cases.overflow_error(mesh, 21, 8, 128, 2 * r, capacity=3)}
    result["after_error"] = cases.check_case(mesh, 22, 10, 128, 2, 2 * r, jnp.float32)
    result["drop"] = cases.check_drop(mesh, 23, 20, 128, 3, 4 * r, 14)
    ep.shutdown()
    return result


def test_overflow_across_processes_raises_everywhere_and_drops_exactly():
    results = launch(HERE, "overflow_across_processes", 2, devices_per_process=2, timeout_s=240)
    assert all(res.ok for res in results), describe(results)
    for res in results:
        assert "rank 0 received 32 tokens but capacity is 3" in res.result["error"], res.result["error"]
        assert res.result["after_error"] == [] and res.result["drop"] == [], res.result
