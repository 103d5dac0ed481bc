import glob
import os
import sys

# `python -m pytest` puts the repository root on sys.path, where jax_uccl_ep has no compiled extension;
# test the installed package instead.
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not glob.glob(os.path.join(_root, "jax_uccl_ep", "_uccl_ep*")):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _root]

# In-process tests use 4 CPU devices; this must be set before jax starts its CPU backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")
os.environ.setdefault("UCCL_EP_TIMEOUT_S", "60")
os.environ.setdefault("UCCL_EP_POISON", "1")
