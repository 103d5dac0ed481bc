"""Registration of the XLA FFI targets (lowering lives with the ops that call them)."""
from __future__ import annotations

import jax

from . import _uccl_ep

_registered = False


def register() -> None:
    """Registers every FFI target of the extension with XLA, once per process."""
    global _registered
    if _registered:
        return
    for name, capsule in _uccl_ep.cpu_registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    _registered = True
