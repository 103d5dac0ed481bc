"""Bad input and misuse: each case fails with an error that names what is wrong, and the runtime stays usable."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from mp import describe, launch, launch_ok

import jax_uccl_ep as ep

HERE = os.path.abspath(__file__)
R, T, H, K, E = 4, 6, 128, 2, 8


@pytest.fixture(scope="module", autouse=True)
def runtime():
    ep.initialize()
    yield


def _call(x, idx, w=None, *, num_experts=E, capacity=None, ranks=R):
    mesh = Mesh(np.array(jax.devices()[:ranks]), ("ep",))

    def body(x, idx, *w):
        res = ep.dispatch(
            x[0], idx[0], w[0][0] if w else None, num_experts=num_experts, axis_name="ep", capacity=capacity
        )
        out = ep.combine(res.x, res.handle)
        return out[None], res.num_tokens[None], (res.topk_weights[None] if w else res.num_tokens[None])

    args = (x, idx) + ((w,) if w is not None else ())
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    return jax.tree.map(np.asarray, f(*args))


def _inputs(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R, T, H)), dtype)
    idx = ref.random_routing(rng, R, T, K, E)
    w = jnp.asarray(rng.random((R, T, K)), jnp.float32)
    return x, idx, w


def _check_roundtrip_still_works():
    x, idx, _ = _inputs(seed=99)
    out, _, _ = _call(x, jnp.asarray(idx))
    owners = np.where(idx >= 0, idx // (E // R), -1)
    copies = np.stack([(owners == r).any(-1) for r in range(R)], -1).sum(-1)
    np.testing.assert_allclose(out, np.asarray(x) * copies[..., None], rtol=1e-6)


@pytest.mark.parametrize("where", ["one_rank", "every_rank"])
@pytest.mark.parametrize("bad", [E, 1000, -2])
def test_expert_index_out_of_range(where, bad):
    x, idx, _ = _inputs()
    if where == "one_rank":
        idx[2, 3, 1] = bad
    else:
        idx[:, 0, 0] = bad
    with pytest.raises(Exception, match=rf"topk_idx\[\d+, \d\] = {bad} is outside \[-1, num_experts={E}\)"):
        _call(x, jnp.asarray(idx))
    _check_roundtrip_still_works()


def test_layout_rejects_bad_expert_index():
    _, idx, _ = _inputs()
    idx[1, 2, 0] = E + 5
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    f = jax.jit(
        jax.shard_map(
            lambda i: ep.get_dispatch_layout(i[0], num_experts=E, axis_name="ep")[0][None],
            mesh=mesh,
            in_specs=P("ep"),
            out_specs=P("ep"),
        )
    )
    with pytest.raises(Exception, match="is outside"):
        np.asarray(f(jnp.asarray(idx)))


def test_capacity_exceeded_names_rank_count_and_capacity():
    x, idx, _ = _inputs()
    idx[:] = -1
    idx[:, :, 0] = 0  # every token of every rank goes to expert 0 on rank 0: R*T tokens arrive there
    with pytest.raises(Exception, match=rf"rank 0 received {R * T} tokens but capacity is 5"):
        _call(x, jnp.asarray(idx), capacity=5)
    # Every rank failed in that op, so they stay in step: no restart.
    _check_roundtrip_still_works()


def test_capacity_large_enough_is_exact():
    """Every token to rank 0's experts (a random one or two of them each) with capacity R*T, exactly what arrives:
    rows in (source rank, token) order with their local experts and weights, and a combine of rows scaled per
    expert gives each token its own weighted sum."""
    x, _, w = _inputs()
    rng = np.random.default_rng(5)
    idx = np.full((R, T, K), -1, np.int32)
    for s in range(R):
        for t in range(T):
            idx[s, t, : 1 + t % 2] = rng.choice(E // R, size=1 + t % 2, replace=False)
    factor = 1.0 + np.arange(E // R, dtype=np.float32)  # local expert l scales by 1 + l
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))

    def body(x, idx, w):
        res = ep.dispatch(x[0], idx[0], w[0], num_experts=E, axis_name="ep", capacity=R * T)
        mine = res.topk_idx >= 0
        coef = jnp.sum(jnp.where(mine, res.topk_weights * jnp.asarray(factor)[jnp.maximum(res.topk_idx, 0)], 0), -1)
        out = ep.combine(res.x * coef[:, None], res.handle)
        return jax.tree.map(lambda a: a[None], (out, res.x, res.topk_idx, res.num_tokens))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    out, rows, got_idx, n = jax.tree.map(np.asarray, f(x, jnp.asarray(idx), w))
    want = ref.dispatch(np.asarray(x), idx, np.asarray(w), E)
    assert n[0] == R * T and n[1:].sum() == 0
    np.testing.assert_array_equal(rows[0], want[0]["x"])  # the order too: source rank, then token
    np.testing.assert_array_equal(got_idx[0], want[0]["topk_idx"])
    wn = np.asarray(w, np.float64)
    coef = np.where(idx >= 0, wn * factor[np.maximum(idx, 0)], 0).sum(-1)
    np.testing.assert_allclose(out, np.asarray(x) * coef[..., None], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda x, i, w: (x[..., 0], i, w), r"expected \[..., tokens, hidden\] with at least 2 dimensions"),
        (lambda x, i, w: (x.astype(jnp.int32), i, w), "x must be float32, bfloat16 or float16"),
        (lambda x, i, w: (x, i.astype(jnp.float32), w), "topk_idx must hold integers"),
        (lambda x, i, w: (x, i[..., 0], w), r"topk_idx must be \[..., K\] with x's leading dimensions"),
        (lambda x, i, w: (x, i, w[..., :1]), "topk_weights must have the shape of topk_idx"),
        (lambda x, i, w: (x, i, w.astype(jnp.int32)), "topk_weights must be floating point"),
    ],
)
def test_wrong_shapes_and_dtypes_fail_at_trace_time(change, message):
    x, idx, w = _inputs()
    x2, i2, w2 = change(x, jnp.asarray(idx), w)
    with pytest.raises(ValueError, match=message):
        _call(x2, i2, w2)


def test_num_experts_must_divide_by_axis_size():
    x, idx, _ = _inputs()
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the axis size 4"):
        _call(x, jnp.asarray(np.minimum(idx, 5)), num_experts=6)


def test_fp8_hidden_must_be_multiple_of_128():
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    x = jnp.ones((2, 4, 96), jnp.float8_e4m3fn)
    s = jnp.ones((2, 4, 1), jnp.float32)
    idx = jnp.zeros((2, 4, 1), jnp.int32)
    f = jax.shard_map(
        lambda x, s, i: ep.dispatch((x[0], s[0]), i[0], num_experts=2, axis_name="ep").num_tokens[None],
        mesh=mesh,
        in_specs=P("ep"),
        out_specs=P("ep"),
    )
    with pytest.raises(ValueError, match="FP8 hidden size must be a multiple of 128, got 96"):
        jax.jit(f)(x, s, idx)


def test_combine_rejects_wrong_dtype_and_handle():
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))

    def body(x, i):
        res = ep.dispatch(x[0], i[0], num_experts=2, axis_name="ep")
        return ep.combine(res.x.astype(jnp.int32), res.handle)[None]

    f = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    with pytest.raises(ValueError, match="y must be float32, bfloat16 or float16"):
        jax.jit(f)(jnp.ones((2, 3, 128)), jnp.zeros((2, 3, 1), jnp.int32))
    with pytest.raises(ValueError, match="handle must be"):
        ep.combine(jnp.ones((3, 128)), (1, 2, 3))


def test_nan_weights_pass_through_unchanged():
    x, idx, w = _inputs()
    w = np.asarray(w).copy()
    w[1, 2, :] = np.nan
    _, _, recv_w = _call(x, jnp.asarray(idx), jnp.asarray(w))
    expected = ref.dispatch(np.asarray(x), idx, w, E)
    for r, e in enumerate(expected):
        m = e["num_tokens"]
        np.testing.assert_array_equal(recv_w[r, :m], e["topk_weights"].astype(np.float32))  # NaN == NaN here


def lifecycle(cycles: int) -> dict:
    """Child: ops before initialize and after shutdown fail clearly; initialize/shutdown many times."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jax_uccl_ep as ep

    mesh = Mesh(np.array(jax.devices()), ("ep",))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 128)), jnp.float32)
    idx = jnp.asarray(np.random.default_rng(1).integers(0, 4, (2, 4, 2)), jnp.int32)

    def body(x, i):
        res = ep.dispatch(x[0], i[0], num_experts=4, axis_name="ep")
        return ep.combine(res.x, res.handle)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    errors = []
    try:
        np.asarray(f(x, idx))
        errors.append("no error before initialize")
    except Exception as e:
        before = str(e)
    ok = 0
    for _ in range(cycles):
        ep.initialize()
        ep.initialize()  # idempotent
        ok += int(ep.is_initialized())
        np.asarray(f(x, idx))
        ep.shutdown()
    try:
        np.asarray(f(x, idx))
        errors.append("no error after shutdown")
    except Exception as e:
        after = str(e)
    return {"errors": errors, "before": before, "after": after, "ok": ok, "initialized": ep.is_initialized()}


def test_calls_before_initialize_and_after_shutdown_fail_clearly():
    env = {"JAX_NUM_CPU_DEVICES": "2", "JAX_COORDINATOR_ADDRESS": ""}
    (r,) = launch_ok(HERE, "lifecycle", 1, args=[50], devices_per_process=2, env=env)
    assert r["errors"] == []
    for msg in (r["before"], r["after"]):
        assert "not initialized" in msg and "jax_uccl_ep.initialize()" in msg
    assert r["ok"] == 50 and r["initialized"] is False


def mismatched_hidden(mode: str = "normal") -> dict:
    """Child: the two processes run dispatch (normal or low-latency) with different hidden sizes."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jax_uccl_ep as ep

    ep.initialize()
    hidden = 128 * (1 + jax.process_index())
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    sharding = jax.sharding.NamedSharding(mesh, P("ep"))
    x = jax.make_array_from_callback((2, 4, hidden), sharding, lambda s: np.ones((1, 4, hidden), np.float32))
    i = jax.make_array_from_callback((2, 4, 1), sharding, lambda s: np.zeros((1, 4, 1), np.int32) + 1)
    if mode == "normal":

        def body(x, i):
            return ep.dispatch(x[0], i[0], num_experts=2, axis_name="ep").x[None]
    else:

        def body(x, i):
            return ep.low_latency_dispatch(
                x[0], i[0], num_experts=2, max_tokens_per_rank=4, axis_name="ep", use_fp8=False
            )[0][None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    try:
        f(x, i).block_until_ready()
        result = {"error": None}
    except Exception as e:
        result = {"error": str(e)}
    ep.shutdown()
    return result


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_mismatched_shapes_across_ranks_are_detected_not_hung(mode):
    results = launch(
        HERE,
        "mismatched_hidden",
        2,
        args=[mode],
        env={"UCCL_EP_TIMEOUT_S": "20", "UCCL_EP_TEST_HARD_EXIT": "1"},
        timeout_s=120,
    )
    assert all(r.ok for r in results), describe(results)
    for r in results:
        assert r.result["error"] is not None
        assert "shapes or op order differ across ranks" in r.result["error"]


def initialize_outcome() -> dict:
    """Child: initialize() (with JobShapes of UCCL_EP_TEST_SHAPES_TOKENS tokens where that is set, and a proxy buffer
    of UCCL_EP_TEST_PROXY_BYTES where that is) and report what it raised (None if it did not) and the proxy buffer
    it started with."""
    tokens, proxy_bytes = os.environ.get("UCCL_EP_TEST_SHAPES_TOKENS"), os.environ.get("UCCL_EP_TEST_PROXY_BYTES")
    try:
        ep.initialize(
            shapes=ep.JobShapes(int(tokens), 256, 2) if tokens else None,
            proxy_buffer_bytes=int(proxy_bytes) if proxy_bytes else None,
        )
    except ValueError as exc:
        return {"error": str(exc)}
    buffer_bytes = ep.config().buffer_bytes
    ep.shutdown()
    return {"error": None, "buffer_bytes": buffer_bytes}


def test_processes_with_different_settings_are_refused_at_initialize():
    """Peers compute where their messages land from their own buffer layout: a process whose buffer (or channels)
    differs would corrupt them. Every process refuses, naming the setting and each process's value."""
    per_rank = [
        {"UCCL_EP_BUFFER_BYTES": str(8 << 20)},
        {"UCCL_EP_BUFFER_BYTES": str(16 << 20), "UCCL_EP_NUM_PROXY_THREADS": "2"},
    ]
    results = launch(HERE, "initialize_outcome", 2, per_rank_env=per_rank, timeout_s=120)
    assert all(x.ok for x in results), describe(results)
    for x in results:
        msg = x.result["error"]
        assert msg and "every process must use the same settings" in msg, x.result
        assert f"UCCL_EP_BUFFER_BYTES: process 0 {8 << 20}, process 1 {16 << 20}" in msg, msg
        assert "UCCL_EP_NUM_PROXY_THREADS: process 0 1, process 1 2" in msg, msg
        assert "UCCL_EP_HIERARCHICAL" not in msg, msg  # only what differs
    # The same settings everywhere: no complaint.
    same = [{"UCCL_EP_BUFFER_BYTES": str(8 << 20)}] * 2
    assert [x.result for x in launch(HERE, "initialize_outcome", 2, per_rank_env=same, timeout_s=120)] == [
        {"error": None, "buffer_bytes": 8 << 20}
    ] * 2


def test_processes_sizing_their_buffers_for_different_shapes_are_refused_at_initialize():
    """initialize(shapes=...) sizes the buffers from each process's JobShapes: processes that pass different ones
    would size differently, so every process refuses, naming them; with the same shapes both start on the buffer
    proxy_buffer_bytes gives for the job (2 ranks, one node)."""
    per_rank = [{"UCCL_EP_TEST_SHAPES_TOKENS": "100"}, {"UCCL_EP_TEST_SHAPES_TOKENS": "300"}]
    results = launch(HERE, "initialize_outcome", 2, per_rank_env=per_rank, timeout_s=120)
    assert all(x.ok for x in results), describe(results)
    for x in results:
        msg = x.result["error"]
        assert msg and "shapes: process 0 num_tokens=100, hidden=256" in msg and "process 1 num_tokens=300" in msg, msg
    results = launch(HERE, "initialize_outcome", 2, per_rank_env=[per_rank[1]] * 2, timeout_s=120)
    sized = ep.proxy_buffer_bytes(300, 256, num_ranks=2, topk=2, ranks_per_node=2, platform="cpu")
    assert [x.result for x in results] == [{"error": None, "buffer_bytes": sized}] * 2, describe(results)
    # The same shapes, but one process gives its buffer: the sizes that result differ, and both refuse.
    given = [{**per_rank[1], "UCCL_EP_TEST_PROXY_BYTES": str(64 << 20)}, per_rank[1]]
    for x in launch(HERE, "initialize_outcome", 2, per_rank_env=given, timeout_s=120):
        msg = x.result["error"]
        assert msg and f"UCCL_EP_BUFFER_BYTES: process 0 {64 << 20}, process 1 {sized}" in msg, x.result


def sub_axis_outcome(ep_ranks: str) -> dict:
    """Child (8 CPU devices as 2 nodes of 4): initialize(shapes=...) for EP groups of `ep_ranks` ranks ("" for the
    default, the whole job), then normal mode (weights carried) and low latency, BF16, over groups of 4 that span
    both nodes, 2 ranks on each (ranks 0, 1, 4, 5 and 2, 3, 6, 7), every slot on a group's last rank; the largest
    relative errors against NumPy, or the error raised."""
    t, n, h, k, e = (
        128,
        128,
        512,
        4,
        16,
    )  # top-4: a token's slots fill a rank of a group (4 experts), not of the job (2)
    size = int(ep_ranks) if ep_ranks else None
    ep.initialize(
        shapes=ep.JobShapes(
            t, h, k, num_experts=e, ep_ranks=size, low_latency_max_tokens=n, low_latency_fp8=False, backward=False
        )
    )
    d = sorted(jax.devices(), key=lambda d: d.id)
    mesh = Mesh(np.array([[d[0], d[1], d[4], d[5]], [d[2], d[3], d[6], d[7]]]), ("dp", "ep"))
    idx = jnp.asarray(np.tile(np.arange(e - k, e, dtype=np.int32), (8 * t, 1)))
    w = jnp.asarray(np.random.default_rng(15).random((8 * t, k)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(16).standard_normal((8 * t, h)), jnp.bfloat16)

    def body(x, i, w):
        r = ep.dispatch(x, i, w, num_experts=e, axis_name="ep")
        recv, _, handle = ep.low_latency_dispatch(
            x[:n], i[:n], num_experts=e, max_tokens_per_rank=n, axis_name="ep", use_fp8=False
        )
        return ep.combine(r.x, r.handle), ep.low_latency_combine(recv, i[:n], w[:n], handle)

    spec = P(("dp", "ep"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    try:
        out, out_ll = (np.asarray(a, np.float32) for a in f(x, idx, w))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        ep.shutdown()
        return {"error": str(exc)}
    xf = np.asarray(x, np.float32)
    per_rank = lambda a: a.reshape(8, t, -1)[:, :n].reshape(8 * n, -1)  # noqa: E731
    want_ll = per_rank(xf) * per_rank(np.asarray(w)).sum(-1, keepdims=True)
    errors = [float(np.abs(out - xf).max()), float((np.abs(out_ll - want_ll) / (np.abs(want_ll) + 1)).max())]
    ep.shutdown()
    return {"error": None, "errors": errors}


@pytest.mark.parametrize("two_level", ["1", "0"])
def test_shapes_of_ep_groups_smaller_than_the_job_size_the_buffer_for_their_rounds(two_level):
    """EP groups that span nodes but not the whole job run flat or in hierarchical rounds (two-level routing is for
    an axis over every rank), and low latency counts the group's local experts: JobShapes(ep_ranks=...) sizes for
    that, and the ops run the first time with every slot on a group's last rank; sized for the whole job (the
    default), the same ops outgrow the buffer."""
    env = {"UCCL_EP_GPUS_PER_NODE": "4", "UCCL_EP_TWO_LEVEL": two_level}
    kw = dict(devices_per_process=8, timeout_s=180, env=env)
    (sized,) = launch_ok(HERE, "sub_axis_outcome", 1, args=["4"], **kw)
    assert sized["error"] is None and sized["errors"][0] == 0 and sized["errors"][1] < 1e-2, sized
    (whole,) = launch_ok(HERE, "sub_axis_outcome", 1, args=[""], **kw)
    assert whole["error"] and "raise UCCL_EP_BUFFER_BYTES to at least" in whole["error"], whole


def test_initialize_sizes_the_proxy_buffer_from_the_shapes_unless_told():
    """initialize(shapes=...) on CPU devices starts the proxy runtime on what the shapes need on this job's ranks
    and nodes (one node; two nodes of two in hierarchical rounds), where the worst routing runs the first time; a
    buffer given to initialize() or by UCCL_EP_BUFFER_BYTES wins."""
    import dataclasses

    t, h = 60, 1023
    x = jnp.asarray(np.random.default_rng(14).standard_normal((R * t, h)), jnp.float32)
    idx = jnp.zeros((R * t, 1), jnp.int32)  # every token to rank 0
    shapes = ep.JobShapes(t, h, 1, dtype=jnp.float32, with_weights=False, combine_dtype=jnp.float32)
    two_nodes = dataclasses.replace(ep.Config.from_env(), gpus_per_node=2, hierarchical=True, two_level="0")
    sizes = dict(num_ranks=R, topk=1, **_F32_ROWS, platform="cpu")
    try:
        for config, per_node in ((None, R), (two_nodes, 2)):
            ep.shutdown()
            ep.initialize(config=config, shapes=shapes)
            assert ep.config().buffer_bytes == ep.proxy_buffer_bytes(
                t, h, **sizes, ranks_per_node=per_node, config=config
            )
            np.testing.assert_allclose(_dispatch_combine(x, idx), np.asarray(x), rtol=1e-6)
        # Low-latency ops alone: their worst routing (both slots on the last rank's experts) runs the first time.
        n, e = 24, 2 * R
        ep.shutdown()
        ep.initialize(shapes=ep.JobShapes(0, h, 2, num_experts=e, low_latency_max_tokens=n, low_latency_fp8=False))
        assert ep.config().buffer_bytes == ep.proxy_buffer_bytes(
            0, h, num_ranks=R, topk=2, num_experts=e, low_latency_max_tokens=n, low_latency_fp8=False, platform="cpu"
        )
        mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
        i, w = np.tile([[e - 2, e - 1]], (R * n, 1)).astype(np.int32), np.full((R * n, 2), 0.5, np.float32)

        def low_latency(x, i, w):
            recv, _, handle = ep.low_latency_dispatch(
                x, i, num_experts=e, max_tokens_per_rank=n, axis_name="ep", use_fp8=False
            )
            return ep.low_latency_combine(recv, i, w, handle)

        f = jax.jit(jax.shard_map(low_latency, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        xb = jnp.asarray(x[: R * n], jnp.bfloat16)
        np.testing.assert_allclose(np.asarray(f(xb, i, w), np.float32), np.asarray(xb, np.float32), rtol=1e-2)
        ep.shutdown()
        ep.initialize(shapes=shapes, proxy_buffer_bytes=9 << 20)
        assert ep.config().buffer_bytes == 9 << 20
        ep.shutdown()
        os.environ["UCCL_EP_BUFFER_BYTES"] = str(10 << 20)
        try:
            ep.initialize(shapes=shapes)
        finally:
            del os.environ["UCCL_EP_BUFFER_BYTES"]
        assert ep.config().buffer_bytes == 10 << 20
    finally:
        ep.shutdown()
        ep.initialize()


def _dispatch_combine(x, idx) -> np.ndarray:
    """dispatch then combine of x [R * T, H] routed by idx [R * T, K] over R ranks of one expert each: each token
    times the ranks it went to."""
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))

    def body(x, i):
        r = ep.dispatch(x, i, num_experts=R, axis_name="ep")
        return ep.combine(r.x, r.handle)

    return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x, idx))


def _restart_with_the_advised_buffer(x, idx) -> int:
    """A dispatch/combine round trip of x [R * T, H] with routing idx [R * T, 1] under a 1 MiB proxy buffer must fail
    naming the UCCL_EP_BUFFER_BYTES to set; restarted with that, the same round trip must return each token once
    per rank it went to (identity experts; here at most once). Returns the advised buffer."""
    import dataclasses
    import re

    ep.shutdown()
    try:
        ep.initialize(config=dataclasses.replace(ep.Config.from_env(), buffer_bytes=1 << 20))
        with pytest.raises(Exception, match=r"raise UCCL_EP_BUFFER_BYTES to at least \d+") as info:
            _dispatch_combine(x, idx)
        advised = int(re.search(r"at least (\d+)", str(info.value)).group(1))
        ep.shutdown()
        ep.initialize(config=dataclasses.replace(ep.Config.from_env(), buffer_bytes=advised))
        np.testing.assert_allclose(_dispatch_combine(x, idx), np.asarray(x) * (np.asarray(idx) >= 0), rtol=1e-6)
        return advised
    finally:
        ep.shutdown()
        ep.initialize()


def test_the_buffer_size_a_too_large_message_advises_is_enough():
    """A message past a region of the proxy's buffer names the UCCL_EP_BUFFER_BYTES that holds it; with that buffer
    the same op runs (regions are whole pages, so the advice rounds the message up to one)."""
    x = jnp.asarray(np.random.default_rng(9).standard_normal((R * 60, 1023)), jnp.float32)
    idx = jnp.zeros((R * 60, 1), jnp.int32)  # every rank sends its 60 rows to rank 0: ~245 KB a message
    advised = _restart_with_the_advised_buffer(x, idx)
    # Every token to one rank is the worst routing there is: what proxy_buffer_bytes gives for these shapes.
    assert advised == ep.proxy_buffer_bytes(60, 1023, num_ranks=R, topk=1, **_F32_ROWS, platform="cpu")


# The rows of _dispatch_combine: float32, no router weights.
_F32_ROWS = dict(dtype=jnp.float32, with_weights=False, combine_dtype=jnp.float32)


def test_the_buffer_size_advised_holds_every_ranks_message():
    """Ranks that need different message sizes: whichever rank's error is read, the advice is the largest need of
    the group's ranks, so one restart with it runs the op (a rank's own need alone would leave the other short)."""
    x = jnp.asarray(np.random.default_rng(10).standard_normal((R * 60, 1023)), jnp.float32)
    idx = np.full((R, 60, 1), -1, np.int32)
    idx[0, :40] = 1  # rank 0 sends 40 rows to rank 1 (~165 KB)
    idx[R - 1, :] = 0  # the last rank sends 60 to rank 0 (~245 KB)
    _restart_with_the_advised_buffer(x, jnp.asarray(idx.reshape(R * 60, 1)))


def test_a_buffer_too_small_and_a_bad_index_in_one_op_are_both_named():
    """One rank's message past a region, another rank's bad expert index: the restart the buffer needs would
    meet the bad index next, so every rank names both."""
    import dataclasses

    x = jnp.asarray(np.random.default_rng(11).standard_normal((R * 60, 1023)), jnp.float32)
    idx = np.full((R, 60, 1), -1, np.int32)
    idx[R - 1, :] = 0  # the last rank sends 60 rows to rank 0 (~245 KB)
    idx[1, 5, 0] = 1000
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    body = lambda x, i: ep.dispatch(x, i, num_experts=R, axis_name="ep").x  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    ep.shutdown()
    try:
        ep.initialize(config=dataclasses.replace(ep.Config.from_env(), buffer_bytes=1 << 20))
        with pytest.raises(Exception, match=r"raise UCCL_EP_BUFFER_BYTES .*; and .*topk_idx\[5, 0\] = 1000 is outside"):
            np.asarray(f(x, jnp.asarray(idx.reshape(R * 60, 1))))
    finally:
        ep.shutdown()
        ep.initialize()


def test_a_message_past_a_region_in_the_last_hierarchical_round_fails_every_rank_fast():
    """Two nodes of two ranks, dispatch in two rounds (across nodes, then within): a message past a region that
    first shows in the within-node round reaches only that node's ranks, while the other node's finished the op.
    They must not wait out their deadline in the next op: that failure aborts the group, every rank raises at once
    naming the buffer to set, and a restart with each advice in turn (one per round at most) runs the round trip."""
    import dataclasses
    import re
    import time

    x = jnp.asarray(np.random.default_rng(12).standard_normal((R * 40, 1023)), jnp.float32)
    idx = np.full((R, 40, 2), -1, np.int32)
    idx[0] = [2, 3]  # rank 0 (node 0): every token to both ranks of node 1 (the across round's largest)
    idx[2] = [2, 3]  # rank 2 (node 1): every token within its node, and rank 0's too (the within round's largest)
    idx = jnp.asarray(idx.reshape(R * 40, 2))
    want = np.asarray(x) * (np.asarray(idx) >= 0).sum(-1, keepdims=True)
    two_nodes = dataclasses.replace(ep.Config.from_env(), gpus_per_node=2, hierarchical=True)

    buffer_bytes, advised = 1 << 20, []
    try:
        for _ in range(3):
            ep.shutdown()
            ep.initialize(config=dataclasses.replace(two_nodes, buffer_bytes=buffer_bytes))
            start = time.monotonic()
            try:
                out = _dispatch_combine(x, idx)
                break
            except Exception as exc:  # noqa: BLE001
                assert time.monotonic() - start < 10, f"a rank waited for its deadline: {exc}"
                found = re.search(r"raise UCCL_EP_BUFFER_BYTES to at least (\d+)", str(exc))
                assert found, str(exc)
                buffer_bytes = int(found.group(1))
                advised.append(buffer_bytes)
        else:
            pytest.fail(f"three buffers advised and none ran the op: {advised}")
        assert len(advised) == 2, advised  # the across round's need, then the within round's larger one
        np.testing.assert_allclose(out, want, rtol=1e-6)
        # Rank 2 passed its node both nodes' 40 tokens, the most a rank can: what proxy_buffer_bytes gives.
        sized = ep.proxy_buffer_bytes(40, 1023, num_ranks=R, topk=2, **_F32_ROWS, ranks_per_node=2, platform="cpu")
        assert advised[-1] == sized, (advised, sized)
    finally:
        ep.shutdown()
        ep.initialize()


def test_a_proxy_buffer_sized_by_the_shapes_runs_the_worst_routing_the_first_time():
    """proxy_buffer_bytes(shapes) is the buffer the largest message of those shapes needs: with every rank's slots
    on one rank's experts (normal mode flat, in hierarchical rounds and in two levels, bf16 rows with router weights;
    low latency with float32 rows; a job of both, its low-latency dispatch in FP8), the ops run the first time with
    it, right against NumPy, and a buffer a page a region smaller makes them advise exactly it. The node size comes
    from the config where the call does not give it."""
    import dataclasses
    import re

    rng = np.random.default_rng(13)
    t, n, h, e = 48, 24, 1024, 2 * R
    x = rng.standard_normal((R * t, h)).astype(np.float32)
    w = rng.random((R * t, 2)).astype(np.float32)
    to_last_rank = np.tile(np.array([[e - 2, e - 1]], np.int32), (R * t, 1))  # both slots on rank R - 1's experts
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))

    def normal(x, i, w):
        r = ep.dispatch(x, i, w, num_experts=e, axis_name="ep")
        return (ep.combine(r.x, r.handle),)

    def low_latency(x, i, w, fp8=False):
        recv, _, handle = ep.low_latency_dispatch(
            x[:n], i[:n], num_experts=e, max_tokens_per_rank=n, axis_name="ep", use_fp8=fp8
        )
        if fp8:
            rows, scales = recv
            blocks = rows.astype(jnp.float32).reshape(*rows.shape[:2], h // 128, 128) * scales[..., None]
            recv = blocks.reshape(rows.shape).astype(jnp.bfloat16)
        return (ep.low_latency_combine(recv, i[:n], w[:n], handle),)

    def both(x, i, w):
        return normal(x, i, w) + low_latency(x, i, w, fp8=True)

    xb = jnp.asarray(x, jnp.bfloat16)
    per_rank = lambda a: a.reshape(R, t, -1)[:, :n].reshape(R * n, -1)  # noqa: E731
    want_normal = np.asarray(xb, np.float32)
    want_ll = per_rank(x) * per_rank(w).sum(-1, keepdims=True)
    want_ll_bf16 = per_rank(np.asarray(xb, np.float32)) * per_rank(w).sum(-1, keepdims=True)
    base = dataclasses.replace(ep.Config.from_env(), two_level="0")
    hierarchical = dataclasses.replace(base, gpus_per_node=2, hierarchical=True)
    two_level = dataclasses.replace(hierarchical, two_level="1")
    ll = dict(low_latency_max_tokens=n, num_experts=e)
    cases = [  # name, config, sizes, op, inputs, wants, tolerance
        ("normal, flat", base, dict(num_tokens=t), normal, xb, [want_normal], 1e-5),
        (
            "normal, hierarchical rounds",
            hierarchical,
            dict(num_tokens=t, ranks_per_node=2),
            normal,
            xb,
            [want_normal],
            1e-5,
        ),
        ("normal, two levels", two_level, dict(num_tokens=t), normal, xb, [want_normal], 1e-5),
        (
            "low latency",
            base,
            dict(num_tokens=0, **ll, low_latency_fp8=False, dtype=jnp.float32, combine_dtype=jnp.float32),
            low_latency,
            x,
            [want_ll],
            1e-5,
        ),
        ("both, FP8 low latency", hierarchical, dict(num_tokens=t, **ll), both, xb, [want_normal, want_ll_bf16], 0.1),
        (  # low-latency ops take no float16: a float16 job's low-latency rows are sized as float32, the widest
            "a float16 job's low latency, in float32",
            base,
            dict(num_tokens=0, **ll, low_latency_fp8=False, dtype=jnp.float16, combine_dtype=jnp.float16),
            low_latency,
            x,
            [want_ll],
            1e-5,
        ),
    ]
    try:
        for name, config, sizes, op, rows, wants, tolerance in cases:
            f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
            sized = ep.proxy_buffer_bytes(hidden=h, num_ranks=R, topk=2, platform="cpu", config=config, **sizes)
            ep.shutdown()
            ep.initialize(config=dataclasses.replace(config, buffer_bytes=sized))
            for out, want in zip(f(rows, jnp.asarray(to_last_rank), jnp.asarray(w)), wants, strict=True):
                np.testing.assert_allclose(
                    np.asarray(out, np.float32), want, rtol=tolerance, atol=tolerance, err_msg=name
                )
            ep.shutdown()
            ep.initialize(config=dataclasses.replace(config, buffer_bytes=sized - 2 * R * 4096))
            with pytest.raises(Exception, match=r"raise UCCL_EP_BUFFER_BYTES to at least \d+") as info:
                jax.block_until_ready(f(rows, jnp.asarray(to_last_rank), jnp.asarray(w)))
            assert int(re.search(r"at least (\d+)", str(info.value)).group(1)) == sized, (name, str(info.value))
    finally:
        ep.shutdown()
        ep.initialize()


def test_low_latency_sizes_refuse_dtypes_low_latency_ops_do_not_take():
    """low_latency_buffer_bytes of float16 rows would size for rows no low-latency op takes: refused, naming it."""
    sizes = dict(num_ranks=R, num_experts=2 * R, topk=2, fp8=False)
    assert ep.low_latency_buffer_bytes(16, 256, **sizes, combine_dtype=jnp.float32) > ep.low_latency_buffer_bytes(
        16, 256, **sizes
    )
    for name in ("dispatch_dtype", "combine_dtype"):
        with pytest.raises(ValueError, match=f"{name} must be float32 or bfloat16 .* got float16"):
            ep.low_latency_buffer_bytes(16, 256, **sizes, **{name: jnp.float16})


def test_forward_mode_derivatives_fail_and_say_so():
    """Reverse mode only: jax.jvp of dispatch fails (JAX's error for a custom_vjp function names jvp), not with a
    wrong tangent."""
    x, idx = jnp.ones((R * T, H)), jnp.zeros((R * T, 1), jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    f = jax.shard_map(
        lambda x, i: ep.dispatch(x, i, num_experts=E, axis_name="ep").x, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")
    )
    with pytest.raises(Exception, match="jvp"):
        jax.jit(lambda x: jax.jvp(lambda x: f(x, idx), (x,), (x,)))(x)


def test_rows_without_channels_are_named():
    """x of hidden 0 (or FP8 scales of no columns) is refused by value, not a division by zero."""
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    f = jax.shard_map(
        lambda x, i: ep.dispatch(x[:, :0], i, num_experts=E, axis_name="ep").x,
        mesh=mesh,
        in_specs=P("ep"),
        out_specs=P("ep"),
    )
    with pytest.raises(ValueError, match=r"the last dimension of shape \(\d+, 0\) must not be empty"):
        jax.jit(f)(jnp.ones((R * T, H)), jnp.zeros((R * T, 1), jnp.int32))
