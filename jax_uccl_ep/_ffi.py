"""FFI targets: registration with XLA, and the primitive that lowers to them.

The ops need, on the host, the global ranks of their EP group (which peers to talk to). Inside shard_map the
concrete mesh is not visible at trace time, but it is at lowering time: the lowering rule reads it from the
lowering context and hands every device the table of groups as an attribute, so no handler ever reads device
memory to learn its peers.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _plan, _uccl_ep

_registered = False


def register() -> None:
    """Registers every FFI target of the extension with XLA, once per process."""
    global _registered
    if _registered:
        return
    for name, capsule in _uccl_ep.cpu_registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    if hasattr(_uccl_ep, "cuda_registrations"):
        for name, capsule in _uccl_ep.cuda_registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    _registered = True


def global_ranks() -> dict[int, int]:
    """Runtime rank of every device of the job: its index in jax.devices() sorted by id."""
    return _plan.global_ranks(jax.devices())


def axes_of(axis_name: str | Sequence[str]) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def group_table(mesh: Any, axis_name: str | Sequence[str]) -> np.ndarray:
    """[groups, R] int32: the runtime ranks of each EP group of `mesh` along `axis_name`, in axis order."""
    axes = axes_of(axis_name)
    names = list(mesh.axis_names)
    missing = [a for a in axes if a not in names]
    if missing:
        raise ValueError(f"jax_uccl_ep: axis {missing[0]!r} is not an axis of the mesh {names}")
    rank_of = global_ranks()
    ranks = np.vectorize(lambda d: rank_of[d.id], otypes=[np.int32])(mesh.devices)
    ep_dims = [names.index(a) for a in axes]
    other = [i for i in range(len(names)) if i not in ep_dims]
    size = math.prod(mesh.devices.shape[i] for i in ep_dims)
    return np.transpose(ranks, other + ep_dims).reshape(-1, size).astype(np.int32)


LEVELS = ("node", "across")


def level_table(table: np.ndarray, node_of_rank: Sequence[int], level: str) -> np.ndarray:
    """The groups of one level of two-level routing, from the EP groups `table` [groups, R] (runtime ranks):
    "node": each node's members of a group, in axis order ([groups * nodes, G]); "across": the members with the
    same index on their nodes, node after node ([groups * G, nodes]). Member i of a group must sit on node block
    i // G (each node's ranks together, node after node, as a mesh over jax.devices() lists them): expert
    ownership by axis position then matches at both levels. Raises ValueError otherwise."""
    if level not in LEVELS:
        raise ValueError(f"jax_uccl_ep: unknown routing level {level!r}")
    rows = []
    for row in np.asarray(table):
        per_node = _plan.node_blocks(row, node_of_rank)
        if per_node is None:
            raise ValueError(
                "jax_uccl_ep: two-level routing needs the EP axis to list each node's ranks together, node after "
                f"node (a mesh over jax.devices() in order does); this axis's ranks {list(map(int, row))} sit on "
                f"nodes {[int(node_of_rank[r]) for r in row]}. Reorder the mesh's devices, or set "
                "UCCL_EP_TWO_LEVEL=0 for flat routing"
            )
        grid = np.asarray(row, np.int32).reshape(len(row) // per_node, per_node)
        rows.append(grid if level == "node" else grid.T)
    return np.concatenate(rows).astype(np.int32)


@dataclass(frozen=True)
class CallParams:
    """The one parameter of the primitive, so that every rule of it (abstract evaluation, lowering, the refusals
    of jvp and vmap) takes the same signature. Hashable, as JAX requires of a primitive's parameters."""

    op: str  # the FFI target is "uccl_ep_" + op
    results: tuple[tuple[tuple[int, ...], np.dtype], ...]  # (shape, dtype) of each result
    axis_name: tuple[str, ...] | None  # the EP axes: the handler gets the group table
    level: tuple[str, int, int] | None  # a level of two-level routing: (name, nodes, ranks per node) as traced
    attrs: tuple[tuple[str, Any], ...]  # the op's own attributes, sorted by name
    has_side_effect: bool  # an ordered op (never merged or dropped)


ep_call_p = Primitive("uccl_ep_call")
ep_call_p.multiple_results = True


try:
    from jax.extend.core import ShapedArray  # type: ignore[attr-defined]
except ImportError:
    from jax._src.core import ShapedArray


def _abstract_eval(*operands: Any, params: CallParams) -> list[ShapedArray]:
    return [ShapedArray(shape, dtype) for shape, dtype in params.results]


def _concrete_mesh(ctx: Any) -> Any:
    """The mesh (with devices) the op is lowered for."""
    module = ctx.module_context
    mesh = getattr(module.axis_context, "mesh", None)
    if mesh is not None and getattr(mesh, "devices", None) is not None and hasattr(mesh.devices, "shape"):
        return mesh
    # Newer JAX may keep only an abstract mesh there; the module's device assignment lists its devices in order.
    devices = getattr(module, "device_assignment", None)
    if mesh is not None and devices is not None and len(devices) == math.prod(mesh.axis_sizes):
        return jax.sharding.Mesh(np.array(devices).reshape(mesh.axis_sizes), mesh.axis_names)
    raise ValueError("jax_uccl_ep: dispatch and combine must run inside jax.shard_map over a concrete Mesh")


class _OpCounter:
    """Numbers the ordered ops of one lowered program; kept in the module context's keepalives."""

    def __init__(self) -> None:
        self.next = 0


def _next_op_index(ctx: Any) -> int:
    # Every process lowers the same program the same way, so an op has the same index on every rank; the
    # message headers carry it and a rank that runs the ops in another order fails instead of mixing data.
    keepalives = getattr(ctx.module_context, "keepalives", None)
    if keepalives is None:
        return 0
    counter = next((k for k in keepalives if isinstance(k, _OpCounter)), None)
    if counter is None:
        counter = _OpCounter()
        keepalives.append(counter)
    counter.next += 1
    return counter.next - 1


_warned_staged: set[str] = set()


def _warn_staged(op: str) -> None:
    if op in _warned_staged:
        return
    _warned_staged.add(op)
    warnings.warn(
        f"jax_uccl_ep: {op} runs host-staged (copies to host memory and back each call): GPU-initiated ops are off "
        "(UCCL_EP_GPU_INITIATED=0 or UCCL_EP_PINNED=0) or the job has more ranks than they take (8 in normal mode, "
        "32 in low-latency mode)",
        RuntimeWarning,
        stacklevel=2,
    )


def _lowering(ctx: Any, *operands: Any, params: CallParams) -> Sequence[Any]:
    op, axis_name, level = params.op, params.axis_name, params.level
    extra: dict[str, Any] = {k: np.int64(v) if isinstance(v, (int, np.integer)) else v for k, v in params.attrs}
    if params.has_side_effect:
        extra["op_index"] = np.int64(_next_op_index(ctx))
    if axis_name is not None:
        plan = _plan.current()
        if plan is None:
            # The path is fixed in the compiled program: one lowered without a runtime would keep a guessed one.
            raise RuntimeError(
                f"jax_uccl_ep {op}: the runtime is not initialized; call jax_uccl_ep.initialize() first (before the "
                "first EP op is traced and compiled)"
            )
        table = group_table(_concrete_mesh(ctx), axis_name)
        if level is not None:
            name, nodes, per_node = level
            two = plan.two_level
            now = "no two-level routing" if two is None else f"{two.num_nodes} nodes of {two.per_node} ranks"
            if two is None or (two.num_nodes, two.per_node) != (nodes, per_node):
                raise RuntimeError(
                    f"jax_uccl_ep: this op was traced for two-level routing over {nodes} nodes of "
                    f"{per_node} ranks, but the runtime now runs {now} (initialized again with other "
                    "settings?); trace it again (jax.clear_caches())"
                )
            table = level_table(table, two.node_of_rank, name)
            if table.shape[1] != (per_node if name == "node" else nodes):
                raise ValueError(
                    f"jax_uccl_ep: the EP axis's {name} groups hold {table.shape[1]} ranks where the op "
                    f"was traced for {per_node if name == 'node' else nodes}"
                )
        platforms = getattr(ctx.module_context, "platforms", ())
        path = _plan.op_path(plan, op, None if level is None else level[0], platforms, table)
        if path == _plan.Path.STAGED:
            _warn_staged(op)
        extra["group_table"] = table.reshape(-1)
        extra["group_size"] = np.int64(table.shape[1])
        extra["path"] = np.int64(path)
        if op in _plan.NORMAL_OPS:
            on_host = path in (_plan.Path.CPU, _plan.Path.STAGED)
            extra["node_size"] = np.int64(_plan.node_size(plan, table) if on_host else 0)
    rule = jax.ffi.ffi_lowering("uccl_ep_" + op, has_side_effect=params.has_side_effect)
    return rule(ctx, *operands, **extra)


ep_call_p.def_abstract_eval(_abstract_eval)


def _no_jvp(primals: Any, tangents: Any, *, params: CallParams) -> Any:
    op = params.op
    if op.startswith("low_latency"):
        hint = "low-latency ops are for inference and decoding; train with dispatch and combine, which have VJPs"
    elif op in ("dispatch", "dispatch_pairs"):
        hint = (
            "an FP8 pair has no derivative: pass the unquantized rows with use_fp8=True for an FP8 dispatch that "
            "has one"
        )
    else:
        hint = "dispatch and combine have reverse-mode derivatives (jax.grad, jax.vjp), not forward-mode ones"
    raise NotImplementedError(f"jax_uccl_ep: {op} is not differentiable here ({hint})")


def _no_batching(args: Any, dims: Any, *, params: CallParams) -> Any:
    raise NotImplementedError(
        f"jax_uccl_ep: {params.op} cannot run under jax.vmap (each call is one collective of the EP group); fold the "
        "vmapped dimension into the tokens instead: the ops take [..., hidden] and keep the leading dimensions"
    )


ad.primitive_jvps[ep_call_p] = _no_jvp
batching.primitive_batchers[ep_call_p] = _no_batching
try:
    # Lowered once per op: a cached lowering would give two identical ops one op_index.
    mlir.register_lowering(ep_call_p, _lowering, cacheable=False)
except TypeError:
    mlir.register_lowering(ep_call_p, _lowering)


def call(
    op: str,
    results: Sequence[jax.ShapeDtypeStruct],
    *operands: jax.Array,
    axis_name: str | Sequence[str] | None = None,
    ordered: bool = True,
    after: jax.Array | None = None,
    level: tuple[str, int, int] | None = None,
    **attrs: Any,
) -> list[jax.Array]:
    """Binds EP op `op` (FFI target "uccl_ep_<op>").

    With `axis_name`, the handler also gets the EP group table; with a `level` of two-level routing ((name, nodes,
    ranks per node) as traced, name "node" or "across"), the table of that level's groups instead (level_table).
    An `ordered` op is never merged or dropped and takes one extra operand its handler ignores: one element of
    `after`, if given, which makes it run after the op that produced `after`. Every rank must run the
    communicating ops in one order, and XLA:CPU starts independent custom calls in any order (the two combines of
    dispatch's backward pass ran in opposite orders on two ranks), so ops that do not depend on each other through
    data must be chained this way.
    """
    register()
    if ordered:
        order = after.reshape(-1)[:1] if after is not None and after.size else jnp.zeros((1,), jnp.int8)
        operands = operands + (order,)
    params = CallParams(
        op=op,
        results=tuple((tuple(r.shape), np.dtype(r.dtype)) for r in results),
        axis_name=None if axis_name is None else axes_of(axis_name),
        level=level,
        attrs=tuple(sorted(attrs.items())),
        has_side_effect=ordered,
    )
    return ep_call_p.bind(*operands, params=params)


def _varying_axes_of_type(t) -> frozenset:
    """The manual mesh axes a type (an aval, or a ShapeDtypeStruct from ``jax.eval_shape``) says its value varies
    over: jax 0.10 keeps them in manual_axis_type, later versions in vma."""
    manual = getattr(t, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(t, "vma", ()))


def varying_axes(x: jax.Array) -> frozenset:
    """The manual mesh axes `x` varies over inside shard_map (empty outside it, or where shard_map tracks none)."""
    return _varying_axes_of_type(jax.typeof(x))


def zeros_typed(like) -> jax.Array:
    """Zeros of `like`'s shape and dtype, varying over the manual axes `like` varies over (`like`: an array, or a
    ShapeDtypeStruct from ``jax.eval_shape`` inside shard_map): what a branch of ``lax.cond`` returns in place of
    a value only the other branch computes."""
    return mark_varying(jnp.zeros(like.shape, like.dtype), tuple(sorted(_varying_axes_of_type(like))))


def mark_varying(outputs, axes):
    """`outputs` (an array or a tree of them) marked varying over `axes` inside shard_map, where not already: each
    device holds its own values (FFI outputs; parameters whose gradients should reduce where the mark's transpose
    runs)."""

    def cast(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)

    return jax.tree.map(cast, outputs)


def varying_like(value, *like: jax.Array):
    """`value` (an array or a tree of them) marked varying over every manual mesh axis any of `like` varies over:
    what an op computed from them holds its own values on each device, whether or not JAX could see it (an FFI
    call's or a Pallas kernel's outputs carry no varying axes)."""
    return mark_varying(value, tuple(sorted(frozenset().union(*map(varying_axes, like)))))


def like_primal(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
    """`cotangent` with exactly `primal`'s varying manual axes, as JAX checks a custom VJP's outputs: summed over
    the axes only it varies over (the transpose of broadcasting an invariant value), marked varying over those only
    the primal varies over (a kernel's outputs carry none)."""
    have, want = varying_axes(cotangent), varying_axes(primal)
    extra = tuple(sorted(have - want))
    if extra:
        cotangent = jax.lax.psum(cotangent, extra)
    return mark_varying(cotangent, tuple(sorted(want)))


def ep_call(op, results, *operands, axis_name=None, varying_over=(), ordered=True, after=None, **attrs):
    """call(), with outputs that vary over the EP axis and every axis its operands vary over."""
    outs = call(op, results, *operands, axis_name=axis_name, ordered=ordered, after=after, **attrs)
    axes = set(varying_over) | set(axes_of(axis_name) if axis_name is not None else ())
    for a in operands:
        axes |= varying_axes(a)
    return mark_varying(outs, tuple(sorted(axes)))
