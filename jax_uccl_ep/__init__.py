"""jax_uccl_ep: expert-parallel dispatch and combine for Mixture-of-Experts models in JAX.

Call ``initialize()`` once per process, then use the ops inside ``jax.shard_map`` over the EP mesh axis.
"""
from .fp8 import per_token_cast_back, per_token_cast_to_fp8
from ._runtime import check_errors, initialize, is_initialized, nvl_buffer_bytes, shutdown
from .normal import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    combine,
    dispatch,
    get_dispatch_layout,
)

__all__ = [
    "initialize",
    "shutdown",
    "is_initialized",
    "check_errors",
    "nvl_buffer_bytes",
    "get_dispatch_layout",
    "dispatch",
    "combine",
    "DispatchLayout",
    "DispatchHandle",
    "DispatchResult",
    "per_token_cast_to_fp8",
    "per_token_cast_back",
]
__version__ = "0.1.0"
