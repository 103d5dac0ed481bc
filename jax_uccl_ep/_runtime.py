"""The process-global proxy runtime: start, connect through jax.distributed's key-value store, shut down."""
from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import jax

from . import _ffi, _uccl_ep

_lock = threading.Lock()
_topology: "Topology | None" = None
_two_level: "TwoLevel | None" = None
_UNSET = object()
_previous_plan: Any = _UNSET  # the plan of the last initialize(): programs traced under it route by it
_generation = 0  # initialize() calls so far; every process makes the same calls, so keys never collide
_atexit_registered = False


@dataclass(frozen=True)
class RuntimeSettings:
    """Settings read from the environment at initialize() (see the README for each variable)."""

    providers: str | None
    num_proxy_threads: int
    buffer_bytes: int
    timeout_s: float
    reorder: bool
    max_inflight_writes: int
    max_write_bytes: int
    max_inflight_bytes: int
    hierarchical: bool
    two_level: str  # "auto", "1" or "0" (UCCL_EP_TWO_LEVEL)

    @staticmethod
    def from_env() -> "RuntimeSettings":
        env = os.environ
        return RuntimeSettings(
            providers=env.get("UCCL_EP_FI_PROVIDER") or None,
            num_proxy_threads=int(env.get("UCCL_EP_NUM_PROXY_THREADS", "1")),
            buffer_bytes=int(env.get("UCCL_EP_BUFFER_BYTES", str(64 << 20))),
            timeout_s=float(env.get("UCCL_EP_TIMEOUT_S", "120")),
            reorder=env.get("UCCL_EP_REORDER", "0") not in ("", "0"),
            max_inflight_writes=int(env.get("UCCL_EP_MAX_INFLIGHT_WRITES", "256")),
            max_write_bytes=int(env.get("UCCL_EP_MAX_WRITE_BYTES", str(1 << 20))),
            max_inflight_bytes=int(env.get("UCCL_EP_MAX_INFLIGHT_BYTES", "0")),
            hierarchical=env.get("UCCL_EP_HIERARCHICAL", "1") != "0",
            two_level=env.get("UCCL_EP_TWO_LEVEL", "auto").strip().lower() or "auto",
        )


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
    def build(process_of_rank: list[int], host_of_process: list[str], per_node: int | None = None) -> "Topology":
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


def two_level() -> TwoLevel | None:
    """The two-level plan initialize() made, or None (one node, UCCL_EP_TWO_LEVEL=0, unequal nodes, ...)."""
    return _two_level


def _plan_two_level(settings: RuntimeSettings, topo: Topology, platform: str,
                    process_of_rank: list[int]) -> TwoLevel | None:
    """Whether normal mode routes in two levels: by default on GPUs across nodes with 2 to 8 GPUs on every node
    (the node level runs over NVLink); CPU devices take it only with UCCL_EP_TWO_LEVEL=1 (their default is the
    hierarchical rounds of kernels/cpu, the same routing inside one op). Every process decides from the same facts
    (the topology, which process holds each rank), so all reach one answer. On several nodes, UCCL_EP_TWO_LEVEL=1
    raises where it cannot apply; on one node it does nothing."""
    mode = settings.two_level
    if mode not in ("auto", "1", "0"):
        raise ValueError(f"UCCL_EP_TWO_LEVEL must be auto, 1 or 0, got {mode!r}")
    gpu = platform == "gpu"
    if mode == "0" or topo.num_nodes < 2 or (mode == "auto" and not gpu):
        return None
    sizes = {len(topo.ranks_on(n)) for n in range(topo.num_nodes)}
    per_node = min(sizes)
    reason = None
    if not settings.hierarchical:
        reason = "UCCL_EP_HIERARCHICAL=0 asks for flat routing"
    elif len(sizes) != 1:
        reason = f"nodes hold different numbers of ranks ({sorted(sizes)})"
    elif per_node < 2:
        reason = "every node holds one rank"
    elif gpu and per_node > 8:
        reason = f"{per_node} GPUs per node (NVLink groups hold at most 8)"
    elif gpu and any(len({n for n, p in zip(topo.node_of_rank, process_of_rank) if p == q}) > 1
                     for q in set(process_of_rank)):
        reason = "a process drives GPUs of several nodes (a node's NVLink runtime is per process)"
    if reason is not None:
        if mode == "1":
            raise ValueError(f"jax_uccl_ep.initialize: UCCL_EP_TWO_LEVEL=1 but {reason}")
        return None
    across = gpu and bool(_uccl_ep.nvl_gpu_initiated_normal(topo.num_nodes))
    return TwoLevel(topo.num_nodes, per_node, topo.node_of_rank, gpu, across)


def topology() -> Topology:
    """The job's node layout as initialize() found it (raises before initialize())."""
    if _topology is None:
        raise RuntimeError("jax_uccl_ep.topology: call jax_uccl_ep.initialize() first")
    return _topology


def _distributed_client() -> Any | None:
    from jax._src import distributed  # the key-value store has no public accessor yet

    return distributed.global_state.client


def _distributed_kwargs_from_env() -> dict:
    """What `python -m jax_uccl_ep.launch` (or any launcher) puts in the environment."""
    env = os.environ
    if not env.get("JAX_COORDINATOR_ADDRESS"):
        return {}
    kwargs: dict[str, Any] = {"coordinator_address": env["JAX_COORDINATOR_ADDRESS"]}
    if env.get("JAX_NUM_PROCESSES"):
        kwargs["num_processes"] = int(env["JAX_NUM_PROCESSES"])
    if env.get("JAX_PROCESS_ID"):
        kwargs["process_id"] = int(env["JAX_PROCESS_ID"])
    if env.get("JAX_LOCAL_DEVICE_IDS"):
        kwargs["local_device_ids"] = [int(i) for i in env["JAX_LOCAL_DEVICE_IDS"].split(",")]
    return kwargs


def _maybe_initialize_distributed(kwargs: dict) -> None:
    if _distributed_client() is not None:
        return
    kwargs = kwargs or _distributed_kwargs_from_env()
    if not kwargs:
        return
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        # XLA's CPU collectives across processes (psum, all_gather in user code and tests) need gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)


def _exchange(client: Any, key: str, local: dict[int, bytes], count: int, timeout_ms: int) -> list[bytes]:
    for index, value in local.items():
        client.key_value_set_bytes(f"{key}/{index}", value)
    return [
        local[i] if i in local else client.blocking_key_value_get_bytes(f"{key}/{i}", timeout_ms)
        for i in range(count)
    ]


def _shared_settings(settings: RuntimeSettings, buffer_bytes: int | None, low_latency_bytes: int | None) -> bytes:
    """The settings every process must share, as this process sees them: peers compute where their messages land
    from their own buffer layout, and message shapes, channels and routes from their own settings."""
    env = os.environ
    shared = {
        "UCCL_EP_BUFFER_BYTES": settings.buffer_bytes,
        "UCCL_EP_NUM_PROXY_THREADS": settings.num_proxy_threads,
        "UCCL_EP_HIERARCHICAL": settings.hierarchical,
        "UCCL_EP_TWO_LEVEL": settings.two_level,
        "UCCL_EP_GPUS_PER_NODE": env.get("UCCL_EP_GPUS_PER_NODE") or None,
        "UCCL_EP_GPU_INITIATED": env.get("UCCL_EP_GPU_INITIATED", "1") != "0",
        "UCCL_EP_PINNED": env.get("UCCL_EP_PINNED", "1") != "0",
        "UCCL_EP_NUM_SMS": env.get("UCCL_EP_NUM_SMS", "24"),
        "UCCL_EP_NVL_BULK": env.get("UCCL_EP_NVL_BULK", "1") != "0",
        "UCCL_EP_NVL_BUFFER_BYTES or initialize(buffer_bytes=)":
            buffer_bytes if buffer_bytes is not None else env.get("UCCL_EP_NVL_BUFFER_BYTES", str(1 << 30)),
        "UCCL_EP_LL_BUFFER_BYTES or initialize(low_latency_buffer_bytes=)":
            low_latency_bytes if low_latency_bytes is not None else env.get("UCCL_EP_LL_BUFFER_BYTES", str(256 << 20)),
    }
    return json.dumps({k: str(v) for k, v in shared.items()}, sort_keys=True).encode()


def _check_settings_agree(per_process: list[bytes]) -> None:
    """Raises ValueError naming each setting that differs between processes, with every process's value."""
    values = [json.loads(v) for v in per_process]
    differ = [name for name in values[0] if len({v.get(name) for v in values}) > 1]
    if differ:
        lines = [f"{name}: " + ", ".join(f"process {i} {v.get(name)}" for i, v in enumerate(values))
                 for name in differ]
        raise ValueError("jax_uccl_ep.initialize: every process must use the same settings; these differ:\n  " +
                         "\n  ".join(lines))


def _ffi_device_ordinal(device: Any) -> int:
    """The number XLA hands an FFI handler as its DeviceOrdinal for `device`.

    GPUs report their local ordinal; CPU devices report their global id (seen with jax 0.10: process 1's
    CPU devices are 2048, 2049, ...).
    """
    return device.id if device.platform == "cpu" else device.local_hardware_id


def _is_initialized() -> bool:
    return bool(_uccl_ep.is_initialized()) or bool(getattr(_uccl_ep, "nvl_is_initialized", lambda: False)())


def initialize(*, buffer_bytes: int | None = None, low_latency_buffer_bytes: int | None = None,
               **kwargs: Any) -> None:
    """Starts the process-global runtime (idempotent, thread-safe).

    If jax.distributed is not initialized and `kwargs` (or the usual environment, e.g.
    ``JAX_COORDINATOR_ADDRESS``) name a coordinator, calls ``jax.distributed.initialize(**kwargs)`` first.
    A single process with several local devices needs no jax.distributed. Every process of the job must call
    this. Peers exchange endpoint names, memory keys and CUDA IPC handles through jax.distributed's key-value
    store.

    Args:
      buffer_bytes: GPUs only: bytes of the NVLink buffer per GPU (default ``UCCL_EP_NVL_BUFFER_BYTES`` or
        1 GiB). ``nvl_buffer_bytes(...)`` gives the exact need for a shape. CPU devices size their buffers
        from ``UCCL_EP_BUFFER_BYTES``.
      low_latency_buffer_bytes: GPUs only: bytes per GPU for low-latency mode (default
        ``UCCL_EP_LL_BUFFER_BYTES`` or 256 MiB; 0 turns the mode off). ``low_latency_buffer_bytes(...)`` gives the
        need for a shape.

    GPUs on several nodes (or with ``UCCL_EP_GPUS_PER_NODE``) run on the proxy runtime (a process may drive one
    GPU or all of its host's), GPU-initiated (the kernels push the proxies' commands); its buffers come from
    ``UCCL_EP_BUFFER_BYTES`` as on CPU devices. Normal mode then routes in two levels where nodes are equal (see
    ``two_level()``), with an NVLink runtime per node whose buffers ``buffer_bytes`` sizes (for num_nodes x tokens
    per rank rows); ``low_latency_buffer_bytes`` is ignored there.
    """
    global _generation, _atexit_registered
    with _lock:
        if _is_initialized():
            return
        _maybe_initialize_distributed(kwargs)
        settings = RuntimeSettings.from_env()
        _generation += 1
        key = f"jax_uccl_ep/{_generation}"
        client = _distributed_client()
        timeout_ms = int(settings.timeout_s * 1000)

        devices = sorted(jax.devices(), key=lambda d: d.id)
        rank_of = _ffi.global_ranks()  # the numbering the lowering's group tables use
        local = [(_ffi_device_ordinal(d), rank_of[d.id]) for d in jax.local_devices()]
        num_processes = jax.process_count()
        if num_processes > 1 and client is None:
            raise RuntimeError("jax_uccl_ep.initialize: several processes but no jax.distributed client")

        hosts = [socket.gethostname().encode()]
        if num_processes > 1:
            hosts = _exchange(client, f"{key}/host", {jax.process_index(): hosts[0]}, num_processes, timeout_ms)
            mine = _shared_settings(settings, buffer_bytes, low_latency_buffer_bytes)
            _check_settings_agree(_exchange(client, f"{key}/settings", {jax.process_index(): mine}, num_processes,
                                            timeout_ms))
        per_node = os.environ.get("UCCL_EP_GPUS_PER_NODE")
        topo = Topology.build([d.process_index for d in devices], [h.decode() for h in hosts],
                              int(per_node) if per_node else None)
        plan = None
        if devices[0].platform == "gpu" and topo.num_nodes == 1:
            _start_gpus(buffer_bytes, low_latency_buffer_bytes, devices, local, client, key, timeout_ms)
        elif devices[0].platform == "gpu":
            _require_cuda_build()
            _start_cpus(settings, devices, local, topo, client, key, timeout_ms)
            try:  # after the proxy runtime: whether GPUs may push its commands depends on its memory
                plan = _plan_two_level(settings, topo, "gpu", [d.process_index for d in devices])
                _check_gpus_over_proxy(plan, buffer_bytes, low_latency_buffer_bytes)
                if plan is not None:
                    _start_node_gpus(buffer_bytes, topo, local, client, key, timeout_ms)
            except BaseException:
                _uccl_ep.shutdown()
                raise
        else:
            plan = _plan_two_level(settings, topo, "cpu", [d.process_index for d in devices])  # before anything starts
            _start_cpus(settings, devices, local, topo, client, key, timeout_ms)
        global _topology, _two_level, _previous_plan
        if _previous_plan is not _UNSET and plan != _previous_plan:
            jax.clear_caches()  # compiled programs route by the plan they were traced under
        _topology = topo
        _two_level = _previous_plan = plan
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True


def _require_cuda_build() -> None:
    if not hasattr(_uccl_ep, "nvl_start"):
        raise RuntimeError("jax_uccl_ep was built without CUDA; rebuild where nvcc is found (UCCL_EP_CUDA=ON)")


def _check_gpus_over_proxy(plan: TwoLevel | None, buffer_bytes: int | None, low_latency_bytes: int | None) -> None:
    """GPUs on several nodes run on the proxy runtime (ops GPU-initiated where they can, else host-staged through
    ffi/cpu_handlers.cpp), with a node-level NVLink runtime beside it under two-level routing. A process may drive
    several of them (a process per host, as multi-host JAX jobs run): XLA launches each GPU's work from a thread of
    its own, so an op that waits on the host for its peers holds up no other GPU of the process."""
    ignored = [name for name, v in (("buffer_bytes", None if plan else buffer_bytes),
                                     ("low_latency_buffer_bytes", low_latency_bytes)) if v is not None]
    if ignored:
        warnings.warn(f"jax_uccl_ep.initialize: GPUs on several nodes use the proxy runtime, whose buffers "
                      f"UCCL_EP_BUFFER_BYTES sizes; {' and '.join(ignored)} ignored"
                      + ("" if plan else " (buffer_bytes sizes the NVLink buffers of two-level routing only)"),
                      stacklevel=3)


def _start_node_gpus(buffer_bytes: int | None, topo: Topology, local: list, client: Any, key: str,
                     timeout_ms: int) -> None:
    """The node level of two-level routing: an NVLink runtime among each node's GPUs (NVLink ranks are the ranks'
    indices on their node), beside the proxy runtime. IPC handles go through the key-value store by global rank."""
    if buffer_bytes is None:
        buffer_bytes = int(os.environ.get("UCCL_EP_NVL_BUFFER_BYTES", str(1 << 30)))
    node = topo.node_of_rank[local[0][1]]
    members = topo.ranks_on(node)
    _uccl_ep.nvl_start(int(buffer_bytes), 0, len(members), [(o, topo.local_rank[r]) for o, r in local], members)
    _connect_nvlink(members, client, key, timeout_ms)


def _connect_nvlink(members: list[int], client: Any, key: str, timeout_ms: int) -> None:
    """Connects the started NVLink runtime, whose rank i is global rank members[i]: this process's CUDA IPC handles
    go through the key-value store (by global rank) to the other processes, and the runtime maps the members'
    buffers in that order. Shuts the runtime down if anything fails."""
    try:
        handles = {members[i]: bytes(h) for i, h in _uccl_ep.nvl_ipc_handles().items()}
        if jax.process_count() > 1:
            for r, h in handles.items():
                client.key_value_set_bytes(f"{key}/ipc/{r}", h)
            ordered = [handles[r] if r in handles else
                       client.blocking_key_value_get_bytes(f"{key}/ipc/{r}", timeout_ms) for r in members]
        else:
            ordered = [handles[r] for r in members]
        _uccl_ep.nvl_connect(ordered)
        if jax.process_count() > 1:
            client.wait_at_barrier(f"{key}/ipc_connected", timeout_ms)  # the proxy runtime may use ".../connected"
    except BaseException:
        _uccl_ep.nvl_shutdown()
        raise


def _start_gpus(buffer_bytes: int | None, low_latency_bytes: int | None, devices: list, local: list, client: Any,
                key: str, timeout_ms: int) -> None:
    _require_cuda_build()
    if buffer_bytes is None:
        buffer_bytes = int(os.environ.get("UCCL_EP_NVL_BUFFER_BYTES", str(1 << 30)))
    if low_latency_bytes is None:
        low_latency_bytes = int(os.environ.get("UCCL_EP_LL_BUFFER_BYTES", str(256 << 20)))
    _uccl_ep.nvl_start(int(buffer_bytes), int(low_latency_bytes), len(devices), local)
    _connect_nvlink(list(range(len(devices))), client, key, timeout_ms)


def _start_cpus(settings: RuntimeSettings, devices: list, local: list, topo: Topology, client: Any, key: str,
                timeout_ms: int) -> None:
    num_processes = jax.process_count()
    if hasattr(_uccl_ep, "install_pinned_host_allocator") and os.environ.get("UCCL_EP_PINNED", "1") != "0":
        # On a machine with GPUs, rings and buffers in pinned, mapped memory (GPU producers, staging).
        _uccl_ep.install_pinned_host_allocator()
    providers = settings.providers
    if providers is None:
        # One host: shared memory. Several: the NICs' providers first, TCP as the portable fallback.
        providers = "shm,tcp;ofi_rxm" if topo.num_nodes == 1 else "efa,verbs;ofi_rxm,tcp;ofi_rxm"

    config = _uccl_ep.Config()
    config.providers = providers
    config.num_channels = settings.num_proxy_threads
    config.buffer_bytes = settings.buffer_bytes
    config.timeout_s = settings.timeout_s
    config.reorder = settings.reorder
    config.max_inflight_writes = settings.max_inflight_writes
    config.max_write_bytes = settings.max_write_bytes
    config.max_inflight_bytes = settings.max_inflight_bytes
    config.node_of_rank = list(topo.node_of_rank)  # normal mode crosses nodes once per token (kernels/cpu)
    config.hierarchical = settings.hierarchical
    _uccl_ep.start(config, len(devices), local)
    try:
        infos = dict(zip((r for _, r in local), _uccl_ep.local_infos()))
        if num_processes > 1:
            all_infos = _exchange(client, f"{key}/endpoint", infos, len(devices), timeout_ms)
        else:
            all_infos = [infos[r] for r in range(len(devices))]
        _uccl_ep.connect(all_infos)
        if num_processes > 1:
            client.wait_at_barrier(f"{key}/connected", timeout_ms)
    except BaseException:
        _uccl_ep.shutdown()
        raise


def shutdown() -> None:
    """Stops the proxy threads, closes the endpoints and frees every buffer. initialize() may follow."""
    with _lock:
        if not _is_initialized():
            return
        if getattr(_uccl_ep, "nvl_is_initialized", lambda: False)():
            try:
                jax.effects_barrier()  # queued kernels and copies still use the buffers
                _uccl_ep.nvl_check_errors()
            except Exception as e:  # an error nobody collected with check_errors(): say it, then shut down
                import warnings

                warnings.warn(f"jax_uccl_ep.shutdown: {e}", RuntimeWarning, stacklevel=2)
        # Bounded by the same deadline as every other wait, and by 10 s: a dead peer must not hold up exit.
        wait_s = min(RuntimeSettings.from_env().timeout_s, 10.0)
        _uccl_ep.quiesce(min(wait_s, 5.0))  # our last writes land before peers may close their endpoints
        client = _distributed_client()
        if client is not None and jax.process_count() > 1:
            # Wait for peers so nobody still writes into buffers we free.
            try:
                client.wait_at_barrier(f"jax_uccl_ep/{_generation}/shutdown", int(wait_s * 1000))
            except Exception:
                pass
        _uccl_ep.shutdown()
        if hasattr(_uccl_ep, "nvl_shutdown"):
            _uccl_ep.nvl_shutdown()
        global _topology, _two_level
        _topology = None
        _two_level = None


def is_initialized() -> bool:
    """Whether the runtime is running in this process."""
    return _is_initialized()


def check_errors() -> None:
    """Raises an error a GPU kernel found earlier (bad expert index, capacity exceeded), if any.

    Kernels cannot fail the call that launched them, and an op must not fail on one rank only (its peers would
    wait for it), so GPU ops never raise these themselves: call this (it waits for the GPUs first) where a
    step's results are checked. This holds for GPU-initiated ops across nodes too. CPU devices (and host-staged
    ops) raise such errors from the op itself.
    """
    # Under two-level routing both runtimes run: errors of either level are raised.
    if getattr(_uccl_ep, "nvl_is_initialized", lambda: False)():
        _uccl_ep.nvl_check_errors()
    if hasattr(_uccl_ep, "proxy_check_errors") and _uccl_ep.is_initialized():
        _uccl_ep.proxy_check_errors()


def _dispatch_row_bytes(hidden: int, fp8: bool, dtype: Any) -> tuple[int, int]:
    """(x bytes, scale bytes) of one dispatched row: FP8 rows are `hidden` bytes with a float32 scale per
    FP8_BLOCK channels; other rows are hidden elements of `dtype` and have no scales."""
    import numpy as np

    from .fp8 import FP8_BLOCK

    if fp8:
        return hidden, (hidden // FP8_BLOCK) * 4
    return hidden * np.dtype(dtype).itemsize, 0


def nvl_buffer_bytes(num_tokens: int, hidden: int, *, num_ranks: int, topk: int, dtype: Any = "bfloat16",
                     fp8: bool = False, with_weights: bool = True, combine_dtype: Any = "bfloat16") -> int:
    """Bytes of NVLink buffer per GPU that dispatch and combine need for these shapes (pass to initialize()).

    num_tokens: tokens per rank; hidden: channels; dtype: of x (ignored with fp8, whose rows are hidden bytes
    plus hidden/128 float32 scales).
    """
    import numpy as np

    x_row, scale_row = _dispatch_row_bytes(hidden, fp8, dtype)
    combine_bf16 = np.dtype(combine_dtype).itemsize == 2
    return int(_uccl_ep.nvl_bytes_needed(num_ranks, num_tokens, x_row, scale_row, topk, with_weights, hidden,
                                         combine_bf16))


def low_latency_buffer_bytes(max_tokens_per_rank: int, hidden: int, *, num_ranks: int, num_experts: int,
                             topk: int, fp8: bool = True, dispatch_dtype: Any = "bfloat16",
                             combine_dtype: Any = "bfloat16") -> int:
    """Bytes of low-latency buffer per GPU that low_latency_dispatch/combine need for these shapes (pass to
    initialize(low_latency_buffer_bytes=...)). Two halves (consecutive ops alternate) of one region per sending
    rank, each large enough for a sender's worst case to one receiver: its max_tokens_per_rank token rows and
    max_tokens_per_rank * topk row-map entries (dispatch), or max_tokens_per_rank * topk combine rows.

    hidden: channels; fp8: dispatch rows are hidden bytes plus hidden/128 float32 scales (else dispatch_dtype).
    """
    import numpy as np

    x_row, scale_row = _dispatch_row_bytes(hidden, fp8, dispatch_dtype)
    combine_row = hidden * np.dtype(combine_dtype).itemsize
    if not hasattr(_uccl_ep, "nvl_low_latency_bytes_needed"):
        raise RuntimeError("jax_uccl_ep: low_latency_buffer_bytes is for GPUs; this build has no CUDA")
    return int(_uccl_ep.nvl_low_latency_bytes_needed(num_ranks, num_experts, max_tokens_per_rank, topk, x_row,
                                                     scale_row, combine_row))


def buffer_bytes_held() -> dict[int, tuple[int, int]]:
    """GPUs: {cuda ordinal index: (normal-mode bytes, low-latency bytes)} this process holds per local GPU."""
    if not getattr(_uccl_ep, "nvl_is_initialized", lambda: False)():
        return {}
    return dict(enumerate(tuple(x) for x in _uccl_ep.nvl_buffer_bytes_held()))


def local_ranks() -> list[int]:
    """Global ranks (indices into jax.devices() sorted by id) of this process's devices."""
    rank_of = _ffi.global_ranks()
    return sorted(rank_of[d.id] for d in jax.local_devices())
