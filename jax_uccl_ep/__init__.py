"""jax_uccl_ep: expert-parallel dispatch and combine for Mixture-of-Experts models in JAX.

Call ``initialize()`` once per process, then use the ops inside ``jax.shard_map`` over the EP mesh axis.
"""

import importlib.machinery as _machinery
import os as _os
import sys as _sys


def _has_extension(folder: str) -> bool:
    """Whether `folder` holds the compiled extension (not just its type stub, _uccl_ep.pyi)."""
    return any(_os.path.exists(_os.path.join(folder, "_uccl_ep" + s)) for s in _machinery.EXTENSION_SUFFIXES)


def _find_extension() -> None:
    """Imported from a source checkout (``python -m jax_uccl_ep.launch`` in the repository root, say), this
    package has no compiled extension: use the one ``pip install .`` put in site-packages."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    if _has_extension(here):
        return
    for entry in _sys.path:
        candidate = _os.path.join(_os.path.abspath(entry or "."), "jax_uccl_ep")
        if candidate != here and _has_extension(candidate):
            __path__.append(candidate)
            return
    raise ImportError(
        f"jax_uccl_ep's compiled extension is missing (importing the sources at {here}): "
        "install the package first (pip install .), or build in place (pip install -e . -Ceditable.mode=inplace)"
    )


_find_extension()
# CUDA loads kernels lazily by default, at first launch, and a load can wait for the GPU to go idle while a stream
# waits for a peer; with one process driving several GPUs that can deadlock. Load eagerly (read when CUDA starts,
# so this takes effect if jax_uccl_ep is imported before JAX first touches a GPU).
_os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
from ._signals import kept_signal_handlers as _kept_signal_handlers

with _kept_signal_handlers():  # the extension loads libfabric, whose providers take over signals as they load
    from . import _uccl_ep  # noqa: F401
from . import layers
from ._runtime import (
    JobShapes,
    Topology,
    TwoLevel,
    buffer_bytes_held,
    check_errors,
    config,
    initialize,
    is_initialized,
    low_latency_buffer_bytes,
    nvl_buffer_bytes,
    proxy_buffer_bytes,
    shutdown,
    topology,
    two_level,
)
from .config import Config
from .fp8 import pack_ue8m0, per_token_cast_back, per_token_cast_to_fp8, unpack_ue8m0
from .low_latency import (
    LowLatencyHandle,
    LowLatencyPending,
    low_latency_combine,
    low_latency_combine_recv,
    low_latency_combine_send,
    low_latency_dispatch,
    low_latency_dispatch_recv,
    low_latency_dispatch_send,
)
from .normal import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    ExpertDispatchResult,
    ExpertHandle,
    TwoLevelHandle,
    combine,
    dispatch,
    get_dispatch_layout,
)

__all__ = [
    "layers",
    "Config",
    "config",
    "initialize",
    "JobShapes",
    "shutdown",
    "is_initialized",
    "check_errors",
    "nvl_buffer_bytes",
    "low_latency_buffer_bytes",
    "proxy_buffer_bytes",
    "buffer_bytes_held",
    "topology",
    "Topology",
    "two_level",
    "TwoLevel",
    "TwoLevelHandle",
    "get_dispatch_layout",
    "dispatch",
    "combine",
    "DispatchLayout",
    "DispatchHandle",
    "DispatchResult",
    "ExpertDispatchResult",
    "ExpertHandle",
    "per_token_cast_to_fp8",
    "per_token_cast_back",
    "pack_ue8m0",
    "unpack_ue8m0",
    "low_latency_dispatch",
    "low_latency_combine",
    "LowLatencyHandle",
    "LowLatencyPending",
    "low_latency_dispatch_send",
    "low_latency_dispatch_recv",
    "low_latency_combine_send",
    "low_latency_combine_recv",
]
__version__ = "0.1.0"
