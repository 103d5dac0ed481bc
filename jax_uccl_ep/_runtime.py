"""The process's runtimes: ``initialize()`` joins jax.distributed, compares the processes' settings, starts the
NVLink runtime (GPUs of one node) or the proxy runtime (CPU devices, GPUs across nodes; with a node-level NVLink
runtime beside it under two-level routing), connects them through jax.distributed's key-value store and records
the plan; ``shutdown()`` and ``check_errors()``; the buffer sizes ops need."""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax

from . import _ffi, _plan, _uccl_ep
from ._checks import FLOAT_DTYPES, summed_row_dtype
from ._plan import Topology, TwoLevel
from ._signals import kept_signal_handlers
from .config import Config, cluster_launcher, distributed_env
from .fp8 import dispatch_row_bytes

_log = logging.getLogger("jax_uccl_ep")
_lock = threading.Lock()
_previous_plan: _plan.RuntimePlan | None = None  # the last initialize()'s: programs lowered under it use its paths
_config: Config | None = None
_generation = 0  # initialize() calls so far; every process makes the same calls, so keys never collide
_atexit_registered = False


def two_level() -> TwoLevel | None:
    """The two-level plan initialize() made, or None (one node, UCCL_EP_TWO_LEVEL=0, unequal nodes, ...)."""
    return _plan.two_level()


def _plan_two_level(config: Config, topo: Topology, platform: str, process_of_rank: list[int]) -> TwoLevel | None:
    """Whether normal mode routes in two levels: by default on GPUs across nodes with 2 to 8 GPUs on every node
    (the node level runs over NVLink); CPU devices take it only with UCCL_EP_TWO_LEVEL=1 (their default is the
    hierarchical rounds of kernels/cpu, the same routing inside one op). Every process decides from the same facts
    (the topology, which process holds each rank), so all reach one answer. On several nodes, UCCL_EP_TWO_LEVEL=1
    raises where it cannot apply; on one node it does nothing."""
    mode = config.two_level
    gpu = platform == "gpu"
    if mode == "0" or topo.num_nodes < 2 or (mode == "auto" and not gpu):
        return None
    sizes = {len(topo.ranks_on(n)) for n in range(topo.num_nodes)}
    per_node = min(sizes)
    reason = None
    if not config.hierarchical:
        reason = "UCCL_EP_HIERARCHICAL=0 asks for flat routing"
    elif len(sizes) != 1:
        reason = f"nodes hold different numbers of ranks ({sorted(sizes)})"
    elif per_node < 2:
        reason = "every node holds one rank"
    elif gpu and per_node > 8:
        reason = f"{per_node} GPUs per node (NVLink groups hold at most 8)"
    elif gpu and any(
        len({n for n, p in zip(topo.node_of_rank, process_of_rank) if p == q}) > 1 for q in set(process_of_rank)
    ):
        reason = "a process drives GPUs of several nodes (a node's NVLink runtime is per process)"
    if reason is not None:
        if mode == "1":
            raise ValueError(f"jax_uccl_ep.initialize: UCCL_EP_TWO_LEVEL=1 but {reason}")
        return None
    across = gpu and _gpu_initiated(config, "normal", topo.num_nodes)
    return TwoLevel(topo.num_nodes, per_node, topo.node_of_rank, gpu, across)


def _gpu_initiated(config: Config, mode: str, num_ranks: int) -> bool:
    """Whether GPU kernels may push the proxy runtime's commands for ops of `mode` over `num_ranks` ranks: asked
    for (UCCL_EP_GPU_INITIATED), and the kernels can (kernels/nvl/api.hpp: rank limits, pinned mapped memory)."""
    if not config.gpu_initiated or not hasattr(_uccl_ep, "nvl_gpu_initiated_normal"):
        return False
    can = _uccl_ep.nvl_gpu_initiated_normal if mode == "normal" else _uccl_ep.nvl_gpu_initiated_low_latency
    return bool(can(num_ranks))


def _gpu_writes_pairs(config: Config, num_nodes: int, gpu_initiated_normal: bool, two: TwoLevel | None) -> bool:
    """Whether a GPU job's dispatch(layout="expert") may have its receive write the pair buffer (the plan's
    gpu_writes_pairs; _plan.gpu_writes_pairs adds each op's own limits): over NVLink with bulk copies (the launch
    lays the pairs out, pulled by one process or sent between processes), or flat over the GPU-initiated proxy;
    each unless its setting turns it off. Elsewhere (SM-store copies, two-level routing, host-staged proxy ops)
    token rows, then XLA's layout."""
    if num_nodes == 1:
        return config.nvl_bulk and config.nvl_dispatch_pairs
    return gpu_initiated_normal and two is None and config.proxy_dispatch_pairs


def topology() -> Topology:
    """The job's node layout as initialize() found it (raises before initialize())."""
    plan = _plan.current()
    if plan is None:
        raise RuntimeError("jax_uccl_ep.topology: call jax_uccl_ep.initialize() first")
    return plan.topology


def _distributed_client() -> Any | None:
    from jax._src import distributed  # the key-value store has no public accessor yet

    return distributed.global_state.client


def _maybe_initialize_distributed(kwargs: dict) -> None:
    """Joins the job's jax.distributed, unless the caller already did: with `kwargs`, or what a launcher put in
    the environment (jax_uccl_ep.launch's coordinator, or Slurm's and Open MPI's, which JAX reads itself)."""
    if _distributed_client() is not None:
        return
    kwargs = kwargs or distributed_env()
    launcher = None if kwargs else cluster_launcher()
    if not kwargs and launcher is None:
        return
    # JAX adds its flags to jax.config as attributes at run time, where the type checker cannot see them.
    platforms = jax.config.jax_platforms  # type: ignore[attr-defined]
    if platforms in (None, "", "cpu") or "cpu" in str(platforms):
        # XLA's CPU collectives across processes (psum, all_gather in user code and tests) need gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError) as e:
        where = launcher or "the coordinator in the environment (JAX_COORDINATOR_ADDRESS)"
        if "before any JAX" in str(e):
            raise RuntimeError(
                f"jax_uccl_ep.initialize: this process ran JAX (a computation, jax.devices(), jax.device_put, ...) "
                f"before initialize(), so it can no longer join the job started by {where}: move "
                "jax_uccl_ep.initialize() above the first JAX call of the script"
            ) from e
        raise RuntimeError(
            f"jax_uccl_ep.initialize: could not join the job started by {where}: {str(e).rstrip('.')}. Check the "
            "coordinator's address and that every process of the job started (JAX_COORDINATOR_ADDRESS, "
            "JAX_NUM_PROCESSES, JAX_PROCESS_ID), or call jax.distributed.initialize(...) yourself before "
            "jax_uccl_ep.initialize()"
        ) from e


def _exchange(client: Any, key: str, local: dict[int, bytes], count: int, timeout_ms: int) -> list[bytes]:
    for index, value in local.items():
        client.key_value_set_bytes(f"{key}/{index}", value)
    return [
        local[i] if i in local else client.blocking_key_value_get_bytes(f"{key}/{i}", timeout_ms) for i in range(count)
    ]


def _check_settings_agree(per_process: list[bytes]) -> None:
    """Raises ValueError naming each setting that differs between processes, with every process's value."""
    values = [json.loads(v) for v in per_process]
    differ = [name for name in values[0] if len({v.get(name) for v in values}) > 1]
    if differ:
        lines = [f"{name}: " + ", ".join(f"process {i} {v.get(name)}" for i, v in enumerate(values)) for name in differ]
        raise ValueError(
            "jax_uccl_ep.initialize: every process must use the same settings; these differ:\n  " + "\n  ".join(lines)
        )


def _ffi_device_ordinal(device: Any) -> int:
    """The number XLA hands an FFI handler as its DeviceOrdinal for `device`.

    GPUs report their local ordinal; CPU devices report their global id (seen with jax 0.10: process 1's
    CPU devices are 2048, 2049, ...).
    """
    return device.id if device.platform == "cpu" else device.local_hardware_id


def _is_initialized() -> bool:
    return bool(_uccl_ep.is_initialized()) or bool(getattr(_uccl_ep, "nvl_is_initialized", lambda: False)())


def configure_native(config: Config) -> None:
    """Hands the settings the C++ side reads (kernels, handlers) to it; initialize() does, and so does importing
    the package (with the environment's settings), so hooks that run without initialize() see them too."""
    settings = _uccl_ep.Settings()
    for name in (
        "timeout_s",
        "num_sms",
        "num_send_sms",
        "nvl_bulk",
        "nvl_pull_combine",
        "nvl_pull_dispatch",
        "ll_num_sms",
        "ll_fused",
        "kernel_timing",
    ):
        setattr(settings, name, getattr(config, name))
    _uccl_ep.configure(settings)


@dataclasses.dataclass(frozen=True)
class JobShapes:
    """What a job's EP ops move, for ``initialize(shapes=...)`` to size every buffer of the runtimes it starts
    (the NVLink and low-latency buffers of GPUs, the proxy runtime's buffer) once it knows the ranks and nodes.

    num_tokens: normal mode's tokens per rank (0: none); hidden: channels; topk: expert slots per token;
    num_experts: the experts (low-latency regions count rows per local expert); dtype: of x (with fp8, the dtype x
    is cast from); fp8: normal mode's dispatch sends FP8 rows; with_weights: dispatch carries the router weights;
    combine_dtype: of combine's rows; backward: the job takes gradients (their rows are of x's dtype and
    combine's); low_latency_max_tokens: max_tokens_per_rank of low-latency ops (0: none, and GPUs keep no
    low-latency buffer); low_latency_fp8: their dispatch sends FP8 rows (the op's default); ep_ranks: the ranks of
    the EP axis the ops run over (default: every rank of the job; with data parallelism across EP groups, a
    group's).
    """

    num_tokens: int
    hidden: int
    topk: int
    num_experts: int = 0
    dtype: Any = "bfloat16"
    fp8: bool = False
    with_weights: bool = True
    combine_dtype: Any = "bfloat16"
    backward: bool = True
    low_latency_max_tokens: int = 0
    low_latency_fp8: bool = True
    ep_ranks: int | None = None

    def __post_init__(self) -> None:
        if self.low_latency_max_tokens and self.num_experts <= 0:
            raise ValueError("jax_uccl_ep.JobShapes: low-latency ops (low_latency_max_tokens) need num_experts")

    def combine_rows_bf16(self) -> bool:
        """Whether the rows combine returns (and, with gradients, x's) travel as bfloat16: else as float32, where
        either dtype is wider (float16 rows travel as float32)."""
        import numpy as np

        bf16 = np.dtype(jax.numpy.bfloat16)
        return np.dtype(self.combine_dtype) == bf16 and (not self.backward or np.dtype(self.dtype) == bf16)

    def low_latency_dtypes(self) -> tuple[Any, Any]:
        """(dispatch, combine) dtypes low-latency rows travel as: the job's where low-latency ops take it (float32,
        bfloat16), else float32, as the layer's decoding sends a float16 job's rows."""
        return summed_row_dtype(self.dtype), summed_row_dtype(self.combine_dtype)

    def setting(self) -> str:
        """The fields as one canonical line (compared across processes, which must size alike)."""
        import numpy as np

        values = dataclasses.asdict(self)
        values["dtype"], values["combine_dtype"] = np.dtype(self.dtype).name, np.dtype(self.combine_dtype).name
        return ", ".join(f"{name}={value}" for name, value in values.items())


def _sized(
    config: Config, shapes: JobShapes, topo: Topology, gpu: bool, process_of_rank: list[int], given: dict
) -> Config:
    """`config` with each buffer `shapes` need on this job, where neither an argument of initialize() nor its
    environment variable gave the size."""
    num_ranks, nodes = len(topo.node_of_rank), topo.num_nodes
    on_node = {len(topo.ranks_on(n)) for n in range(nodes)}
    per_node = on_node.pop() if nodes > 1 and len(on_node) == 1 else num_ranks  # unequal nodes route flat
    s = shapes
    sizes: dict[str, Any] = {}
    if not gpu or nodes > 1:  # the proxy runtime runs
        sizes["buffer_bytes"] = _proxy_bytes(s, num_ranks, per_node, "gpu" if gpu else "cpu", config, process_of_rank)
    two = gpu and nodes > 1 and _plan_two_level(config, topo, "gpu", process_of_rank) is not None
    if gpu and (nodes == 1 or two):  # an NVLink runtime: the job's, or each node's under two-level routing
        sizes["nvl_buffer_bytes"] = nvl_buffer_bytes(  # a token at least: the runtime takes no empty regions
            max(1, s.num_tokens) * (nodes if two else 1),
            s.hidden,
            num_ranks=per_node if two else num_ranks,
            topk=s.topk,
            dtype=s.dtype,
            fp8=s.fp8,
            with_weights=s.with_weights,
            combine_dtype="bfloat16" if s.combine_rows_bf16() else "float32",
        )
    if gpu and nodes == 1:
        sizes["ll_buffer_bytes"] = 0
        if s.low_latency_max_tokens:
            ll_dispatch_dtype, ll_combine_dtype = s.low_latency_dtypes()
            sizes["ll_buffer_bytes"] = low_latency_buffer_bytes(
                s.low_latency_max_tokens,
                s.hidden,
                num_ranks=num_ranks,
                num_experts=s.num_experts,
                topk=s.topk,
                fp8=s.low_latency_fp8,
                dispatch_dtype=ll_dispatch_dtype,
                combine_dtype=ll_combine_dtype,
            )
    kept = {name for name in sizes if given.get(name) is not None} | set(Config.set_in_env())
    return dataclasses.replace(config, **{k: v for k, v in sizes.items() if k not in kept})


def initialize(
    *,
    config: Config | None = None,
    shapes: JobShapes | Callable[[Literal["cpu", "gpu"]], JobShapes] | None = None,
    nvl_buffer_bytes: int | None = None,
    low_latency_buffer_bytes: int | None = None,
    proxy_buffer_bytes: int | None = None,
    buffer_bytes: int | None = None,
    **kwargs: Any,
) -> None:
    """Starts the process-global runtime (idempotent, thread-safe).

    If jax.distributed is not initialized and `kwargs` (or the usual environment, e.g.
    ``JAX_COORDINATOR_ADDRESS``) name a coordinator, calls ``jax.distributed.initialize(**kwargs)`` first.
    A single process with several local devices needs no jax.distributed. Every process of the job must call
    this. Peers exchange endpoint names, memory keys and CUDA IPC handles through jax.distributed's key-value
    store.

    Args:
      config: the settings (``jax_uccl_ep.Config``; default: its defaults); environment variables that are set
        override its fields. Every process must use the same values where peers depend on them (initialize()
        compares them and names any that differ).
      shapes: what the job's ops move (``JobShapes``): every buffer of the runtimes started is then sized for
        them, whatever the routing of their tokens, on this job's ranks and nodes, except those that an argument
        below or its environment variable sizes (a buffer size in `config` is replaced). Processes must pass the
        same shapes, and end with the same sizes (both compared). A function of the platform ("cpu" or "gpu")
        returning them is called once JAX's devices are known (``layers.moe_job_shapes`` takes the platform).
      nvl_buffer_bytes: GPUs only: bytes of the NVLink buffer per GPU (overrides ``config.nvl_buffer_bytes`` and
        ``UCCL_EP_NVL_BUFFER_BYTES``; default 1 GiB). ``nvl_buffer_bytes(...)`` gives the exact need for a shape.
        CPU devices size their buffers from ``config.buffer_bytes`` (``UCCL_EP_BUFFER_BYTES``).
      low_latency_buffer_bytes: GPUs only: bytes per GPU for low-latency mode (overrides
        ``config.ll_buffer_bytes`` and ``UCCL_EP_LL_BUFFER_BYTES``; default 256 MiB; 0 turns the mode off).
        ``low_latency_buffer_bytes(...)`` gives the need for a shape.
      proxy_buffer_bytes: bytes of the proxy runtime's registered buffer per device, which carries every op on
        CPU devices and GPUs' ops across nodes (overrides ``config.buffer_bytes`` and ``UCCL_EP_BUFFER_BYTES``;
        default 64 MiB). ``proxy_buffer_bytes(...)`` gives what a job's shapes need.
      buffer_bytes: deprecated spelling of ``nvl_buffer_bytes`` (a DeprecationWarning says so): it named the
        NVLink buffer, while ``Config.buffer_bytes`` is the proxy runtime's.

    GPUs on several nodes (or with ``UCCL_EP_GPUS_PER_NODE``) run on the proxy runtime (a process may drive one
    GPU or all of its host's), GPU-initiated (the kernels push the proxies' commands); its buffers come from
    ``UCCL_EP_BUFFER_BYTES`` as on CPU devices. Normal mode then routes in two levels where nodes are equal (see
    ``two_level()``), with an NVLink runtime per node whose buffers ``nvl_buffer_bytes`` sizes (for num_nodes x
    tokens per rank rows); ``low_latency_buffer_bytes`` is ignored there.
    """
    if buffer_bytes is not None:
        if nvl_buffer_bytes is not None:
            raise TypeError("jax_uccl_ep.initialize: pass nvl_buffer_bytes only (buffer_bytes is its old name)")
        warnings.warn(
            "jax_uccl_ep.initialize(buffer_bytes=...) is deprecated: pass nvl_buffer_bytes=... (the NVLink buffer "
            "per GPU; Config.buffer_bytes is the proxy runtime's)",
            DeprecationWarning,
            stacklevel=2,
        )
        nvl_buffer_bytes = buffer_bytes
    global _generation, _atexit_registered, _previous_plan, _config
    with _lock, kept_signal_handlers():  # starting a fabric installs libfabric's handlers: the process keeps its own
        if _is_initialized():
            return
        _maybe_initialize_distributed(kwargs)
        config = Config.from_env(config)
        explicit = {"nvl_buffer_bytes": nvl_buffer_bytes, "low_latency_buffer_bytes": low_latency_buffer_bytes}
        if proxy_buffer_bytes is not None:
            config = dataclasses.replace(config, buffer_bytes=int(proxy_buffer_bytes))
        if nvl_buffer_bytes is not None:
            config = dataclasses.replace(config, nvl_buffer_bytes=int(nvl_buffer_bytes))
        if low_latency_buffer_bytes is not None:
            config = dataclasses.replace(config, ll_buffer_bytes=int(low_latency_buffer_bytes))
        _generation += 1
        key = f"jax_uccl_ep/{_generation}"
        client = _distributed_client()
        timeout_ms = int(config.timeout_s * 1000)

        devices = sorted(jax.devices(), key=lambda d: d.id)
        rank_of = _ffi.global_ranks()  # the numbering the lowering's group tables use
        local = [(_ffi_device_ordinal(d), rank_of[d.id]) for d in jax.local_devices()]
        num_processes = jax.process_count()
        gpu = devices[0].platform == "gpu"
        if shapes is not None:
            if callable(shapes):
                shapes = shapes("gpu" if gpu else "cpu")
            if not isinstance(shapes, JobShapes):
                raise TypeError(
                    f"jax_uccl_ep.initialize: shapes must be a JobShapes (or a function of the platform returning "
                    f"one), got {type(shapes).__name__}"
                )
        if num_processes > 1 and client is None:
            raise RuntimeError("jax_uccl_ep.initialize: several processes but no jax.distributed client")

        hosts = [socket.gethostname().encode()]
        if num_processes > 1:
            hosts = _exchange(client, f"{key}/host", {jax.process_index(): hosts[0]}, num_processes, timeout_ms)
            mine = json.dumps({**config.shared(), "shapes": shapes and shapes.setting()}, sort_keys=True).encode()
            _check_settings_agree(
                _exchange(client, f"{key}/settings", {jax.process_index(): mine}, num_processes, timeout_ms)
            )
        configure_native(config)
        process_of_rank = [d.process_index for d in devices]
        topo = Topology.build(process_of_rank, [h.decode() for h in hosts], config.gpus_per_node)
        if shapes is not None:
            given = {"nvl_buffer_bytes": nvl_buffer_bytes, "ll_buffer_bytes": low_latency_buffer_bytes}
            config = _sized(config, shapes, topo, gpu, process_of_rank, {**given, "buffer_bytes": proxy_buffer_bytes})
            if num_processes > 1:  # a size one process was given and another sized would corrupt messages
                mine = json.dumps(config.shared(), sort_keys=True).encode()
                _check_settings_agree(
                    _exchange(client, f"{key}/sized", {jax.process_index(): mine}, num_processes, timeout_ms)
                )
        two = None
        if gpu and topo.num_nodes == 1:
            _require_cuda_build()
            _uccl_ep.nvl_start(config.nvl_buffer_bytes, config.ll_buffer_bytes, len(devices), local)
            _connect_nvlink(list(range(len(devices))), client, key, timeout_ms)
        elif gpu:
            _require_cuda_build()
            _start_proxies(config, devices, local, topo, client, key, timeout_ms)
            try:  # after the proxy runtime: whether GPUs may push its commands depends on its memory
                two = _plan_two_level(config, topo, "gpu", process_of_rank)
                _warn_ignored_on_proxy(two, explicit)
                if two is not None:
                    _start_node_gpus(config.nvl_buffer_bytes, topo, local, client, key, timeout_ms)
            except BaseException:
                _uccl_ep.shutdown()
                raise
        else:
            two = _plan_two_level(config, topo, "cpu", process_of_rank)  # before anything starts
            _start_proxies(config, devices, local, topo, client, key, timeout_ms)
        num_ranks = len(devices)
        gpu_initiated_normal = gpu and _gpu_initiated(config, "normal", num_ranks)
        plan = _plan.RuntimePlan(
            platform="gpu" if gpu else "cpu",
            nvlink=gpu and topo.num_nodes == 1,
            topology=topo,
            hierarchical=config.hierarchical,
            gpu_initiated_normal=gpu_initiated_normal,
            gpu_initiated_low_latency=gpu and _gpu_initiated(config, "low_latency", num_ranks),
            two_level=two,
            gpu_writes_pairs=gpu and _gpu_writes_pairs(config, topo.num_nodes, gpu_initiated_normal, two),
        )
        if _previous_plan is not None and plan != _previous_plan:
            jax.clear_caches()  # compiled programs carry the paths of the plan they were lowered under
        _plan.set_current(plan)
        _previous_plan = plan
        if jax.process_index() == 0:
            _log.info("%s", describe_plan(plan, config))
        _config = config
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True
    for hook in _after_initialize:
        hook()


# Run at the end of every initialize(), before the user's first computation (the layer's modules register here).
_after_initialize: list[Callable[[], None]] = []


def after_initialize(hook: Callable[[], None]) -> None:
    """Runs `hook` at the end of every initialize() from now on."""
    _after_initialize.append(hook)


def describe_plan(plan: _plan.RuntimePlan, config: Config) -> str:
    """One line: the runtimes, the buffers and the nodes initialize() set up (logged on process 0 at INFO)."""
    topo = plan.topology
    ranks, nodes = len(topo.node_of_rank), topo.num_nodes
    parts = [f"jax_uccl_ep: {ranks} ranks on {nodes} node{'s' if nodes != 1 else ''} ({topo.source})"]
    if plan.nvlink:
        parts.append(
            f"NVLink runtime, {config.nvl_buffer_bytes >> 20} MiB normal + "
            f"{config.ll_buffer_bytes >> 20} MiB low-latency buffer per GPU, {config.num_sms} SMs"
        )
    else:
        gpu = plan.platform == "gpu"
        parts.append(
            f"proxy runtime ({config.fi_provider or 'default providers'}), "
            f"{config.buffer_bytes >> 20} MiB buffer per device"
        )
        if gpu:
            normal = "GPU-initiated" if plan.gpu_initiated_normal else "host-staged"
            if plan.two_level is not None and plan.two_level.nvlink:
                across = "GPU-initiated" if plan.two_level.across_gpu_initiated else "host-staged"
                normal = f"in two levels (across nodes {across})"
            low_latency = "GPU-initiated" if plan.gpu_initiated_low_latency else "host-staged"
            parts.append(f"normal mode {normal}, low-latency {low_latency}")
        if plan.two_level is not None:
            two = plan.two_level
            parts.append(
                f"two-level routing: {two.num_nodes} nodes of {two.per_node}"
                + (", node level on NVLink" if two.nvlink else "")
            )
        elif plan.hierarchical and nodes > 1:
            parts.append("hierarchical rounds across nodes")
    return "; ".join(parts)


def config() -> Config:
    """The settings the running runtime was initialized with (before initialize(): the environment's)."""
    return _config if _config is not None else Config.from_env()


def _require_cuda_build() -> None:
    if not hasattr(_uccl_ep, "nvl_start"):
        raise RuntimeError("jax_uccl_ep was built without CUDA; rebuild where nvcc is found (UCCL_EP_CUDA=ON)")


def _warn_ignored_on_proxy(two: TwoLevel | None, explicit: dict[str, int | None]) -> None:
    """Warns about the buffer sizes given to initialize() that GPUs on several nodes do not use: they run on the
    proxy runtime (whose buffers UCCL_EP_BUFFER_BYTES sizes), with a node-level NVLink runtime beside it only under
    two-level routing (which nvl_buffer_bytes then sizes)."""
    ignored = [
        name
        for name, v in (
            ("nvl_buffer_bytes", None if two else explicit["nvl_buffer_bytes"]),
            ("low_latency_buffer_bytes", explicit["low_latency_buffer_bytes"]),
        )
        if v is not None
    ]
    if ignored:
        warnings.warn(
            f"jax_uccl_ep.initialize: GPUs on several nodes use the proxy runtime, whose buffers "
            f"UCCL_EP_BUFFER_BYTES sizes; {' and '.join(ignored)} ignored"
            + ("" if two else " (nvl_buffer_bytes sizes the NVLink buffers of two-level routing only)"),
            stacklevel=3,
        )


def _start_node_gpus(buffer_bytes: int, topo: Topology, local: list, client: Any, key: str, timeout_ms: int) -> None:
    """The node level of two-level routing: an NVLink runtime among each node's GPUs (NVLink ranks are the ranks'
    indices on their node), beside the proxy runtime. IPC handles go through the key-value store by global rank."""
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
            ordered = [
                handles[r] if r in handles else client.blocking_key_value_get_bytes(f"{key}/ipc/{r}", timeout_ms)
                for r in members
            ]
        else:
            ordered = [handles[r] for r in members]
        _uccl_ep.nvl_connect(ordered)
        if jax.process_count() > 1:
            client.wait_at_barrier(f"{key}/ipc_connected", timeout_ms)  # the proxy runtime may use ".../connected"
    except BaseException:
        _uccl_ep.nvl_shutdown()
        raise


def _start_proxies(
    config: Config, devices: list, local: list, topo: Topology, client: Any, key: str, timeout_ms: int
) -> None:
    num_processes = jax.process_count()
    if hasattr(_uccl_ep, "install_pinned_host_allocator") and config.pinned:
        # On a machine with GPUs, rings and buffers in pinned, mapped memory (GPU producers, staging).
        _uccl_ep.install_pinned_host_allocator()
    providers = config.fi_provider
    if providers is None:
        # One host: shared memory. Several: the NICs' providers first, TCP as the portable fallback.
        providers = "shm,tcp;ofi_rxm" if topo.num_nodes == 1 else "efa,verbs;ofi_rxm,tcp;ofi_rxm"

    proxy = _uccl_ep.ProxyConfig()
    proxy.providers = providers
    proxy.num_channels = config.num_proxy_threads
    proxy.buffer_bytes = config.buffer_bytes
    proxy.timeout_s = config.timeout_s
    proxy.max_inflight_writes = config.max_inflight_writes
    proxy.max_write_bytes = config.max_write_bytes
    proxy.max_inflight_bytes = config.max_inflight_bytes
    # Parked proxies wake when a host thread pushes or waits; GPU kernels that push commands ring no doorbell.
    if all(d.platform == "cpu" for d in devices):
        proxy.park_after_idle_s = config.proxy_park_after_ms / 1000
    _uccl_ep.start(proxy, len(devices), local)
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


@jax.jit
def _fence(x: jax.Array) -> jax.Array:
    return x + 1


def _finish_pending() -> None:
    """Waits until this process's computations whose results are alive have run: their EP ops may owe a peer
    rows. (What one of them raised reaches the op log, read by the caller.)"""
    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - a failed computation: the teardown goes on
        pass
    for array in jax.live_arrays():
        try:
            array.block_until_ready()
        except Exception:  # noqa: BLE001
            pass
    # Results nobody holds: a device runs the computations dispatched to it in order, so one more, awaited, runs
    # after all of them.
    for device in jax.local_devices():
        try:
            _fence(jax.device_put(0, device)).block_until_ready()
        except Exception:  # noqa: BLE001
            pass


def shutdown() -> None:
    """Stops the runtime: waits for this process's computations to finish (their EP ops may owe a peer rows),
    agrees with the peers that theirs have finished too (within ``Config.timeout_s``), then stops the proxy
    threads, closes the endpoints and frees every buffer. initialize() may follow.

    Problems it meets are printed on this rank, not raised (a shutdown often follows an error): a peer that does
    not arrive within the deadline. At interpreter exit, where it runs by itself, it also prints every op error
    of this run that no ``check_errors()`` collected (an op's error otherwise shows only where its result is
    read), and with ``UCCL_EP_EXIT_ON_UNREAD_ERRORS=1`` (the launcher sets it) the process then exits with
    status 1.
    """
    _shutdown(at_exit=False)


def _shutdown_at_exit() -> None:
    problems = _shutdown(at_exit=True)
    if problems and _config is not None and _config.exit_on_unread_errors:
        # Not jax.distributed.shutdown() first: its barrier would wait minutes for a peer that is gone.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _shutdown(at_exit: bool) -> list[str]:
    """The teardown; returns the problems found (already printed)."""
    with _lock:
        if not _is_initialized():
            return []
        rank = f"process {jax.process_index()}" + (f" of {jax.process_count()}" if jax.process_count() > 1 else "")
        _finish_pending()  # their errors are in the op log below (or are not ours)
        timeout_s = config().timeout_s
        deadline = time.monotonic() + timeout_s
        while _uccl_ep.ops_running() and time.monotonic() < deadline:  # one whose result nobody holds
            time.sleep(0.01)
        problems = []
        if getattr(_uccl_ep, "nvl_is_initialized", lambda: False)():
            try:
                _uccl_ep.nvl_check_errors()
            except Exception as e:  # noqa: BLE001 - an error nobody collected with check_errors()
                problems.append(f"a GPU kernel found an error that no check_errors() collected: {e}")
        unread = _uccl_ep.take_op_errors()
        if at_exit and unread:
            more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
            problems.append(
                f"an EP op failed and no check_errors() ran after it{more} (a result that was read raised this "
                f"already; one never read said nothing): {unread[0]}"
            )
        _uccl_ep.quiesce(min(timeout_s, 5.0))  # our last writes land before peers may close their endpoints
        client = _distributed_client()
        if client is not None and jax.process_count() > 1:
            # Every peer has finished its ops too before anyone frees what a peer may still write into.
            try:
                # One deadline for the whole shutdown: what the waits above took comes off the barrier's.
                left_ms = max(1000, int((deadline - time.monotonic()) * 1000))
                client.wait_at_barrier(f"jax_uccl_ep/{_generation}/shutdown", left_ms)
            except Exception as e:  # noqa: BLE001
                problems.append(
                    f"the other processes did not all reach shutdown within {timeout_s:g} s (UCCL_EP_TIMEOUT_S); "
                    f"one may have died or still be running ops: {str(e).strip()}"
                )
        for p in problems:
            print(f"jax_uccl_ep ({rank}): {p}", file=sys.stderr, flush=True)
        _uccl_ep.shutdown()
        if hasattr(_uccl_ep, "nvl_shutdown"):
            _uccl_ep.nvl_shutdown()
        _plan.set_current(None)
        return problems


def is_initialized() -> bool:
    """Whether the runtime is running in this process."""
    return _is_initialized()


def check_errors() -> None:
    """Raises an error a GPU kernel found earlier (bad expert index, capacity exceeded), if any.

    Kernels cannot fail the call that launched them, and an op must not fail on one rank only (its peers would
    wait for it), so GPU ops never raise these themselves: call this (it waits for the GPUs first) where a
    step's results are checked. This holds for GPU-initiated ops across nodes too. CPU devices (and host-staged
    ops) raise such errors from the op itself, where its result is read; calling this also marks those seen, so
    the shutdown at interpreter exit does not report them again as unread.
    """
    _uccl_ep.take_op_errors()
    # Under two-level routing both runtimes run: errors of either level are raised.
    if getattr(_uccl_ep, "nvl_is_initialized", lambda: False)():
        _uccl_ep.nvl_check_errors()
    if hasattr(_uccl_ep, "proxy_check_errors") and _uccl_ep.is_initialized():
        _uccl_ep.proxy_check_errors()


def nvl_buffer_bytes(
    num_tokens: int,
    hidden: int,
    *,
    num_ranks: int,
    topk: int,
    dtype: Any = "bfloat16",
    fp8: bool = False,
    with_weights: bool = True,
    combine_dtype: Any = "bfloat16",
) -> int:
    """Bytes of NVLink buffer per GPU that dispatch and combine need for these shapes (pass to initialize()).

    num_tokens: tokens per rank; hidden: channels; dtype: of x (ignored with fp8, whose rows are hidden bytes
    plus hidden/128 float32 scales).
    """
    import numpy as np

    x_row, scale_row = dispatch_row_bytes(hidden, fp8, dtype)
    combine_bf16 = np.dtype(combine_dtype) == np.dtype(jax.numpy.bfloat16)  # float16 rows travel as float32
    return int(
        _uccl_ep.nvl_bytes_needed(num_ranks, num_tokens, x_row, scale_row, topk, with_weights, hidden, combine_bf16)
    )


def low_latency_buffer_bytes(
    max_tokens_per_rank: int,
    hidden: int,
    *,
    num_ranks: int,
    num_experts: int,
    topk: int,
    fp8: bool = True,
    dispatch_dtype: Any = "bfloat16",
    combine_dtype: Any = "bfloat16",
) -> int:
    """Bytes of low-latency buffer per GPU that low_latency_dispatch/combine need for these shapes (pass to
    initialize(low_latency_buffer_bytes=...)). Two halves (consecutive ops alternate) of one region per sending
    rank, each large enough for a sender's worst case to one receiver: its max_tokens_per_rank token rows and
    max_tokens_per_rank * topk row-map entries (dispatch), or max_tokens_per_rank * topk combine rows.

    hidden: channels; fp8: dispatch rows are hidden bytes plus hidden/128 float32 scales (else dispatch_dtype).
    """
    import numpy as np

    for name, dtype in (("dispatch_dtype", dispatch_dtype), ("combine_dtype", combine_dtype)):
        if np.dtype(dtype) not in FLOAT_DTYPES:
            raise ValueError(
                f"jax_uccl_ep.low_latency_buffer_bytes: {name} must be float32 or bfloat16 (what low-latency ops "
                f"take), got {np.dtype(dtype).name}"
            )
    x_row, scale_row = dispatch_row_bytes(hidden, fp8, dispatch_dtype)
    combine_row = hidden * np.dtype(combine_dtype).itemsize
    return int(
        _uccl_ep.nvl_low_latency_bytes_needed(
            num_ranks, num_experts, max_tokens_per_rank, topk, x_row, scale_row, combine_row
        )
    )


def proxy_buffer_bytes(
    num_tokens: int,
    hidden: int,
    *,
    num_ranks: int,
    topk: int,
    dtype: Any = "bfloat16",
    fp8: bool = False,
    with_weights: bool = True,
    combine_dtype: Any = "bfloat16",
    backward: bool = True,
    ranks_per_node: int | None = None,
    ep_ranks: int | None = None,
    low_latency_max_tokens: int = 0,
    num_experts: int = 0,
    low_latency_fp8: bool = True,
    platform: Literal["cpu", "gpu"],
    config: Config | None = None,
) -> int:
    """Bytes of the proxy runtime's registered buffer per device (pass to ``initialize(proxy_buffer_bytes=...)``,
    or set ``Config.buffer_bytes`` / ``UCCL_EP_BUFFER_BYTES``; ``initialize(shapes=...)`` applies it itself) that a
    job's ops need whatever the routing of their tokens: every op on CPU devices, and GPUs' ops across nodes
    (GPU-initiated or staged through the host). With it no op stops to advise a larger buffer. A region of the
    buffer holds a message to one peer, and every token of a rank may go to one peer, so jobs with many tokens or
    wide rows need far more than the default.

    Normal mode: num_tokens tokens per rank (0: no normal-mode ops) of `hidden` channels; topk expert slots per
    token; dtype: of x (with fp8, the dtype x is cast from: the dispatched rows are then hidden bytes plus
    hidden/128 float32 scales); with_weights: dispatch carries the router weights; combine_dtype: of combine's rows
    (float16 travels as float32); backward: the job takes gradients, whose passes move rows of x's dtype and of
    combine's (False: forward only, as an inference server).
    Low-latency mode: low_latency_max_tokens, its max_tokens_per_rank (0: no low-latency ops), with num_experts
    experts (its regions count rows per local expert), the same hidden and topk; low_latency_fp8: its dispatch
    sends FP8 rows (low_latency_dispatch's default), else rows of dtype; its combine's rows are of combine_dtype
    (low-latency ops take float32 and bfloat16: a float16 dtype is sized as float32 there).
    The job: num_ranks ranks; ranks_per_node on each node where it spans several (default:
    ``config.gpus_per_node``, else one node: give it for jobs on several hosts); ep_ranks: the EP axis's ranks
    (default: every rank; with data parallelism across EP groups, a group's); platform: the devices', "cpu" or
    "gpu" (given, not asked of JAX: a job sizes its buffer before initialize(), and asking would start JAX's
    backend too early for jax.distributed); config: the settings that choose how normal mode crosses nodes
    (gpus_per_node, hierarchical, two_level, gpu_initiated; default: the environment's), as initialize() would.
    """
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"jax_uccl_ep.proxy_buffer_bytes: platform must be 'cpu' or 'gpu', got {platform!r}")
    config = Config.from_env(config)
    per_node = min(ranks_per_node or config.gpus_per_node or num_ranks, num_ranks)
    shapes = JobShapes(
        num_tokens,
        hidden,
        topk,
        num_experts=num_experts,
        dtype=dtype,
        fp8=fp8,
        with_weights=with_weights,
        combine_dtype=combine_dtype,
        backward=backward,
        low_latency_max_tokens=low_latency_max_tokens,
        low_latency_fp8=low_latency_fp8,
        ep_ranks=ep_ranks,
    )
    return _proxy_bytes(shapes, num_ranks, per_node, platform, config, list(range(num_ranks)))


def _proxy_bytes(
    s: JobShapes, num_ranks: int, per_node: int, platform: str, config: Config, process_of_rank: list[int]
) -> int:
    """proxy_buffer_bytes for `s` on a job of num_ranks ranks, per_node a node, process_of_rank[r] driving rank r:
    the routing of an EP group's normal-mode ops as initialize() and the plan would choose it."""
    import numpy as np

    group = s.ep_ranks or num_ranks
    if num_ranks % per_node or num_ranks % group:
        raise ValueError(
            f"jax_uccl_ep.proxy_buffer_bytes: {num_ranks} ranks do not fill nodes of {per_node} or EP groups of {group}"
        )
    nodes = num_ranks // per_node
    routing, group_nodes = 0, 1  # NodeRouting: flat
    if nodes > 1:
        topo = Topology.build(process_of_rank, [], per_node)
        # Hierarchical rounds run on the host paths: CPU devices, and GPUs whose ops cannot be GPU-initiated
        # (kernels/nvl: groups of at most 8 ranks, pinned memory); a group spans at most nodes, 2 ranks a node.
        staged = platform == "cpu" or group > 8 or not (config.gpu_initiated and config.pinned)
        group_nodes = nodes if group == num_ranks else min(nodes, group // 2)
        if group == num_ranks and _plan_two_level(config, topo, platform, process_of_rank) is not None:
            routing = 2
        elif config.hierarchical and staged and per_node > 1 and group_nodes > 1:
            routing = 1
    x_row, scale_row = dispatch_row_bytes(s.hidden, s.fp8, s.dtype)
    ll_dtype, ll_combine_dtype = s.low_latency_dtypes()
    ll_x_row, ll_scale_row = dispatch_row_bytes(s.hidden, s.low_latency_fp8, ll_dtype)
    return int(
        _uccl_ep.proxy_bytes_needed(
            num_ranks,
            group,
            routing,
            per_node,
            group_nodes,
            platform == "gpu",
            s.num_tokens,
            s.hidden,
            x_row,
            scale_row,
            s.topk,
            s.with_weights,
            s.combine_rows_bf16(),
            s.low_latency_max_tokens,
            s.num_experts,
            ll_x_row,
            ll_scale_row,
            np.dtype(ll_combine_dtype) == np.dtype(jax.numpy.bfloat16),  # low latency's combine: no backward
        )
    )


def buffer_bytes_held() -> dict[int, tuple[int, int]]:
    """GPUs: {cuda ordinal index: (normal-mode bytes, low-latency bytes)} this process holds per local GPU."""
    if not getattr(_uccl_ep, "nvl_is_initialized", lambda: False)():
        return {}
    return {i: (int(normal), int(low)) for i, (normal, low) in enumerate(_uccl_ep.nvl_buffer_bytes_held())}


def local_ranks() -> list[int]:
    """Global ranks (indices into jax.devices() sorted by id) of this process's devices."""
    rank_of = _ffi.global_ranks()
    return sorted(rank_of[d.id] for d in jax.local_devices())


try:  # the environment's settings until initialize() brings the caller's (a bad variable raises there)
    configure_native(Config.from_env())
except ValueError:
    pass
