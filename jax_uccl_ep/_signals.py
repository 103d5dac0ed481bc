"""The process's signal handlers, kept as they were around the native code that loads and starts libfabric.

Loading libfabric loads its PSM providers' libraries (Debian's libfabric links libpsm_infinipath, whose
libinfinipath installs handlers for SIGINT, SIGTERM, SIGABRT, SIGSEGV, SIGBUS and SIGILL when it loads), and
starting a fabric installs more. Those handlers call exit() from inside the signal: Ctrl-C stopped raising
KeyboardInterrupt, and an abort (XLA's stuck-collective check, say) ran the exit handlers from a signal handler
in every aborting thread at once, which deadlocks on glibc's exit lock: the process hung instead of ending.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
from collections.abc import Iterator

# The signals those libraries take over; the rest stay untouched.
KEPT_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGABRT,
    signal.SIGSEGV,
    signal.SIGBUS,
    signal.SIGILL,
    signal.SIGFPE,
    signal.SIGHUP,
    signal.SIGQUIT,
)
_SIGACTION_BYTES = 512  # more than any libc's struct sigaction: the bytes are saved and given back as they are

_libc = ctypes.CDLL(None, use_errno=True)
_libc.sigaction.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


def _sigaction(sig: int, new: ctypes.Array | None, old: ctypes.Array | None) -> None:
    if _libc.sigaction(int(sig), new, old) != 0:
        raise OSError(ctypes.get_errno(), f"jax_uccl_ep: sigaction({int(sig)}) failed")


@contextlib.contextmanager
def kept_signal_handlers() -> Iterator[None]:
    """Runs the body, then gives every signal of KEPT_SIGNALS back the handler (and flags and mask) it had before,
    whatever the body's native code installed."""
    saved = []
    for sig in KEPT_SIGNALS:
        action = ctypes.create_string_buffer(_SIGACTION_BYTES)
        _sigaction(sig, None, action)
        saved.append((sig, action))
    try:
        yield
    finally:
        for sig, action in saved:
            _sigaction(sig, action, None)
