import os

# In-process tests use 4 CPU devices; this must be set before jax starts its CPU backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")
os.environ.setdefault("UCCL_EP_TIMEOUT_S", "60")
os.environ.setdefault("UCCL_EP_POISON", "1")

# The test modes for this process's runtimes (the children of spawn.py set theirs the same way).
import spawn

spawn.set_test_modes()


def pytest_sessionfinish(session, exitstatus):
    """The tests provoke op errors on purpose and read them: mark them seen, so the runtime's shutdown at exit does
    not print them again as errors nobody read."""
    import sys

    ep = sys.modules.get("jax_uccl_ep")
    if ep is not None and ep.is_initialized():
        try:
            ep.check_errors()
        except Exception:  # noqa: BLE001 - a GPU error left over: the tests that care have checked already
            pass
