"""Two-level routing of normal mode (jax_uccl_ep/normal.py): a dispatch across nodes, then one within the node.

GPUs on several nodes take it by default (the node level over NVLink: tests/test_proxy_gpu.py runs it on one shared
GPU); CPU devices take it with UCCL_EP_TWO_LEVEL=1, both levels through the proxies, which is what runs here.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mp import launch_ok

import jax_uccl_ep as ep
from jax_uccl_ep import Config, _ffi, _runtime

HERE = os.path.abspath(__file__)


def test_level_tables_split_each_group_into_nodes_and_across_them():
    # Ranks 0..5 on nodes of two; one EP group in rank order, one in another node-major order.
    nodes = [0, 0, 1, 1, 2, 2]
    table = np.array([[0, 1, 2, 3, 4, 5], [4, 5, 0, 1, 2, 3]], np.int32)
    within = _ffi.level_table(table, nodes, "node")
    across = _ffi.level_table(table, nodes, "across")
    assert within.tolist() == [[0, 1], [2, 3], [4, 5], [4, 5], [0, 1], [2, 3]]
    assert across.tolist() == [[0, 2, 4], [1, 3, 5], [4, 0, 2], [5, 1, 3]]


@pytest.mark.parametrize(
    "row,nodes",
    [
        ([0, 2, 1, 3], [0, 0, 1, 1]),  # the nodes alternate along the axis
        ([0, 1, 2, 3, 4, 5], [0, 0, 1, 1, 1, 1]),  # one node's ranks in two blocks
        ([0, 1, 2], [0, 0, 1]),  # blocks of unequal size
    ],
)
def test_level_tables_refuse_an_axis_that_interleaves_nodes(row, nodes):
    with pytest.raises(ValueError, match="list each node's ranks together.*UCCL_EP_TWO_LEVEL=0"):
        _ffi.level_table(np.array([row], np.int32), nodes, "across")


def _settings(**kw) -> Config:
    return Config(**kw)


def test_plan_applies_where_nodes_are_equal_and_a_forced_setting_says_why_not():
    two_by_two = ep.Topology.build([0, 0, 0, 0], ["h"], per_node=2)
    local = [0, 0, 0, 0]  # the process of each rank
    assert _runtime._plan_two_level(_settings(two_level="auto"), two_by_two, "cpu", local) is None  # CPU: opt-in
    plan = _runtime._plan_two_level(_settings(two_level="1"), two_by_two, "cpu", local)
    assert (plan.num_nodes, plan.per_node, plan.num_ranks, plan.nvlink) == (2, 2, 4, False)
    assert _runtime._plan_two_level(_settings(two_level="0"), two_by_two, "cpu", local) is None
    uneven = ep.Topology.build([0, 0, 1], ["a", "b"])
    assert _runtime._plan_two_level(_settings(two_level="auto"), uneven, "gpu", [0, 0, 1]) is None
    with pytest.raises(ValueError, match="UCCL_EP_TWO_LEVEL=1 but nodes hold different numbers of ranks"):
        _runtime._plan_two_level(_settings(two_level="1"), uneven, "cpu", [0, 0, 1])
    singles = ep.Topology.build([0, 1], ["h", "h"], per_node=1)
    with pytest.raises(ValueError, match="every node holds one rank"):
        _runtime._plan_two_level(_settings(two_level="1"), singles, "cpu", [0, 1])
    with pytest.raises(ValueError, match="UCCL_EP_HIERARCHICAL=0"):
        _runtime._plan_two_level(_settings(two_level="1", hierarchical=False), two_by_two, "cpu", local)
    # GPUs: every process decides alike, from which process holds each rank (process 0: ranks 0-2, nodes 0 and 1).
    mixed = [0, 0, 0, 1]
    assert _runtime._plan_two_level(_settings(two_level="auto"), two_by_two, "gpu", mixed) is None
    with pytest.raises(ValueError, match="a process drives GPUs of several nodes"):
        _runtime._plan_two_level(_settings(two_level="1"), two_by_two, "gpu", mixed)
    with pytest.raises(ValueError, match="must be auto, 1 or 0"):
        _runtime._plan_two_level(_settings(two_level="yes"), two_by_two, "cpu", local)


def two_nodes_two_levels() -> dict:
    """Child (4 ranks, UCCL_EP_GPUS_PER_NODE=2, UCCL_EP_TWO_LEVEL=1): dispatch and combine in two levels against the
    reference in two-level row order; FP8; gradients; a bad index fails every rank (then a restart), a capacity
    overflow too (without one); overflow="drop" in two-level row order; a mesh whose axis interleaves nodes refused
    with a named error."""
    import time

    import cases
    import jax
    import jax.numpy as jnp
    import reference as ref

    ep.initialize()
    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh = cases.mesh_of(devices)
    r = mesh.devices.size
    plan = ep.two_level()
    problems = cases.reference_suite(mesh, 31, empty_rank=1)

    seconds = []

    def error_of(idx, capacity=None):
        x, _, _, w = cases.random_case(36, r, idx.shape[1], 128, idx.shape[2], 2 * r, jnp.float32)
        start = time.monotonic()
        try:
            cases.roundtrip(mesh, x, idx, w, 2 * r, capacity=capacity)
            return ""
        except Exception as exc:  # noqa: BLE001
            return str(exc)
        finally:
            seconds.append(time.monotonic() - start)

    bad = ref.random_routing(np.random.default_rng(37), r, 8, 2, 2 * r)
    bad[3, 2, 1] = 99  # rank 3 (node 1)
    bad_error = error_of(bad)
    # The level that found it failed its ranks, the other level's were aborted: every rank failed at once (well
    # within UCCL_EP_TIMEOUT_S), and the runtime starts afresh.
    ep.shutdown()
    ep.initialize()
    problems["after_bad_index"] = cases.check_case(mesh, 38, 10, 128, 2, 2 * r, jnp.float32)
    full = np.full((r, 16, 2), -1, np.int32)
    full[:, :, 0] = 0  # every token to expert 0 (rank 0): 16 * r rows for a capacity of 3
    capacity_error = error_of(full, capacity=3)
    # Every rank of the job raised the overflow in the node level's op: no restart.
    problems["after_capacity"] = cases.check_case(mesh, 39, 10, 128, 2, 2 * r, jnp.float32)
    problems["drop"] = cases.check_drop(mesh, 42, 20, 128, 3, 4 * r, 14)
    # The expert layout: the node level's receive writes the pairs, in two-level row order.
    problems["expert_layout"] = cases.check_expert_layout(mesh, 43, 12, 128, 3, 4 * r, jnp.float32, alignment=2)
    problems["expert_gradients"] = cases.check_expert_gradients(mesh, 44, 9, 128, 3, 2 * r)
    problems["pair_writers"] = cases.check_pair_writers_agree(mesh, 45, 11, 128, 3, 2 * r, jnp.bfloat16, alignment=4)

    # The nodes interleaved along the axis: expert ownership by position no longer matches the nodes.
    interleaved = cases.mesh_of([devices[i] for i in (0, 2, 1, 3)])
    order_error = ""
    try:
        cases.check_case(interleaved, 40, 8, 128, 2, 2 * r, jnp.float32)
    except Exception as exc:  # noqa: BLE001
        order_error = str(exc)
    ep.shutdown()
    return {
        "plan": None if plan is None else [plan.num_nodes, plan.per_node, plan.nvlink],
        "seconds": seconds,
        "bad_error": bad_error,
        "capacity_error": capacity_error,
        "order_error": order_error,
        "problems": {k: v for k, v in problems.items() if v},
    }


@pytest.mark.parametrize("processes,reorder", [(2, "0"), (4, "1")])
def test_two_levels_match_the_reference(processes, reorder):
    results = launch_ok(
        HERE,
        "two_nodes_two_levels",
        processes,
        devices_per_process=4 // processes,
        env={"UCCL_EP_GPUS_PER_NODE": "2", "UCCL_EP_TWO_LEVEL": "1", "UCCL_EP_REORDER": reorder},
    )
    for res in results:
        assert res["plan"] == [2, 2, False]
        assert res["problems"] == {}
        assert "= 99 is outside" in res["bad_error"], res["bad_error"]
        assert "tokens but capacity is 3" in res["capacity_error"], res["capacity_error"]
        assert max(res["seconds"]) < 30, res["seconds"]  # UCCL_EP_TIMEOUT_S is 120: nobody waited for it
        assert "list each node's ranks together" in res["order_error"], res["order_error"]


def bytes_across_nodes() -> dict:
    """Child (4 ranks, nodes of 2, UCCL_EP_TWO_LEVEL=1): the bytes this process's proxies post to ranks of the other
    node for one dispatch, under two-level routing and then flat (UCCL_EP_TWO_LEVEL=0, UCCL_EP_HIERARCHICAL=0), with
    the routing's own counts: token-node pairs (a token to a node that owns one of its experts) and token-rank
    pairs (to each such rank) across nodes, for this process's ranks."""
    import cases
    import jax
    import reference as ref

    from jax_uccl_ep import _uccl_ep_testing

    r, t, h, k, e = 4, 64, 1024, 4, 16
    idx = ref.random_routing(np.random.default_rng(41), r, t, k, e, mask_prob=0.1)
    x = np.random.default_rng(42).standard_normal((r, t, h)).astype(np.float32)

    def across_bytes() -> int:
        node = ep.topology().node_of_rank
        return sum(
            b
            for q in _runtime.local_ranks()
            for p, b in enumerate(_uccl_ep_testing.stats(q)["bytes_posted_to"])
            if node[p] != node[q]
        )

    def measure() -> int:
        ep.initialize()
        mesh = cases.mesh_of(sorted(jax.devices(), key=lambda d: d.id))

        def body(x, i):
            return ep.dispatch(x[0], i[0], num_experts=e, axis_name="ep").num_tokens[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=cases.P("ep"), out_specs=cases.P("ep")))
        args = (cases.shard(mesh, x), cases.shard(mesh, idx))
        jax.block_until_ready(f(*args))  # compiled and warm
        before = across_bytes()
        jax.block_until_ready(f(*args))
        cases.gather(f(*args))  # every rank is done with the second call once all are done with the third
        time.sleep(0.2)
        posted = across_bytes() - before
        plan = ep.two_level()
        ep.shutdown()
        return posted // 2, plan is not None

    import time

    two_level, on = measure()
    os.environ.update(UCCL_EP_TWO_LEVEL="0", UCCL_EP_HIERARCHICAL="0")
    flat, off = measure()
    per_rank = e // r
    owner = np.where(idx >= 0, idx // per_rank, -1)
    node_pairs = rank_pairs = 0
    for s in _runtime.local_ranks():
        other = [d for d in range(r) if d // 2 != s // 2]
        needs = [(owner[s] == d).any(-1) for d in other]
        node_pairs += int(np.logical_or.reduce(needs).sum())
        rank_pairs += int(sum(n.sum() for n in needs))
    return {
        "two_level": int(two_level),
        "flat": int(flat),
        "on": on,
        "off": not off,
        "node_pairs": node_pairs,
        "rank_pairs": rank_pairs,
        "row_bytes": h * 4,
    }


def test_a_token_crosses_to_another_node_once():
    """The measure two-level routing exists for: what the proxies post across nodes per dispatch is about one row
    per token and node that needs it, against one per token and rank there when routing is flat."""
    for res in launch_ok(
        HERE,
        "bytes_across_nodes",
        2,
        devices_per_process=2,
        env={"UCCL_EP_GPUS_PER_NODE": "2", "UCCL_EP_TWO_LEVEL": "1"},
    ):
        assert res["on"] and res["off"], res
        assert res["rank_pairs"] > res["node_pairs"] > 0, res  # the routing makes the two differ
        rows = res["row_bytes"]
        # Rows dominate: routing and headers add under 2% at 4 KiB rows (0.4% seen).
        assert res["node_pairs"] * rows <= res["two_level"] <= 1.02 * res["node_pairs"] * rows, res
        assert res["rank_pairs"] * rows <= res["flat"] <= 1.02 * res["rank_pairs"] * rows, res


def failure_on_a_smaller_axis() -> dict:
    """Child (2 processes x 2 devices, nodes of 2, UCCL_EP_TWO_LEVEL=1): EP over the second axis of a (2, 2) mesh
    is not the whole job, so its ops are single-level; a capacity failure in the first EP group (process 0's ranks)
    stays there: process 1's group finishes, and its runtime keeps working."""
    import jax
    import reference as ref
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    ep.initialize()
    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh = Mesh(np.array(devices).reshape(2, 2), ("dp", "ep"))
    r, t, h, e = 4, 16, 128, 8
    idx = np.full((r, t, 2), -1, np.int32)
    idx[:2, :, 0] = 0  # group {0, 1}: 32 rows for rank 0, over capacity 8; group {2, 3}: nothing sent at all
    x = np.random.default_rng(43).standard_normal((r, t, h)).astype(np.float32)

    def body(x, i):
        res = ep.dispatch(x[0], i[0], num_experts=e, axis_name="ep", capacity=8)
        return ep.combine(res.x, res.handle)[None]

    spec = P(("dp", "ep"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))

    def put(a):
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    error = ""
    try:
        out = f(put(x), put(idx))
        jax.block_until_ready(out)
    except Exception as exc:  # noqa: BLE001
        error = str(exc)
    usable = []
    if jax.process_index() == 1:  # a round trip on its own two devices: combine(dispatch(x)) is x times the
        own = Mesh(np.array([d for d in devices if d.process_index == 1]), ("ep",))  # ranks each token reached
        idx2 = ref.random_routing(np.random.default_rng(44), 2, 8, 2, 4)
        x2 = np.random.default_rng(45).standard_normal((2, 8, 128)).astype(np.float32)
        g = jax.jit(
            jax.shard_map(
                lambda x, i: ep.combine(
                    *(lambda r: (r.x, r.handle))(ep.dispatch(x[0], i[0], num_experts=4, axis_name="ep"))
                )[None],
                mesh=own,
                in_specs=P("ep"),
                out_specs=P("ep"),
            )
        )
        got = np.asarray(g(*(jax.device_put(a, NamedSharding(own, P("ep"))) for a in (x2, idx2))))
        reached = np.stack([((idx2 >= 0) & (idx2 // 2 == d)).any(-1) for d in range(2)]).sum(0)
        usable = [] if np.allclose(got, x2 * reached[..., None], rtol=1e-6) else ["round trip differs"]
    ep.shutdown()
    return {"process": jax.process_index(), "error": error, "usable": usable}


def test_a_failure_outside_two_level_ops_does_not_abort_the_job():
    results = launch_ok(
        HERE,
        "failure_on_a_smaller_axis",
        2,
        devices_per_process=2,
        env={"UCCL_EP_GPUS_PER_NODE": "2", "UCCL_EP_TWO_LEVEL": "1"},
    )
    by_process = {res["process"]: res for res in results}
    assert "capacity is 8" in by_process[0]["error"], by_process[0]
    assert by_process[1]["error"] == "" and by_process[1]["usable"] == [], by_process[1]
