import os

# In-process tests use 4 CPU devices; this must be set before jax starts its CPU backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")
os.environ.setdefault("UCCL_EP_TIMEOUT_S", "60")
os.environ.setdefault("UCCL_EP_POISON", "1")
