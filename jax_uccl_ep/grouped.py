"""Grouped matmuls for the MoE layer's experts, at a cost that follows the rows really there.

``grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G])`` multiplies the first ``group_sizes[0]`` rows of
``lhs`` by ``rhs[0]``, the next ``group_sizes[1]`` by ``rhs[1]``, and so on (``jax.lax.ragged_dot``'s contract);
rows past ``sum(group_sizes)`` come out as zeros. Two backends, chosen once by ``grouped_backend``:

* ``"mosaic"``: Pallas Mosaic GPU kernels for Hopper (compute capability 9.x), bf16/f16: tokamax's ragged dot for
  the forward pass and the rows' gradient, JAX's own ``transposed_ragged_dot_mgpu`` for the weights' gradient. Both
  skip the tiles past the groups, so a layer's worst-case buffer costs what its real rows cost. Without tokamax the
  forward pass and the rows' gradient run JAX's own ``ragged_dot_mgpu``, which also computes the tiles past the
  groups (and stores nothing there): a worst-case buffer then costs its whole size, once, where XLA's ragged_dot
  costs G times that and its memory. They run under a VJP of ours: inside ``jax.shard_map`` their outputs carry no
  varying manual axes, which JAX refuses for a cotangent, and the rows past the groups are left unwritten, which
  would turn into NaNs upstream.
* ``"xla"``: ``jax.lax.ragged_dot``: CPU devices, float32 and other GPUs. On GPUs XLA lowers it to one dense matmul
  per group over a masked copy of ``lhs`` (G times the work).

tokamax is an optional dependency (``pip install 'jax_uccl_ep[gpu]'``), imported only where it can run.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from . import _runtime
from ._ffi import like_primal, varying_like

__all__ = ["GroupedBackend", "grouped_backend", "grouped_matmul"]

GroupedBackend = Literal["auto", "mosaic", "xla"]

_FAST_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.cache
def _tokamax() -> Any:
    """The tokamax module, or None where it is not installed or cannot import (its own dependencies)."""
    try:
        import tokamax
    except Exception:  # noqa: BLE001 - any failure to import means the XLA path
        return None
    return tokamax


@functools.cache
def _jax_kernels_missing() -> str | None:
    """Why JAX's own Mosaic GPU kernels (the weights' gradient; the forward products without tokamax) cannot
    import, or None. Their modules import JAX's test utilities, which need absl-py."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import means the XLA path
        return f"JAX's Mosaic GPU kernels cannot import ({type(e).__name__}: {e})"
    return None


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _hopper() -> bool:
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None:
        return False
    try:
        return 9.0 <= float(capability) < 10.0
    except (TypeError, ValueError):
        return False


def grouped_backend(requested: GroupedBackend, dtype: Any, *, warn: bool = True) -> Literal["mosaic", "xla"]:
    """The backend ``grouped_matmul`` uses for operands of `dtype`. ``"auto"`` takes the Mosaic kernels on Hopper
    GPUs with bf16/f16 operands, and (with `warn`) says once why not when a GPU run falls back to XLA's ragged_dot,
    or that tokamax's faster forward kernel is missing; ``"mosaic"`` refuses to fall back. Callers whose fallback is
    not ragged_dot pass ``warn=False``."""
    if requested not in ("auto", "mosaic", "xla"):
        raise ValueError(f"jax_uccl_ep: grouped_matmul backend must be 'auto', 'mosaic' or 'xla', got {requested!r}")
    if requested == "xla":
        return "xla"
    on_gpu = jax.default_backend() == "gpu"
    reason = None
    if not on_gpu:
        reason = f"the default backend is {jax.default_backend()!r}, not a GPU"
    elif not _hopper():
        reason = "the GPU is not a Hopper (compute capability 9.x), which the kernels are written for"
    elif jnp.dtype(dtype) not in _FAST_DTYPES:
        reason = (
            f"the experts compute in {jnp.dtype(dtype).name} (the kernels take bfloat16 or float16); "
            "MoEConfig(compute_dtype=jnp.bfloat16) uses them"
        )
    else:
        reason = _jax_kernels_missing()
    if reason is None:
        if _tokamax() is None and warn:
            _warn_once(
                "jax_uccl_ep: tokamax is not installed, so the experts' grouped matmuls run JAX's own Mosaic kernel, "
                "which computes every row tile of the pair buffer rather than only the groups' (pip install "
                "'jax_uccl_ep[gpu]' for tokamax's)"
            )
        return "mosaic"
    if requested == "mosaic":
        raise ValueError(f"jax_uccl_ep: grouped_matmul backend 'mosaic' cannot run here: {reason}")
    if on_gpu and warn:
        _warn_once(
            "jax_uccl_ep: the experts' grouped matmuls run through jax.lax.ragged_dot, which XLA lowers on GPUs to "
            f"one dense matmul per local expert (that many times the useful work), because {reason}"
        )
    return "xla"


def _rows_in_groups(out: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`out` with the rows past the groups set to zero (the kernels leave them unwritten)."""
    rows = jnp.arange(out.shape[0], dtype=jnp.int32)
    return jnp.where((rows < jnp.sum(group_sizes))[:, None], out, jnp.zeros((), out.dtype))


@functools.cache
def _row_kernel() -> Any:
    """tokamax's Hopper kernel with 128 x 128 tiles, 4 stages, persistent: 0.25 ms against its default's 0.47 on
    H200 for the layer's [131072 slots, 2048] x [16, 2048, 1024] (86% of a dense matmul of the same useful work).
    Its configuration lives in tokamax's private modules: where they moved, its default configuration."""
    try:
        from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as kernel
        from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as common

        config = common.Config(
            block_m=128,
            block_n=128,
            block_k=64,
            num_stages=4,
            split_k=1,
            persistent=True,
            grid_minor_dim=common.MatmulDimension.M,
            grid_tile_width=1,
        )
        return (kernel.PallasMosaicGpuRaggedDot(config=config),)
    except Exception:  # noqa: BLE001 - tokamax's internals changed: its own choice
        return "mosaic"


def _import_kernels() -> None:
    """Imports the Mosaic kernels' modules on GPUs before the first trace. Importing them registers JAX config
    options, and options that appear during a jit's first trace change its cache key: the training step traced
    and compiled twice (steps 1 and 2: 60 s and 46 s on an H100)."""
    if jax.default_backend() != "gpu" or not _hopper():
        return
    if _tokamax() is not None:
        _row_kernel()
    _jax_kernels_missing()


_runtime.after_initialize(_import_kernels)


# The kernels' calls are jitted on their own so that identical calls (the same shapes in every layer of a model,
# forward and backward) trace and lower their Pallas kernels once per program rather than once per call site.
@functools.partial(jax.jit, static_argnums=(3, 4))
def _tokamax_dot(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype: Any, zero_padding: bool
) -> jax.Array:
    """lhs [M, K] x rhs [G, K, N] by groups of rows, forward only; the rows past the groups zeros, or without
    `zero_padding` as the kernel leaves them (it writes only the groups' rows)."""
    out = _tokamax().ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype, implementation=_row_kernel())
    return _rows_in_groups(out, group_sizes) if zero_padding else out


# JAX's row kernel's tiles (rows, columns, contraction), as its weight-gradient kernel's below.
_JAX_ROW_TILES = (128, 128, 64)


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _jax_dot(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype: Any, zero_padding: bool, transpose_rhs: bool
) -> jax.Array:
    """lhs [M, K] x rhs [G, K, N] (or rhs [G, N, K] with `transpose_rhs`) by groups of rows, forward only, by JAX's
    own Mosaic kernel (tokamax absent); XLA's ragged_dot where the contraction is not a multiple of its tile or the
    columns of theirs. The rows past the groups as _tokamax_dot leaves them."""
    block_m, block_n, block_k = _JAX_ROW_TILES
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if lhs.shape[1] % block_k or n % block_n:
        _warn_once(
            f"jax_uccl_ep: a grouped matmul of [{lhs.shape[0]}, {lhs.shape[1]}] rows into {n} columns runs through "
            f"jax.lax.ragged_dot (one dense matmul per group): JAX's kernel takes a contraction that is a multiple "
            f"of {block_k} and columns a multiple of {block_n}; tokamax's takes any (pip install 'jax_uccl_ep[gpu]')"
        )
        rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
        out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    else:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        out = ragged_dot_mgpu.ragged_dot(
            lhs,
            rhs,
            group_sizes=group_sizes,
            block_m=block_m,
            block_n=block_n,
            block_k=block_k,
            max_concurrent_steps=4,
            grid_block_n=4 if n % (4 * block_n) == 0 else 1,
            transpose_rhs=transpose_rhs,
        )
    out = out.astype(out_dtype)
    return _rows_in_groups(out, group_sizes) if zero_padding else out


def _row_dot(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype: Any, zero_padding: bool, transpose_rhs: bool
) -> jax.Array:
    """The Mosaic backend's forward products: tokamax's kernel where it is installed, else JAX's own."""
    if _tokamax() is None:
        return _jax_dot(lhs, rhs, group_sizes, out_dtype, zero_padding, transpose_rhs)
    rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    return _tokamax_dot(lhs, rhs, group_sizes, out_dtype, zero_padding)


def _tile(size: int) -> int | None:
    """The weight-gradient kernel's tile along a dimension of `size` (it needs a multiple), or None."""
    return next((t for t in (128, 64) if size % t == 0), None)


# The weight-gradient kernel reads rows in blocks of this many, at multiples of it (its `block_k`).
_WEIGHT_GRAD_ROW_BLOCK = 64


def _weight_grad_by_blocks(
    kernel: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    block: int,
) -> jax.Array:
    """[G, K, N] of group g's rows of lhs [M, K] transposed times its rows of dout [M, N], from `kernel(lhs, dout,
    sizes)`: a weight-gradient kernel that reads rows in aligned blocks of `block` and masks the rows outside a group
    by multiplying by zero (so a NaN or Inf there, a buffer's unwritten padding, stays in the sum).

    Where M is a multiple of `block`, the rows after the groups up to the next block boundary (fewer than `block`)
    are set to zero in lhs and dout, which XLA does in place where the buffers have no later reader (the callers
    order their other reads first), and the kernel gets the groups whole. Otherwise the kernel gets the groups cut at
    the last multiple of `block` before their end and the rows after the cut (which may belong to several groups)
    are summed from one window by a matmul over every group, whose [G, K, N] result and its addition cost a pass
    over the gradient (on an H200 ~1.5 ms of the fine model's 39 ms step). A loop over the tail's groups would stop
    the host at every step (XLA reads a while loop's predicate back)."""
    m, g = lhs.shape[0], group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    total = ends[-1]
    if m % block == 0:
        start = jnp.clip(total // block * block, 0, m - block)
        in_groups = (start + jnp.arange(block, dtype=ends.dtype) < total)[:, None]

        def zero_after_groups(buf: jax.Array) -> jax.Array:
            window = jax.lax.dynamic_slice_in_dim(buf, start, block, 0)
            window = jnp.where(in_groups, window, jnp.zeros((), buf.dtype))
            return jax.lax.dynamic_update_slice_in_dim(buf, window, start, 0)

        out = varying_like(kernel(zero_after_groups(lhs), zero_after_groups(dout), group_sizes), lhs, dout, group_sizes)
        return jnp.where((group_sizes > 0)[:, None, None], out, jnp.zeros((), out.dtype))  # it skips empty groups
    cut = total // block * block
    cut_sizes = jnp.diff(jnp.minimum(ends, cut), prepend=0)
    out = varying_like(kernel(lhs, dout, cut_sizes), lhs, dout, group_sizes)
    out = jnp.where((cut_sizes > 0)[:, None, None], out, jnp.zeros((), out.dtype))
    rows = min(block, m)
    start = jnp.clip(cut, 0, m - rows)
    row = start + jnp.arange(rows, dtype=ends.dtype)
    in_tail = ((row >= cut) & (row < total))[:, None]
    x = jnp.where(in_tail, jax.lax.dynamic_slice_in_dim(lhs, start, rows, 0), jnp.zeros((), lhs.dtype))
    dy = jnp.where(in_tail, jax.lax.dynamic_slice_in_dim(dout, start, rows, 0), jnp.zeros((), dout.dtype))
    owner = jnp.searchsorted(ends, row, side="right")[None, :] == jnp.arange(g, dtype=ends.dtype)[:, None]  # [G, r]
    x_by_group = jnp.where(owner[:, :, None], x[None], jnp.zeros((), x.dtype))  # [G, rows, K]
    # Added in the kernel's dtype (the tail's groups round twice, within one unit of the output's precision): a
    # float32 sum would write and read the [G, K, N] gradient twice as wide.
    return out + jnp.einsum("grk,rn->gkn", x_by_group, dy, preferred_element_type=out.dtype)


@functools.partial(jax.jit, static_argnums=(3,))
def _weight_grad(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, out_dtype: Any) -> jax.Array:
    """[G, K, N]: group g's rows of lhs [M, K] transposed times its rows of dout [M, N]; zeros for empty groups;
    nothing past the groups read into a sum. JAX's own Mosaic GPU kernel (`transposed_ragged_dot_mgpu`: it walks
    only each group's row blocks, so the rows past the groups cost nothing; see _weight_grad_by_blocks for its last
    block); XLA's ragged_dot_general where K or N is not a multiple of 64. tokamax's ragged-contracting kernel is
    not used: on H200 with jax 0.11.2 it came out 10% off, differently run to run."""
    block_m, block_n = _tile(lhs.shape[1]), _tile(dout.shape[1])
    if block_m is None or block_n is None:
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
        )
        out = jax.lax.ragged_dot_general(lhs, dout, group_sizes, dims, preferred_element_type=jnp.float32)
        out = jnp.where((group_sizes > 0)[:, None, None], out, jnp.zeros((), out.dtype))
    else:
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

        kernel = functools.partial(
            transposed_ragged_dot_mgpu.transposed_ragged_dot,
            block_m=block_m,
            block_n=block_n,
            block_k=_WEIGHT_GRAD_ROW_BLOCK,
            max_concurrent_steps=4,
            grid_block_n=4,
        )
        out = _weight_grad_by_blocks(
            lambda a, b, sizes: kernel(a, b, group_sizes=sizes), lhs, dout, group_sizes, _WEIGHT_GRAD_ROW_BLOCK
        )
    return out.astype(out_dtype)


def _mosaic_forward(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype: Any, zero_padding: bool
) -> jax.Array:
    # Inside shard_map a Pallas kernel's output varies over no manual axis: mark it like its operands.
    return varying_like(_row_dot(lhs, rhs, group_sizes, out_dtype, zero_padding, False), lhs, rhs, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _mosaic_matmul(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype: Any, zero_padding: bool
) -> jax.Array:
    return _mosaic_forward(lhs, rhs, group_sizes, out_dtype, zero_padding)


def _mosaic_matmul_fwd(lhs, rhs, group_sizes, out_dtype, zero_padding):
    return _mosaic_forward(lhs, rhs, group_sizes, out_dtype, zero_padding), (lhs, rhs, group_sizes)


def _mosaic_matmul_bwd(out_dtype, zero_padding, residuals, dout):
    lhs, rhs, group_sizes = residuals
    dout = dout.astype(lhs.dtype)
    # A kernel's output varies over no manual axis: first mark it as its operands vary, then sum over the axes its
    # primal does not vary over (rhs sharded over a tensor-parallel axis that lhs is not, say).
    dlhs = _row_dot(dout, rhs, group_sizes, lhs.dtype, zero_padding, True)
    dlhs = like_primal(varying_like(dlhs, dout, rhs, group_sizes), lhs)
    # The weight gradient rewrites a few rows of dout in place (_weight_grad_by_blocks): after dlhs has read it, or
    # XLA would keep a copy of the whole buffer for dlhs.
    dlhs, dout = jax.lax.optimization_barrier((dlhs, dout))
    drhs = _weight_grad(lhs, dout, group_sizes, rhs.dtype)
    drhs = like_primal(varying_like(drhs, lhs, dout, group_sizes), rhs)
    return dlhs, drhs, None


_mosaic_matmul.defvjp(_mosaic_matmul_fwd, _mosaic_matmul_bwd)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: Any = None,
    backend: GroupedBackend = "auto",
    zero_padding: bool = True,
) -> jax.Array:
    """Rows of ``lhs [M, K]`` in consecutive groups (``group_sizes [G]`` int32 rows each, in order) times
    ``rhs [G, K, N]``: ``[M, N]`` in `out_dtype` (default: the operands'), accumulated in float32; rows past
    ``sum(group_sizes)`` are zeros, and what `lhs` (or the cotangent) holds there, NaN included, reaches neither the
    output nor a gradient. Differentiable in `lhs` and `rhs`. `backend`: see ``grouped_backend`` (on the Mosaic
    backend without tokamax, JAX's kernel writes the output in the operands' dtype first: a wider `out_dtype` gets
    that rounding too).

    With ``zero_padding=False`` the rows past the groups, of the output and of lhs's gradient, are left as the
    kernels leave them (anything, NaN included) rather than zeroed by a pass over all M rows: for consumers that
    read only the groups' rows (most of a worst-case pair buffer lies past them)."""
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (rhs.shape[0],) or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"jax_uccl_ep.grouped_matmul: expected lhs [M, K], rhs [G, K, N], group_sizes [G]; got "
            f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}"
        )
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"jax_uccl_ep.grouped_matmul: lhs is {lhs.dtype}, rhs {rhs.dtype}; cast them to one dtype")
    out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    if grouped_backend(backend, lhs.dtype) == "mosaic":
        return _mosaic_matmul(lhs, rhs, group_sizes, out_dtype, bool(zero_padding))
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return _rows_in_groups(out, group_sizes).astype(out_dtype)
