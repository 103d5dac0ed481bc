"""Node layout from jax.distributed (host names) or UCCL_EP_GPUS_PER_NODE, and the ops across "nodes"."""
from __future__ import annotations

import os

import pytest

import jax_uccl_ep as ep
from mp import launch_ok

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
    """Child: with UCCL_EP_GPUS_PER_NODE=1 the ranks are separate nodes (network providers first) and the ops stay
    exact."""
    import jax
    import jax.numpy as jnp

    import cases

    ep.initialize()
    topo = ep.topology()
    mesh = cases.mesh_of(jax.devices())
    problems = cases.check_case(mesh, 5, 12, 128, 2, 2 * mesh.devices.size, jnp.float32)
    ep.shutdown()
    return {"nodes": topo.num_nodes, "source": topo.source, "problems": problems}


def test_every_device_its_own_node_across_processes():
    for res in launch_ok(HERE, "every_device_its_own_node", 2, devices_per_process=1,
                         env={"UCCL_EP_GPUS_PER_NODE": "1"}):
        assert res["nodes"] == 2 and res["source"] == "UCCL_EP_GPUS_PER_NODE=1"
        assert res["problems"] == []


def test_topology_needs_initialize():
    ep.shutdown()
    with pytest.raises(RuntimeError, match="call jax_uccl_ep.initialize"):
        ep.topology()
    ep.initialize()  # as the other test modules expect
    assert ep.topology().num_nodes == 1
