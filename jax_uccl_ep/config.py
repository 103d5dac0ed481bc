"""Every setting of the library in one place: a typed ``Config``, whose fields environment variables override, and
the variables launchers set for jax.distributed (``distributed_env``, ``cluster_launcher``). Apart from the
launcher (launch.py, which builds its children's environment from its own), nothing else in the library reads
the environment.

``initialize(config=Config(...))`` takes one; environment variables that are set override its fields (so a job
script can change a setting without editing code). ``initialize()`` hands the result to the C++ side, which reads
no environment itself; importing the package hands it the environment's settings first. Each field names its
variable in its metadata; the README's table lists the same variables (a test checks that they agree). Test modes
(writes out of order, poisoned outputs, stuck proxies) are no settings: only the tests' extension sets them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Config", "cluster_launcher", "distributed_env"]


def _env(name: str, doc: str) -> dict[str, str]:
    return {"env": name, "doc": doc}


@dataclass(frozen=True)
class Config:
    """The library's settings. Field defaults are the library's defaults; units are in the names."""

    # Deadlines.
    timeout_s: float = field(
        default=120.0, metadata=_env("UCCL_EP_TIMEOUT_S", "deadline of every wait on a peer, in seconds")
    )
    # The proxy runtime (CPU devices; GPUs on several nodes).
    fi_provider: str | None = field(
        default=None,
        metadata=_env(
            "UCCL_EP_FI_PROVIDER",
            "libfabric providers to try, in order (default: shm,tcp;ofi_rxm on one host, "
            "efa,verbs;ofi_rxm,tcp;ofi_rxm across hosts)",
        ),
    )
    num_proxy_threads: int = field(
        default=1, metadata=_env("UCCL_EP_NUM_PROXY_THREADS", "proxy threads (channels) per device")
    )
    buffer_bytes: int = field(
        default=64 << 20, metadata=_env("UCCL_EP_BUFFER_BYTES", "registered proxy buffer per device, in bytes")
    )
    max_inflight_writes: int = field(
        default=256, metadata=_env("UCCL_EP_MAX_INFLIGHT_WRITES", "posted, uncompleted writes per proxy thread")
    )
    max_inflight_bytes: int = field(
        default=0, metadata=_env("UCCL_EP_MAX_INFLIGHT_BYTES", "posted, uncompleted bytes per proxy thread (0: any)")
    )
    max_write_bytes: int = field(
        default=1 << 20, metadata=_env("UCCL_EP_MAX_WRITE_BYTES", "largest single RDMA write, in bytes")
    )
    proxy_park_after_ms: float = field(
        default=5.0,
        metadata=_env(
            "UCCL_EP_PROXY_PARK_AFTER_MS",
            "CPU devices: a proxy thread idle this many ms sleeps until an op needs it (0: it always polls)",
        ),
    )
    gpus_per_node: int | None = field(
        default=None, metadata=_env("UCCL_EP_GPUS_PER_NODE", "ranks per node (default: from host names)")
    )
    hierarchical: bool = field(
        default=True,
        metadata=_env("UCCL_EP_HIERARCHICAL", "proxy runtime across equal nodes: a token crosses to a node once"),
    )
    two_level: str = field(
        default="auto",
        metadata=_env("UCCL_EP_TWO_LEVEL", "normal mode across nodes as two level ops: auto, 1 or 0"),
    )
    gpu_initiated: bool = field(
        default=True, metadata=_env("UCCL_EP_GPU_INITIATED", "GPUs across nodes: kernels push the proxies' commands")
    )
    pinned: bool = field(
        default=True,
        metadata=_env("UCCL_EP_PINNED", "proxy runtime on a GPU machine: rings and buffers in pinned, mapped memory"),
    )
    # GPUs over NVLink.
    nvl_buffer_bytes: int = field(
        default=1 << 30, metadata=_env("UCCL_EP_NVL_BUFFER_BYTES", "normal mode's NVLink buffer per GPU, in bytes")
    )
    ll_buffer_bytes: int = field(
        default=256 << 20, metadata=_env("UCCL_EP_LL_BUFFER_BYTES", "low-latency buffer per GPU, in bytes (0: none)")
    )
    num_sms: int = field(
        default=24, metadata=_env("UCCL_EP_NUM_SMS", "normal mode's SM budget (send and receive blocks together)")
    )
    num_send_sms: int = field(
        default=0,
        metadata=_env(
            "UCCL_EP_NUM_SEND_SMS",
            "send blocks of that budget (0: a half with bulk copies, else a third; the rest receive)",
        ),
    )
    nvl_bulk: bool = field(
        default=True, metadata=_env("UCCL_EP_NVL_BULK", "normal mode moves rows by bulk copies (TMA), else SM stores")
    )
    nvl_pull_combine: bool = field(
        default=True,
        metadata=_env(
            "UCCL_EP_NVL_PULL_COMBINE",
            "normal-mode combine among GPUs one process drives reads each member's rows where they are (one copy, "
            "every block reducing) instead of the members sending them; groups with a GPU of another process send",
        ),
    )
    nvl_pull_dispatch: bool = field(
        default=True,
        metadata=_env(
            "UCCL_EP_NVL_PULL_DISPATCH",
            "normal-mode dispatch among GPUs one process drives reads each member's rows and routing where they are "
            "(one copy, every block receiving) instead of the members sending them; groups with a GPU of another "
            "process send",
        ),
    )
    nvl_dispatch_pairs: bool = field(
        default=True,
        metadata=_env(
            "UCCL_EP_NVL_DISPATCH_PAIRS",
            "dispatch(layout='expert') over NVLink with bulk copies writes each row straight into its pair slots, "
            "instead of token rows and then the pair layout in XLA",
        ),
    )
    proxy_dispatch_pairs: bool = field(
        default=True,
        metadata=_env(
            "UCCL_EP_PROXY_DISPATCH_PAIRS",
            "dispatch(layout='expert') over the GPU-initiated proxy (flat) copies each received row straight into "
            "its pair slots, instead of token rows and then the pair layout in XLA",
        ),
    )
    ll_num_sms: int = field(
        default=32, metadata=_env("UCCL_EP_LL_NUM_SMS", "blocks of the split low-latency receive kernels")
    )
    ll_fused: bool = field(
        default=True, metadata=_env("UCCL_EP_LL_FUSED", "a low-latency op's send and receive as one kernel")
    )
    kernel_timing: int = field(
        default=0,
        metadata=_env("UCCL_EP_KERNEL_TIMING", "1: CUDA events around each GPU op; 2: also low-latency phases"),
    )
    exit_on_unread_errors: bool = field(
        default=False,
        metadata=_env(
            "UCCL_EP_EXIT_ON_UNREAD_ERRORS",
            "at interpreter exit, a failed computation whose result nobody read makes the process exit with status 1",
        ),
    )

    def __post_init__(self) -> None:
        problems = []
        for name in (
            "num_proxy_threads",
            "buffer_bytes",
            "max_inflight_writes",
            "max_write_bytes",
            "num_sms",
            "ll_num_sms",
            "nvl_buffer_bytes",
        ):
            if getattr(self, name) <= 0:
                problems.append(f"{name} ({self.env_name(name)}) must be positive, got {getattr(self, name)}")
        for name in ("max_inflight_bytes", "ll_buffer_bytes", "kernel_timing", "num_send_sms", "proxy_park_after_ms"):
            if getattr(self, name) < 0:
                problems.append(f"{name} ({self.env_name(name)}) must not be negative, got {getattr(self, name)}")
        if self.timeout_s <= 0:
            problems.append(f"timeout_s (UCCL_EP_TIMEOUT_S) must be positive, got {self.timeout_s}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            problems.append(
                f"gpus_per_node (UCCL_EP_GPUS_PER_NODE) must be a positive integer, got {self.gpus_per_node}"
            )
        if self.two_level not in ("auto", "1", "0"):
            problems.append(f"two_level (UCCL_EP_TWO_LEVEL) must be auto, 1 or 0, got {self.two_level!r}")
        if problems:
            raise ValueError("jax_uccl_ep.Config: " + "; ".join(problems))

    @staticmethod
    def env_name(name: str) -> str:
        """The environment variable that overrides field `name`."""
        return _FIELDS[name].metadata["env"]

    @classmethod
    def env_names(cls) -> dict[str, str]:
        """{environment variable: field name} of every field."""
        return {f.metadata["env"]: f.name for f in _FIELDS.values()}

    @classmethod
    def set_in_env(cls, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """{field name: its variable's value} of every field whose variable is set (non-empty) in `environ`
        (default: os.environ)."""
        environ = os.environ if environ is None else environ
        raw = {f.name: environ.get(f.metadata["env"], "").strip() for f in _FIELDS.values()}
        return {name: value for name, value in raw.items() if value}

    @classmethod
    def from_env(cls, base: Config | None = None, environ: Mapping[str, str] | None = None) -> Config:
        """`base` (default: the defaults) with every field whose variable is set (non-empty) in `environ`
        (default: os.environ) taken from it. Raises ValueError naming a variable that does not parse."""
        values: dict[str, Any] = {}
        for name, raw in cls.set_in_env(environ).items():
            f = _FIELDS[name]
            try:
                values[f.name] = _parse(f, raw)
            except ValueError:
                raise ValueError(f"jax_uccl_ep: {f.metadata['env']}={raw!r} is not a valid {_kind(f)}") from None
        return dataclasses.replace(base or cls(), **values)

    def shared(self) -> dict[str, str]:
        """The settings every process of a job must share, by variable name (initialize() compares them): peers
        compute where their messages land, their shapes and routes from their own settings."""
        local_only = (
            "timeout_s",
            "fi_provider",
            "kernel_timing",
            "ll_fused",
            "ll_num_sms",
            "max_inflight_writes",
            "max_inflight_bytes",
            "max_write_bytes",
            "exit_on_unread_errors",
        )
        return {f.metadata["env"]: str(getattr(self, f.name)) for f in _FIELDS.values() if f.name not in local_only}


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _kind(f: dataclasses.Field) -> str:
    t = str(f.type)
    return "boolean (0 or 1)" if "bool" in t else "integer" if "int" in t else "number" if "float" in t else "value"


def _parse(f: dataclasses.Field, raw: str) -> Any:
    t = str(f.type)
    if "bool" in t:
        return raw.lower() not in ("0", "false", "no", "off")
    if "int" in t:
        return int(raw, 0)
    if "float" in t:
        return float(raw)
    return raw.lower() if f.name == "two_level" else raw


def distributed_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """jax.distributed.initialize's arguments from what `python -m jax_uccl_ep.launch` (or another launcher) puts in
    the environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, JAX_LOCAL_DEVICE_IDS. Empty when no
    coordinator is named."""
    env = os.environ if environ is None else environ
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


def cluster_launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """The cluster launcher that started this process as one of several ("Slurm", "Open MPI"), whose environment
    jax.distributed.initialize() reads on its own; None for a single process or another launcher."""
    env = os.environ if environ is None else environ

    def several(name: str) -> bool:
        try:
            return int(env.get(name, "1")) > 1
        except ValueError:
            return False

    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID") is not None and several("SLURM_NTASKS"):
        return "Slurm"
    if several("OMPI_COMM_WORLD_SIZE"):
        return "Open MPI"
    return None
