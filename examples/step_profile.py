"""Device time of a jitted step's parts, from one profiled call: each compiled op counts towards the named scope its
``op_name`` metadata holds (forward and backward alike: JAX keeps the scope under ``jvp(...)``/``transpose(...)``).

    parts = profile_parts(train_step, (params, opt_state, batch), {"experts": "moe_experts", ...})
    # {"experts": 2.1, ..., "other": 30.5, "total": 40.2}  (ms per device, summed over the ops' events)

The profile's events name their compiled op (``hlo_op``) and program (``hlo_module``); the op's scope comes from
the compiled HLO text (a fusion takes its matmul's scope, else its root's; one without metadata the scope most of its
fused instructions have). Times are the sums of the ops' device events, per device: ops on different streams may
overlap, so the parts can add up to more than the step's wall time.
"""

from __future__ import annotations

import collections
import functools
import glob
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MATMUL = re.compile(r"\s(dot|convolution|custom-call)\(")  # the opcode (operands print as %name)
_CALLED = re.compile(
    r"\b(calls|to_apply|body|condition|branch_computations|called_computations|true_computation|"
    r"false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)
# XLA:GPU's command buffers off (CPU compilers ignore the option).
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
# Instructions whose events (XLA:CPU records one for a loop's whole run) span their callees' own op events.
_CONTAINERS = ("body", "branch_computations", "true_computation")


def scope_of(op_name: str, scopes: Mapping[str, str]) -> str | None:
    """The part whose scope appears last (innermost) in `op_name` as a whole path word, or None."""
    best, where = None, -1
    for part, scope in scopes.items():
        for m in re.finditer(rf"(?<![\w]){re.escape(scope)}(?![\w])", op_name):
            if m.start() > where:
                best, where = part, m.start()
    return best


def op_parts(hlo_text: str, scopes: Mapping[str, str]) -> tuple[str, dict[str, str | None], set[str]]:
    """(the module's name, each instruction's part, the loop and conditional instructions) from compiled HLO text.
    An instruction's part is that of the matmul (dot, convolution, custom call) it fuses, else its op_name's scope
    (None where the op name holds none: a fusion's is its root's), and where it has no op name, the part most of its
    called computations' instructions have."""
    module = re.search(r"HloModule\s+([\w.\-]+)", hlo_text)
    own: dict[str, str | None] = {}  # the part of each instruction with an op name (None: in no scope)
    calls: dict[str, list[str]] = {}
    containers: set[str] = set()
    members: dict[str, list[str]] = collections.defaultdict(list)
    instructions: list[str] = []
    matmuls: set[str] = set()
    computation = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)  # first: a header's parameters may print /*index=5*/, which looks like "name ="
        if header:
            computation = header.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name, rest = m.group(1), m.group(2)
        instructions.append(name)
        if _MATMUL.search(rest.split(", metadata=")[0]):
            matmuls.add(name)
        op_name = _OP_NAME.search(rest)
        if op_name:
            own[name] = scope_of(op_name.group(1), scopes)
        called = _CALLED.findall(rest)
        if called:
            calls[name] = [c.strip().lstrip("%") for _, t in called for c in t.strip("{}").split(",") if c.strip()]
            if any(kind in _CONTAINERS for kind, _ in called):
                containers.add(name)
        if computation is not None:
            members[computation].append(name)

    # HLO's calls form no cycles, so each computation's vote is taken once and reused by every caller.
    @functools.cache
    def computation_part(comp: str) -> str | None:
        votes = collections.Counter(p for i in members.get(comp, []) if (p := part(i)) is not None)
        return votes.most_common(1)[0][0] if votes else None

    @functools.cache
    def matmul_part(comp: str) -> str | None:  # the part of a matmul the computation holds, at any depth
        for i in members.get(comp, []):
            if (p := (own.get(i) if i in matmuls else None) or called_matmul_part(i)) is not None:
                return p
        return None

    def called_matmul_part(name: str) -> str | None:
        return next((p for c in calls.get(name, []) if (p := matmul_part(c)) is not None), None)

    @functools.cache
    def part(name: str) -> str | None:
        if (p := called_matmul_part(name)) is not None:
            return p  # a fusion's time is its matmul's
        if name in own:  # else its root's op name (the optimizer's update, fusing in a gradient's convert: other)
            return own[name]
        votes = collections.Counter(p for c in calls.get(name, []) if (p := computation_part(c)) is not None)
        return votes.most_common(1)[0][0] if votes else None

    parts = {name: part(name) for name in instructions}
    return (module.group(1) if module else ""), parts, containers


_SHAPE_AND_OPCODE = re.compile(r"^(\([^)]*\)|\S+)\s+([\w\-]+)\(")
_KIND = re.compile(r"\bkind=(k\w+)")


def describe_instructions(hlo_text: str) -> dict[str, str]:
    """Each instruction's result shape and opcode from compiled HLO text, layouts left out (``"bf16[131072,1024]
    fusion kLoop"``): what a kernel the profile names computes, and over how many rows."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None or _HEADER.match(line):
            continue
        what = _SHAPE_AND_OPCODE.match(m.group(2))
        if what is None:
            continue
        kind = _KIND.search(m.group(2).split(", metadata=")[0])
        shape = re.sub(r"\{[^}]*\}", "", what.group(1))
        out[m.group(1)] = f"{shape} {what.group(2)}" + (f" {kind.group(1)}" if kind else "")
    return out


def _events(directory: str) -> list[tuple[str, str, str, str, float]]:
    """(device, hlo_module, hlo_op, event name (the kernel's, on GPUs), duration ns) of every op event in the profile
    written under `directory`; the device is the plane and the event's device ordinal where it has one (CPU devices
    share a plane). Where there are device planes (GPUs) only their events count: host threads that name ops would
    count them twice."""
    from jax.profiler import ProfileData

    out = []
    for path in glob.glob(f"{directory}/**/*.xplane.pb", recursive=True):
        data = ProfileData.from_file(path)
        for plane in data.planes:
            for line in plane.lines:
                for event in line.events:
                    stats = dict(event.stats)
                    if "hlo_op" in stats and "hlo_module" in stats:
                        device = f"{plane.name}#{stats.get('device_ordinal', '')}"
                        out.append(
                            (device, str(stats["hlo_module"]), str(stats["hlo_op"]), event.name, event.duration_ns)
                        )
    if any(device.startswith("/device:") for device, *_ in out):
        out = [e for e in out if e[0].startswith("/device:")]
    return out


def profile_parts(
    step: Callable[..., Any], args: Sequence[Any], scopes: Mapping[str, str], top: int = 0
) -> dict[str, Any]:
    """Calls the jitted `step` on `args` once under the profiler; the ms per device of each part of `scopes`
    ({part: scope name}), of "other" (ops in no scope) and "total" (every op of the step's program), or only
    "_results" where the profile named none of the program's ops. The call's results are under "_results" (step may
    donate its arguments); with `top`, "_top" holds each part's `top` heaviest kernels (event names: the GPU's
    kernels, CPU's ops) as [name, ms per device, events, what the first op that launched it computes
    (describe_instructions)], heaviest first.

    Compiles `step` once more, without XLA:GPU's command buffers, and profiles that program: a kernel a CUDA graph
    launches carries the graph's name as its op, not its own, so in the program the steps run most kernels would
    count as "other". Each kernel's time is its own either way; the graphs save launches between them."""
    compiled = step.lower(*args).compile(compiler_options=NO_COMMAND_BUFFERS)
    text = compiled.as_text()
    module, parts, containers = op_parts(text, scopes)
    described = describe_instructions(text)
    with tempfile.TemporaryDirectory(prefix="step_profile_") as directory:
        with jax.profiler.trace(directory):
            results = jax.block_until_ready(compiled(*args))
        events = _events(directory)
    ms: dict[str, float] = collections.defaultdict(float)
    kernels: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    counts: collections.Counter = collections.Counter()
    what: dict[tuple[str, str], str] = {}
    devices = set()
    for device, hlo_module, hlo_op, name, ns in events:
        if hlo_module != module or hlo_op in containers:  # a loop's event spans its body's, counted themselves
            continue
        devices.add(device)
        part = parts.get(hlo_op) or "other"
        ms[part] += ns / 1e6
        ms["total"] += ns / 1e6
        kernels[part][name] += ns / 1e6
        counts[part, name] += 1
        what.setdefault((part, name), described.get(hlo_op, ""))
    out: dict[str, Any] = {"_results": results}
    if devices:
        n = len(devices)
        out.update({p: ms.get(p, 0.0) / n for p in (*scopes, "other", "total")})
        if top:
            out["_top"] = {
                p: [[k, t / n, counts[p, k] // n, what[p, k]] for k, t in kernels[p].most_common(top)]
                for p in (*scopes, "other")
            }
    return out
