"""The plan: which runtime and path carries each op, decided once and handed to the handlers.

``initialize()`` records the runtime's facts here (``RuntimePlan``: which runtimes run, the topology, two-level
routing); the lowering of every EP op asks ``op_path`` which path it takes and passes the answer to its FFI handler
as the ``path`` attribute (and, for normal mode on the proxy runtime, ``node_size``: the ranks per node of the
hierarchical rounds). Handlers dispatch on these and decide nothing. The numbers match ``uccl_ep::Path`` in
kernels/contract.hpp.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class Path(enum.IntEnum):
    """How an op runs (mirrors uccl_ep::Path in kernels/contract.hpp)."""

    CPU = 0  # CPU devices: kernels/cpu on the proxy runtime
    NVLINK = 1  # GPUs of one node: the NVLink runtime's kernels
    NODE_NVLINK = 2  # GPUs across nodes, a group within one node: that node's NVLink runtime
    PROXY_GPU = 3  # GPUs across nodes: kernels that push the proxies' commands (GPU-initiated)
    STAGED = 4  # GPUs across nodes: copied to the host and run by kernels/cpu on the proxy runtime


@dataclass(frozen=True)
class Topology:
    """Where the job's ranks (devices, in jax.devices() order by id) live: which node, which index on it.

    Nodes come from the processes' host names, or, with ``UCCL_EP_GPUS_PER_NODE=k``, from consecutive groups of k
    ranks (k=1 makes every device its own node, so the internode path can run on one machine).
    """

    node_of_rank: tuple[int, ...]  # node index of each global rank
    local_rank: tuple[int, ...]  # rank's index among its node's ranks
    source: str  # "hostnames" or "UCCL_EP_GPUS_PER_NODE=k"

    @property
    def num_nodes(self) -> int:
        return max(self.node_of_rank) + 1 if self.node_of_rank else 0

    def ranks_on(self, node: int) -> list[int]:
        """Global ranks on `node`, in rank order."""
        return [r for r, n in enumerate(self.node_of_rank) if n == node]

    @staticmethod
    def build(process_of_rank: list[int], host_of_process: list[str], per_node: int | None = None) -> Topology:
        if per_node is not None:
            if per_node < 1:
                raise ValueError(f"UCCL_EP_GPUS_PER_NODE must be a positive integer, got {per_node}")
            nodes = [r // per_node for r in range(len(process_of_rank))]
            source = f"UCCL_EP_GPUS_PER_NODE={per_node}"
        else:
            order: dict[str, int] = {}
            for p in process_of_rank:  # nodes numbered in order of their first rank
                order.setdefault(host_of_process[p], len(order))
            nodes = [order[host_of_process[p]] for p in process_of_rank]
            source = "hostnames"
        seen: dict[int, int] = {}
        local = []
        for n in nodes:
            local.append(seen.get(n, 0))
            seen[n] = local[-1] + 1
        return Topology(tuple(nodes), tuple(local), source)


@dataclass(frozen=True)
class TwoLevel:
    """Two-level routing of normal mode (jax_uccl_ep/normal.py) for an EP axis over every rank of the job: a
    dispatch first crosses nodes (a token once to each node that needs it, to the rank with its sender's index
    there), then fans out within the node; a combine sums within the node first, then crosses back."""

    num_nodes: int
    per_node: int  # ranks on each node
    node_of_rank: tuple[int, ...]
    nvlink: bool  # the node level runs on a node-level NVLink runtime (GPUs), else through the proxies
    across_gpu_initiated: bool  # the level across nodes runs GPU-initiated (kernels push the proxies' commands)

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.per_node


@dataclass(frozen=True)
class RuntimePlan:
    """What initialize() started, as the lowering needs it. Programs are traced under one plan; initialize()
    clears JAX's caches when the next plan differs."""

    platform: str  # "cpu" or "gpu"
    nvlink: bool  # the whole job on one NVLink runtime (GPUs of one node)
    topology: Topology
    hierarchical: bool  # proxy runtime: normal mode in rounds across equal nodes (kernels/cpu/normal.cpp)
    gpu_initiated_normal: bool  # proxy runtime on GPUs: normal-mode kernels push the proxies' commands
    gpu_initiated_low_latency: bool  # likewise for low-latency mode
    two_level: TwoLevel | None
    # dispatch(layout="expert")'s receive can write the pair buffer itself on this GPU path (gpu_writes_pairs): over
    # NVLink with bulk copies, pulled or sent (UCCL_EP_NVL_DISPATCH_PAIRS), or over the GPU-initiated proxy, flat
    # (UCCL_EP_PROXY_DISPATCH_PAIRS).
    gpu_writes_pairs: bool = False


_current: RuntimePlan | None = None


def current() -> RuntimePlan | None:
    """The plan of the running runtime, or None before initialize() (and after shutdown())."""
    return _current


def set_current(plan: RuntimePlan | None) -> None:
    global _current
    _current = plan


def two_level() -> TwoLevel | None:
    """The two-level plan initialize() made, or None (one node, UCCL_EP_TWO_LEVEL=0, unequal nodes, ...)."""
    return None if _current is None else _current.two_level


def _within_one_node(plan: RuntimePlan, table: np.ndarray) -> bool:
    nodes = plan.topology.node_of_rank
    return all(len({nodes[int(r)] for r in row}) == 1 for row in np.asarray(table))


def node_blocks(group: Sequence[int], node_of_rank: Sequence[int]) -> int | None:
    """The members per node of EP group `group` (runtime ranks, in axis order) where its members fall into equal
    blocks of consecutive members, each block one node and no node twice; else None. The one rule of both
    hierarchical rounds (node_size) and two-level routing (_ffi.level_table): expert ownership by axis position
    then matches node by node."""
    nodes = [int(node_of_rank[int(r)]) for r in group]
    per_node = nodes.count(nodes[0])
    if len(nodes) % per_node:
        return None
    blocks = [nodes[i : i + per_node] for i in range(0, len(nodes), per_node)]
    if any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
        return None
    return per_node


def node_size(plan: RuntimePlan, table: np.ndarray) -> int:
    """Ranks per node of the hierarchical rounds kernels/cpu runs normal mode in for groups `table` [groups, R],
    or 0 (flat: every rank sends to every rank). Rounds apply where every group splits into nodes (node_blocks)
    of more than one and fewer than all of its members, and every group has the same block size (the attribute
    is one value for the whole table; a table whose groups differ runs flat, which is slower across nodes but
    gives the same results)."""
    if not plan.hierarchical:
        return 0
    sizes = set()
    for row in np.asarray(table):
        per_node = node_blocks(row, plan.topology.node_of_rank)
        if per_node is None or per_node <= 1 or per_node == len(row):
            return 0
        sizes.add(per_node)
    return sizes.pop() if len(sizes) == 1 else 0


NORMAL_OPS = ("dispatch", "cached_dispatch", "combine", "dispatch_pairs", "cached_dispatch_pairs", "combine_pairs")


def receive_writes_pairs() -> bool:
    """Whether dispatch(layout="expert")'s receive writes the pair buffer itself (the *_pairs ops): on CPU devices,
    and on GPUs where normal mode runs host-staged (the proxy runtime with GPU-initiated ops off and no two-level
    routing: op_path's Path.STAGED), whose handlers run the CPU ops on the host copies, and whose combine sums each
    row's pairs on its way back. The NVLink and GPU-initiated paths receive token rows and lay the pairs out in XLA
    (_pairs.py), slot for slot the same, or where gpu_writes_pairs allows write them in their dispatch's receive;
    their combine sums each row's pairs on its GPU before the rows go back either way (_pairs.reduce_pairs)."""
    plan = _current
    if plan is None:
        return False
    if plan.platform == "cpu":
        return True
    return not plan.nvlink and plan.two_level is None and not plan.gpu_initiated_normal


# The GPU pair writer's limits (kernels/nvl/pair_layout.cuh: kMaxPairGroups, kMaxPairTopk).
GPU_PAIRS_MAX_GROUPS = 256
GPU_PAIRS_MAX_TOPK = 32


def gpu_writes_pairs(
    groups: int, top_k: int, capacity: int, every_slot: int, row_bytes: int, scale_row_bytes: int
) -> bool:
    """Whether dispatch(layout="expert")'s receive writes the pair buffer on a GPU path (the dispatch_pairs op on
    Path.NVLINK or Path.PROXY_GPU): where the plan allows it (RuntimePlan.gpu_writes_pairs), flat, with rows of
    16-byte multiples and a buffer no routing can overflow (`capacity` pair rows against `every_slot`: every top-k
    slot of every row), at most GPU_PAIRS_MAX_GROUPS local experts and top-GPU_PAIRS_MAX_TOPK. Its combine sums the
    pairs before its rows go back (receive_writes_pairs decides the combine)."""
    plan = _current
    return (
        plan is not None
        and plan.gpu_writes_pairs
        and plan.two_level is None
        and groups <= GPU_PAIRS_MAX_GROUPS
        and top_k <= GPU_PAIRS_MAX_TOPK
        and capacity >= every_slot
        and row_bytes % 16 == 0
        and scale_row_bytes % 16 == 0
    )


def op_path(plan: RuntimePlan, op: str, level: str | None, platforms: Sequence[str], table: np.ndarray) -> Path:
    """The path of EP op `op` ("dispatch", "low_latency_combine", ...) under `plan`, lowered for `platforms` over
    the groups `table`, at a `level` of two-level routing ("node", "across") or over its whole group (None)."""
    if "cuda" not in tuple(platforms):
        return Path.CPU
    if plan.nvlink:
        return Path.NVLINK
    if level == "node":
        return Path.NODE_NVLINK
    if level == "across":
        return Path.PROXY_GPU if plan.two_level is not None and plan.two_level.across_gpu_initiated else Path.STAGED
    if op in NORMAL_OPS and plan.two_level is not None and plan.two_level.nvlink and _within_one_node(plan, table):
        # EP groups that each lie within a node (data parallelism across nodes, say): that node's NVLink runtime.
        return Path.NODE_NVLINK
    gpu_initiated = plan.gpu_initiated_normal if op in NORMAL_OPS else plan.gpu_initiated_low_latency
    return Path.PROXY_GPU if gpu_initiated else Path.STAGED


def global_ranks(devices: Sequence) -> dict[int, int]:
    """Runtime rank of every device of the job: its index in `devices` (jax.devices()) sorted by id."""
    return {d.id: r for r, d in enumerate(sorted(devices, key=lambda d: d.id))}
