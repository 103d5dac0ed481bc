"""Node layout from jax.distributed (host names) or UCCL_EP_GPUS_PER_NODE, and the ops across "nodes"."""

from __future__ import annotations

import os

import pytest
from mp import launch_ok

import jax_uccl_ep as ep

HERE = os.path.abspath(__file__)


def test_nodes_follow_host_names_in_rank_order():
    # 4 ranks in 2 processes per host name; rank order decides node numbering and local ranks.
    t = ep.Topology.build([0, 0, 1, 1, 2, 2], ["b", "a", "b"])
    assert t.node_of_rank == (0, 0, 1, 1, 0, 0)
    assert t.local_rank == (0, 1, 0, 1, 2, 3)
    assert t.num_nodes == 2 and t.ranks_on(0) == [0, 1, 4, 5] and t.ranks_on(1) == [2, 3]
    assert t.source == "hostnames"


def test_gpus_per_node_overrides_host_names():
    t = ep.Topology.build([0, 0, 0, 0], ["one-host"], per_node=1)
    assert t.node_of_rank == (0, 1, 2, 3) and t.local_rank == (0, 0, 0, 0)
    t = ep.Topology.build([0, 0, 0, 0], ["one-host"], per_node=2)
    assert t.node_of_rank == (0, 0, 1, 1) and t.local_rank == (0, 1, 0, 1)
    with pytest.raises(ValueError, match="UCCL_EP_GPUS_PER_NODE must be a positive integer"):
        ep.Topology.build([0], ["h"], per_node=0)


def every_device_its_own_node() -> dict:
    """Child: with UCCL_EP_GPUS_PER_NODE=1 the ranks are separate nodes (network providers first) and normal and
    low-latency mode match the references (the path GPUs on several nodes take, through host memory)."""
    import cases
    import jax
    import jax.numpy as jnp

    ep.initialize()
    topo = ep.topology()
    mesh = cases.mesh_of(jax.devices())
    r = mesh.devices.size
    problems = {
        "normal": cases.check_case(mesh, 5, 12, 128, 2, 2 * r, jnp.float32),
        "normal_bf16": cases.check_case(mesh, 6, 33, 256, 4, 4 * r, jnp.bfloat16, empty_rank=r - 1),
        "fp8": cases.check_fp8(mesh, 7, 17, 256, 3, 4 * r),
        "low_latency": cases.check_low_latency(mesh, 8, 9, 12, 256, 3, 4 * r),
        "low_latency_split": cases.check_low_latency(mesh, 9, 7, 8, 128, 2, 2 * r, split=True, use_fp8=False),
    }
    ep.shutdown()
    return {"nodes": topo.num_nodes, "source": topo.source, "problems": {k: v for k, v in problems.items() if v}}


@pytest.mark.parametrize("reorder", ["0", "1"])
def test_every_device_its_own_node_across_processes(reorder):
    """Issue 4's CPU proof: each process its own node over tcp, with the proxies' reorder mode off and on."""
    for res in launch_ok(
        HERE,
        "every_device_its_own_node",
        2,
        devices_per_process=1,
        env={"UCCL_EP_GPUS_PER_NODE": "1", "UCCL_EP_REORDER": reorder},
    ):
        assert res["nodes"] == 2 and res["source"] == "UCCL_EP_GPUS_PER_NODE=1"
        assert res["problems"] == {}


def test_topology_needs_initialize():
    ep.shutdown()
    with pytest.raises(RuntimeError, match="call jax_uccl_ep.initialize"):
        ep.topology()
    ep.initialize()  # as the other test modules expect
    assert ep.topology().num_nodes == 1


def two_nodes_of_two() -> dict:
    """Child (2 processes x 2 devices, UCCL_EP_GPUS_PER_NODE=2): dispatch crosses nodes once per token and fans out
    within the node, combine sums within the node before crossing back; results must match the references; bad
    input fails every rank and leaves the runtime usable; a stale handle fails with a named error and aborts the
    group (usable again after shutdown and initialize)."""
    import cases
    import jax
    import jax.numpy as jnp
    import numpy as np
    import reference as ref

    ep.initialize()
    mesh = cases.mesh_of(sorted(jax.devices(), key=lambda d: d.id))
    r = mesh.devices.size
    problems = cases.reference_suite(mesh, 11, empty_rank=2)
    x, _, idx, w = cases.random_case(16, r, 8, 128, 2, 2 * r, jnp.float32)
    idx = ref.random_routing(np.random.default_rng(17), r, 8, 2, 2 * r)
    idx[3, 2, 1] = 99  # rank 3 (node 1) has a bad expert index
    error = ""
    try:
        cases.roundtrip(mesh, x, idx, w, 2 * r)
    except Exception as exc:  # noqa: BLE001
        error = str(exc)
    problems["after_bad_input"] = cases.check_case(mesh, 18, 10, 128, 2, 2 * r, jnp.float32)

    # A combine whose handle holds another dispatch's routing: the forwarders find rows that do not match.
    e = 2 * r
    ia = cases.shard(mesh, ref.random_routing(np.random.default_rng(19), r, 16, 2, e))
    ib = cases.shard(mesh, ref.random_routing(np.random.default_rng(20), r, 16, 2, e))
    xs = cases.shard(mesh, np.random.default_rng(21).standard_normal((r, 16, 128)).astype(np.float32))

    def stale(x, ia, ib):
        first = ep.dispatch(x[0], ia[0], None, num_experts=e, axis_name="ep")
        second = ep.dispatch(x[0], ib[0], None, num_experts=e, axis_name="ep")
        handle = ep.DispatchHandle(second.handle.is_token_in_rank, first.handle.recv_counts, "ep")
        return ep.combine(first.x, handle)[None]

    stale_error = ""
    try:
        jax.block_until_ready(
            jax.jit(jax.shard_map(stale, mesh=mesh, in_specs=cases.P("ep"), out_specs=cases.P("ep")))(xs, ia, ib)
        )
    except Exception as exc:  # noqa: BLE001
        stale_error = str(exc)
    # Found in combine's last round, so the whole group was aborted: a fresh runtime works again.
    ep.shutdown()
    ep.initialize()
    problems["after_stale_handle"] = cases.check_case(mesh, 22, 10, 128, 2, 2 * r, jnp.float32)
    ep.shutdown()
    return {"error": error, "stale_error": stale_error, "problems": {k: v for k, v in problems.items() if v}}


@pytest.mark.parametrize("processes,reorder", [(2, "0"), (2, "1"), (4, "0")])
def test_dispatch_crosses_nodes_once_per_token(processes, reorder):
    """Two nodes of two ranks (a process per node, or per rank as GPUs across nodes run): the hierarchical
    dispatch and combine (kernels/cpu/normal.cpp) against the references."""
    results = launch_ok(
        HERE,
        "two_nodes_of_two",
        processes,
        devices_per_process=4 // processes,
        env={"UCCL_EP_GPUS_PER_NODE": "2", "UCCL_EP_REORDER": reorder},
    )
    for res in results:
        assert res["problems"] == {}
        # Every rank fails on rank 3's bad index, in the hierarchical rounds (their names say so).
        assert "= 99 is outside" in res["error"] and "dispatch (" in res["error"], res["error"]
    # The ranks served by a forwarder that saw the stale rows raise (the rest of the group is aborted).
    stale = [res["stale_error"] for res in results if res["stale_error"]]
    assert stale and all("stale handle" in s and "combine (" in s for s in stale), stale
