"""Shared helpers for the benchmarks in bench/.

- Timing: a jitted function runs the op `iters` times inside one jit (a fori_loop that carries data, so XLA can
  neither hoist nor merge the calls); the wall time of a whole call, after block_until_ready, divided by `iters`
  is the time per op; the median over `repeats` calls is reported.
- Bandwidth, both ways the project's design notes (not in this repository) ask for: DeepEP's formula (every byte
  a rank receives, its own rows included) and remote-only (bytes that cross between ranks). Both are per rank,
  averaged over the ranks.
- A fixed-width table printer (benchmarks print their table last).
- A spawner for multi-process runs on the package's launcher (jax_uccl_ep.launch: jax.distributed on a free
  127.0.0.1 port, process groups killed on timeout).
- The EP problem (random top-k routing, random normal x) and the ops measured on it, shared by normal.py (CPU)
  and intranode.py (GPU): jax_uccl_ep dispatch/combine, jax.lax.all_to_all on the padded payload and
  jax.lax.ragged_all_to_all on the exact ragged payload, each in its own jit inside one jax.shard_map.

This module imports jax lazily: proxy.py uses the table and the spawner without starting a backend.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
TESTS_DIR = os.path.join(REPO_ROOT, "tests")


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------


def looped(step: Callable[[Any], Any], iters: int, unroll: bool = False) -> Callable[[Any], Any]:
    """Returns carry -> step(step(...step(carry))) (`iters` times) as one lax.fori_loop, or unrolled (a straight
    line of `iters` calls: no loop bookkeeping between calls, which matters for ops of a few microseconds).

    `step` must feed the op's output into the next call's input, so nothing is loop-invariant: the collectives
    carry their output buffer; the jax_uccl_ep ops carry a scalar taken from their output that enters the next
    call's small routing input (writing a row back into a large x would copy or convert all of x on XLA:CPU).
    """
    import jax

    def run(carry):
        if unroll:
            for _ in range(iters):
                carry = step(carry)
            return carry
        return jax.lax.fori_loop(0, iters, lambda _, c: step(c), carry)

    return run


@dataclass
class Timing:
    median_s: float  # per op
    min_s: float
    max_s: float
    iters: int
    repeats: int
    compile_s: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def time_jitted(fn: Callable, args: Sequence[Any], *, iters: int, repeats: int = 5, warmup: int = 2) -> Timing:
    """Times `fn(*args)` (a jitted function that runs the op `iters` times); returns seconds per op.

    Compiles first (compile time reported apart), runs `warmup` untimed calls, then `repeats` timed calls, each
    ended by block_until_ready.
    """
    import jax

    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile() if hasattr(fn, "lower") else fn
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    per_op = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        per_op.append((time.perf_counter() - t0) / iters)
    return Timing(statistics.median(per_op), min(per_op), max(per_op), iters, repeats, compile_s)


def proxy_bytes_posted() -> tuple[int, int] | None:
    """Bytes this process's proxies have posted so far (RDMA writes), all and those to ranks of other nodes (what
    crosses the network), or None where no proxy runtime runs."""
    try:
        import jax_uccl_ep as ep
        from jax_uccl_ep import _runtime, _uccl_ep, _uccl_ep_testing

        if not _uccl_ep.is_initialized():
            return None
        node = ep.topology().node_of_rank
        total = across = 0
        for r in _runtime.local_ranks():
            to = _uccl_ep_testing.stats(r)["bytes_posted_to"]
            total += sum(to)
            across += sum(b for p, b in enumerate(to) if node[p] != node[r])
        return total, across
    except Exception:  # noqa: BLE001 (a build without stats: the timing stands without it)
        return None


def bulk_tuning(spec: str) -> list[int]:
    """The NVLink bulk kernels' testing hook's arguments from "lag:stages[:combine[:producers[:rows[:one_fence]]]]"
    (0: the default)."""
    return [int(v) for v in spec.split(":")]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


# ----------------------------------------------------------------------------------------------------------------
# Bandwidth
# ----------------------------------------------------------------------------------------------------------------


def received_bytes(matrix) -> tuple[float, float]:
    """Mean bytes received per rank from a [src, dst] byte matrix: (all incl. local = DeepEP, remote only)."""
    import numpy as np

    m = np.asarray(matrix, dtype=np.float64)
    r = m.shape[0]
    total = m.sum() / r
    remote = (m.sum() - np.trace(m)) / r
    return float(total), float(remote)


def gbps(nbytes: float, seconds: float | None) -> float | None:
    if seconds is None or seconds <= 0 or not math.isfinite(seconds):
        return None
    return nbytes / seconds / 1e9


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 1e-6:
        return f"{seconds * 1e9:.1f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds:.3f} s"


def fmt_gbps(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def short_error(e: BaseException | str, limit: int = 90) -> str:
    """One line of an exception, for a table cell."""
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    line = next((l.strip() for l in text.splitlines() if l.strip()), text)
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ----------------------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """Fixed-width table; the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = ([title] if title else []) + [line(cells[0]), rule] + [line(r) for r in cells[1:]]
    return "\n".join(out)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
    print(format_table(headers, rows, title), flush=True)


def run_header(device: str) -> dict:
    """What RESULTS.md entries start with: date, device, command."""
    return {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "host": platform.node(),
        "command": " ".join([os.path.relpath(sys.argv[0], REPO_ROOT) if sys.argv[0] else "?"] + sys.argv[1:]),
        "python": platform.python_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2),  # other work on a shared machine shows here
    }


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


# ----------------------------------------------------------------------------------------------------------------
# Multi-process runs (the package's launcher)
# ----------------------------------------------------------------------------------------------------------------


def spawn(
    path: str,
    function: str,
    num_processes: int,
    *,
    args: list | None = None,
    devices_per_process: int = 1,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
    distributed: bool = True,
    gpus: bool = False,
    share_gpu: bool = False,
) -> list[Any]:
    """Runs `function(*args)` of the file `path` in `num_processes` fresh processes; returns their results.

    Each child gets JAX_PLATFORMS=cpu, JAX_NUM_CPU_DEVICES=devices_per_process (with `gpus`: one GPU each, the
    visible GPU of its rank modulo the GPUs there are, or the first for all with `share_gpu`) and (if
    `distributed`) the jax.distributed coordinator of the job in its environment; jax_uccl_ep.initialize() picks
    those up. With distributed=False (one process only) the child runs without jax.distributed, JAX's usual
    one-process-per-host mode. Raises with every rank's stderr if a rank fails.
    """
    # Imported here: importing jax_uccl_ep imports jax, and proxy.py's parent uses only the table helpers. The
    # harness is the tests' (tests/spawn.py).
    if TESTS_DIR not in sys.path:
        sys.path.insert(0, TESTS_DIR)
    import spawn

    from jax_uccl_ep.launch import detect_gpus

    child_env = dict(env or {})
    if not distributed:
        if num_processes != 1:
            raise ValueError("distributed=False needs exactly one process")
        child_env.update(JAX_COORDINATOR_ADDRESS="", JAX_NUM_PROCESSES="", JAX_PROCESS_ID="")
    per_rank = None
    if gpus:
        # More processes than GPUs (or share_gpu: the first GPU for all) take turns on them: rank i on GPU i mod
        # count.
        ids = detect_gpus() or ["0"]
        if share_gpu:
            ids = ids[:1]
        per_rank = [{"CUDA_VISIBLE_DEVICES": ids[i % len(ids)]} for i in range(num_processes)]
        if num_processes > len(ids):  # JAX must not take each GPU's memory up front then
            child_env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    results = spawn.call_in_processes(
        path,
        function,
        num_processes,
        args=args,
        devices_per_process=devices_per_process,
        timeout_s=timeout_s,
        env=child_env,
        per_rank_env=per_rank,
        platform="gpu" if gpus else "cpu",
    )
    if not all(r.ok for r in results):
        raise RuntimeError(f"{function} failed in {num_processes} process(es):\n{spawn.describe(results)}")
    return [r.result for r in results]


# ----------------------------------------------------------------------------------------------------------------
# The EP problem and the ops measured on it
# ----------------------------------------------------------------------------------------------------------------

FP8_BLOCK = 128


@dataclass
class EPProblem:
    """Random routing for R ranks of T tokens each (same on every process: seeded)."""

    ranks: int
    tokens: int
    hidden: int
    topk: int
    experts: int
    dtype: str  # "bfloat16" | "float32" (the payload dtype; FP8 dispatch is an extra op)
    seed: int = 0
    topk_idx: Any = None  # [R, T, K] int32
    topk_weights: Any = None  # [R, T, K] float32
    in_rank: Any = None  # [R, T, R] bool: token t of rank s goes to rank d
    counts: Any = None  # [src, dst] int64: tokens src sends to dst (once per rank, as dispatch does)

    def __post_init__(self):
        import numpy as np

        if self.experts % self.ranks:
            raise ValueError(f"--experts {self.experts} must be divisible by --ranks {self.ranks}")
        if self.topk > self.experts:
            raise ValueError("--topk must not exceed --experts")
        rng = np.random.default_rng(self.seed)
        r, t, k, e = self.ranks, self.tokens, self.topk, self.experts
        scores = rng.random((r, t, e), dtype=np.float32)
        idx = np.argpartition(scores, e - k, axis=-1)[..., e - k :]  # k distinct experts per token, uniform
        self.topk_idx = idx.astype(np.int32)
        w = rng.random((r, t, k), dtype=np.float32) + 0.1
        self.topk_weights = (w / w.sum(-1, keepdims=True)).astype(np.float32)
        owner = self.topk_idx // (e // r)
        self.in_rank = np.zeros((r, t, r), bool)
        for d in range(r):
            self.in_rank[..., d] = (owner == d).any(-1)
        self.counts = self.in_rank.sum(1).astype(np.int64)  # [src, dst]

    @property
    def elem_bytes(self) -> int:
        return {"bfloat16": 2, "float32": 4, "float16": 2}[self.dtype]

    @property
    def capacity_per_peer(self) -> int:
        """Rows per (src, dst) pair of the padded all_to_all payload: the largest pair, so nothing drops."""
        return max(1, int(self.counts.max()))

    @property
    def max_recv(self) -> int:
        """Rows the busiest rank receives: dispatch's output capacity (exact, nothing drops)."""
        return max(1, int(self.counts.sum(0).max()))

    @property
    def max_send(self) -> int:
        return max(1, int(self.counts.sum(1).max()))

    def token_bytes(self, fp8: bool = False) -> float:
        """Bytes of one token's payload as DeepEP counts it (FP8: 1 byte per channel + a float32 per 128)."""
        if fp8:
            return self.hidden + 4 * (self.hidden // FP8_BLOCK)
        return self.hidden * self.elem_bytes

    def exact_bytes(self, fp8: bool = False) -> tuple[float, float]:
        """(DeepEP, remote-only) bytes received per rank for the exact ragged payload (dispatch, combine)."""
        return received_bytes(self.counts * self.token_bytes(fp8))

    def padded_bytes(self) -> tuple[float, float]:
        """(all, remote-only) bytes received per rank for the padded [R, capacity_per_peer, H] all_to_all."""
        import numpy as np

        per_pair = self.capacity_per_peer * self.token_bytes()
        return received_bytes(np.full((self.ranks, self.ranks), per_pair))

    def uccl_buffer_bytes(self, platform: str = "cpu") -> int:
        """UCCL_EP_BUFFER_BYTES for the benches' ops on these shapes (jax_uccl_ep.proxy_buffer_bytes): rows in the
        problem's dtype or FP8, combines in float32, low-latency ops of max_tokens_per_rank = tokens."""
        import jax_uccl_ep as ep

        shapes = dict(num_ranks=self.ranks, topk=self.topk, dtype=self.dtype, combine_dtype="float32")
        low_latency = dict(low_latency_max_tokens=self.tokens, num_experts=self.experts, low_latency_fp8=False)
        return max(
            ep.proxy_buffer_bytes(self.tokens, self.hidden, fp8=fp8, **shapes, **low_latency, platform=platform)
            for fp8 in (False, True)
        )

    def describe(self) -> dict:
        c = self.counts
        return {
            "ranks": self.ranks,
            "tokens": self.tokens,
            "hidden": self.hidden,
            "topk": self.topk,
            "experts": self.experts,
            "dtype": self.dtype,
            "seed": self.seed,
            "tokens_sent_per_rank_mean": float(c.sum(1).mean()),
            "tokens_recv_per_rank_max": int(c.sum(0).max()),
            "capacity_per_peer": self.capacity_per_peer,
        }


@dataclass
class OpResult:
    name: str
    timing: Timing | None = None
    error: str | None = None
    bytes_deepep: float = 0.0
    bytes_remote: float = 0.0
    note: str = ""
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "timing"}
        d["timing"] = self.timing.as_dict() if self.timing else None
        return d


def set_uccl_env_defaults(prob: EPProblem, platform: str = "cpu") -> None:
    """Sizes the runtime's buffer for `prob` unless the caller set it; a short deadline keeps failures quick."""
    os.environ.setdefault("UCCL_EP_BUFFER_BYTES", str(prob.uccl_buffer_bytes(platform)))
    os.environ.setdefault("UCCL_EP_TIMEOUT_S", "60")


def _global_array(mesh, spec, host_array):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    host_array = np.asarray(host_array)
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(host_array.shape, sharding, lambda index: host_array[index])


def cupti_activity(
    call: Callable[[], Any], device_index: int = 0, trace_path: str | None = None
) -> list[tuple[str, float, float]]:
    """(name, microseconds, start in microseconds) of every kernel and copy that `call` runs on GPU `device_index`,
    from CUPTI's activity records through torch.profiler (how DeepEP's tests time their kernels). With `trace_path`,
    the whole timeline (every GPU's kernels and copies, the host's CUDA calls) is also written there as a Chrome
    trace. Raises ImportError without torch."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return [
        (ev.name, ev.time_range.elapsed_us(), ev.time_range.start)
        for ev in prof.events()
        if ev.device_type == DeviceType.CUDA and ev.device_index == device_index
    ]


def cupti_per_call(activity: list[tuple[str, float, float]], calls: int, top: int = 8) -> dict:
    """The `top` names by device time, as microseconds per call (sum / calls)."""
    total: dict = {}
    for name, us, _ in activity:
        total[name] = total.get(name, 0.0) + us
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    return {name: round(us / calls, 2) for name, us in ranked}


def cupti_span_per_call(activity: list[tuple[str, float, float]], calls: int) -> float | None:
    """Microseconds per call from the first record's start to the last one's end: the device's time for `calls`
    calls, as CUDA events around them time NCCL, without the host's dispatch before the first (None if empty)."""
    if not activity:
        return None
    return (max(start + us for _, us, start in activity) - min(start for _, _, start in activity)) / calls


class EPBench:
    """The ops of one EP problem on a 1-D mesh ('ep'), each its own jit with a fori_loop inside shard_map."""

    AXIS = "ep"

    def __init__(
        self,
        prob: EPProblem,
        devices=None,
        *,
        iters: int = 10,
        repeats: int = 5,
        cupti: bool = False,
        unroll: bool = False,
        trace_dir: str | None = None,
        phases: bool = False,
    ):
        import jax
        import numpy as np
        from jax.sharding import Mesh
        from jax.sharding import PartitionSpec as P

        self.prob = prob
        self.iters = iters
        self.repeats = repeats
        self.cupti = cupti or bool(trace_dir)  # also record each op's device activity per call (GPUs, torch)
        self.trace_dir = trace_dir  # where each op's Chrome trace of its timed calls goes (None: nowhere)
        self.unroll = unroll  # the timed calls as a straight line in the jit rather than a fori_loop (looped)
        self.phases = phases  # also one call alone with the NVLink kernels' phase stamps on (kernel_phases)
        devices = list(devices if devices is not None else jax.devices())
        if len(devices) != prob.ranks:
            raise ValueError(f"{len(devices)} devices but the problem has {prob.ranks} ranks")
        self.mesh = Mesh(np.array(devices), (self.AXIS,))
        self.P = P
        r, t, h, k = prob.ranks, prob.tokens, prob.hidden, prob.topk
        rng = np.random.default_rng(prob.seed + 1)
        x32 = rng.standard_normal((r * t, h), dtype=np.float32)
        self.x_host = x32
        spec = P(self.AXIS)
        jdtype = getattr(jax.numpy, prob.dtype)
        self.x = _global_array(self.mesh, spec, x32.astype(np.dtype(jdtype)))
        self.topk_idx = _global_array(self.mesh, spec, prob.topk_idx.reshape(r * t, k))
        self.topk_weights = _global_array(self.mesh, spec, prob.topk_weights.reshape(r * t, k))

    # -- helpers ---------------------------------------------------------------------------------------------
    def _smap(self, body, n_in: int, n_out: int | None = None):
        import jax

        spec = self.P(self.AXIS)
        out_specs = spec if n_out is None else tuple([spec] * n_out)
        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=tuple([spec] * n_in), out_specs=out_specs))

    def _run(
        self, name: str, make: Callable[[], tuple[Callable, tuple]], nbytes: tuple[float, float], note: str = ""
    ) -> OpResult:
        res = OpResult(name, bytes_deepep=nbytes[0], bytes_remote=nbytes[1], note=note)
        try:
            fn, args = make()
            res.timing = time_jitted(fn, args, iters=self.iters, repeats=self.repeats)
            before = proxy_bytes_posted()
            if before is not None:  # one more call, counting what the proxies post (per op and local rank)
                import jax

                from jax_uccl_ep import _runtime

                jax.block_until_ready(fn(*args))
                time.sleep(0.2)  # the last op's writes may still be on their way to the proxies
                after = proxy_bytes_posted()
                total, across = ((a - b) / self.iters / len(_runtime.local_ranks()) for a, b in zip(after, before))
                if total:
                    res.extra["proxy_bytes_per_op"] = total
                    res.extra["bytes_across_nodes_per_op"] = across
                    res.note = (
                        res.note + "; " if res.note else ""
                    ) + f"proxies post {fmt_bytes(total)}/rank, {fmt_bytes(across)} across nodes"
            if self.cupti:
                import jax

                try:
                    trace = None
                    if self.trace_dir:
                        os.makedirs(self.trace_dir, exist_ok=True)
                        sms = os.environ.get("UCCL_EP_NUM_SMS", "")  # one file per budget of a sweep
                        stem = re.sub(r"[^A-Za-z0-9]+", "_", f"{name} {sms}").strip("_")
                        trace = os.path.join(self.trace_dir, stem + ".json")
                    activity = cupti_activity(lambda: jax.block_until_ready(fn(*args)), trace_path=trace)
                    res.extra["cupti_us_per_call"] = cupti_per_call(activity, self.iters)
                    res.extra["device_span_us_per_call"] = cupti_span_per_call(activity, self.iters)
                except Exception as e:  # noqa: BLE001 (no torch: the timing stands without it)
                    res.extra["cupti_us_per_call"] = {"error": short_error(e, 120)}
            if self.phases:
                res.extra["phases_us"] = self.kernel_phases(make)
        except Exception as e:  # noqa: BLE001 (one op failing, not implemented here say, must not stop the rest)
            res.error = short_error(e, 400)
        return res

    def kernel_phases(self, make: Callable[[], tuple[Callable, tuple]]) -> list[dict]:
        """One call of the op alone (a jit of one call, warmed up, run after the GPUs went idle) with the NVLink
        kernels' stamps on: per GPU {phase: (start, length)} in us on its own clock from its first stamped phase
        (kernels/nvl/testing.hpp's KernelKind: routing, scan, the receive, acks). The first NVLink traffic after
        an idle gap is slower than in the timed loop's back-to-back calls."""
        import jax

        from jax_uccl_ep import _uccl_ep_testing

        iters, self.iters = self.iters, 1
        try:
            fn, args = make()
            for _ in range(3):  # the first traces the op, with self.iters read then
                jax.block_until_ready(fn(*args))
        finally:
            self.iters = iters
        gpus = [int(d.local_hardware_id) for d in self.mesh.devices.flat]
        for g in gpus:
            _uccl_ep_testing.nvl_start_kernel_stamps(g)
        try:
            jax.block_until_ready(fn(*args))
        finally:
            spans = [_uccl_ep_testing.nvl_stop_kernel_stamps(g) for g in gpus]
        return [{k: tuple(round(v, 1) for v in span) for k, span in gpu.items()} for gpu in spans]

    # -- jax_uccl_ep -----------------------------------------------------------------------------------------
    def fp8_inputs(self):
        """(x float8_e4m3fn [R*T, H], scales [R*T, H/128] float32): per-128-channel absmax scaling."""
        import jax.numpy as jnp
        import numpy as np

        p = self.prob
        x = self.x_host.reshape(p.ranks * p.tokens, p.hidden // FP8_BLOCK, FP8_BLOCK)
        amax = np.maximum(np.abs(x).max(-1), 1e-4)
        scales = (amax / 448.0).astype(np.float32)
        q = (x / scales[..., None]).reshape(p.ranks * p.tokens, p.hidden)
        xq = _global_array(self.mesh, self.P(self.AXIS), q.astype(jnp.float8_e4m3fn))
        sc = _global_array(self.mesh, self.P(self.AXIS), scales)
        return xq, sc

    def uccl_dispatch(self, fp8: bool = False) -> OpResult:
        p = self.prob
        name = "uccl_ep dispatch " + ("fp8" if fp8 else p.dtype)

        def make():
            import jax.numpy as jnp

            import jax_uccl_ep as ep

            cap = p.max_recv

            # The loop carries a scalar: the previous call's row count, fed into this call's top-k indices
            # (where(tok < 0, 0, idx) is idx at run time but not to the compiler). Nothing big is copied.
            def body(*arrays):
                *xs, idx, w = arrays
                x = tuple(xs) if fp8 else xs[0]

                def step(tok):
                    out = ep.dispatch(
                        x, jnp.where(tok < 0, 0, idx), w, num_experts=p.experts, axis_name=self.AXIS, capacity=cap
                    )
                    return out.num_tokens

                # (a zero that varies over the axis, as the carry)
                return looped(step, self.iters, self.unroll)(idx[0, 0] * 0)[None]

            xs = self.fp8_inputs() if fp8 else (self.x,)
            return self._smap(body, len(xs) + 2), (*xs, self.topk_idx, self.topk_weights)

        return self._run(name, make, p.exact_bytes(fp8), note=f"capacity {p.max_recv} rows")

    def uccl_dispatch_expert(self) -> OpResult:
        """dispatch(layout="expert") as the layer calls it (bf16, alignment 1, padding left unwritten, the
        default never-dropping pair buffer): the receive writing the pairs where it can (the default;
        UCCL_EP_NVL_DISPATCH_PAIRS=0 turns it off), else token rows and then the layout after them (a counting sort
        in XLA and the copy of the rows into their slots, inside the timed span)."""
        p = self.prob
        name = f"uccl_ep dispatch expert-major {p.dtype}"

        def make():
            import jax.numpy as jnp

            import jax_uccl_ep as ep

            def body(x, idx, w):
                def step(tok):
                    out = ep.dispatch(
                        x,
                        jnp.where(tok < 0, 0, idx),
                        w,
                        num_experts=p.experts,
                        axis_name=self.AXIS,
                        layout="expert",
                        zero_padding=False,
                    )
                    # One element of the pair rows feeds the carry, so XLA keeps the op that writes them (an
                    # optimization barrier over unread rows did not: the layout's copy was dropped).
                    return out.num_tokens + (out.x[0, 0] == jnp.inf).astype(out.num_tokens.dtype)

                return looped(step, self.iters, self.unroll)(idx[0, 0] * 0)[None]

            return self._smap(body, 3), (self.x, self.topk_idx, self.topk_weights)

        from jax_uccl_ep import _pairs, normal

        # The label from the decision dispatch makes for these shapes (its default, never-dropping pair buffer).
        groups, rows = p.experts // p.ranks, p.ranks * p.tokens
        capacity = _pairs.never_dropping_pairs(rows, p.topk, groups, 1)
        writes = normal._receive_writes_pairs(self.x, False, p.topk, groups, 1, capacity, rows)
        note = "the receive writes the pairs" if writes else "token rows, then the XLA layout"
        return self._run(name, make, p.exact_bytes(False), note=note)

    def uccl_combine(self) -> OpResult:
        p = self.prob
        name = f"uccl_ep combine {p.dtype}"

        def make():
            import jax
            import jax.numpy as jnp

            import jax_uccl_ep as ep

            handle_tree = []

            def dispatch_once(x, idx, w):
                out = ep.dispatch(x, idx, w, num_experts=p.experts, axis_name=self.AXIS, capacity=p.max_recv)
                leaves, tree = jax.tree.flatten(out.handle)  # a DispatchHandle, or a TwoLevelHandle's two
                handle_tree.append(tree)
                return (out.x, *leaves)

            arrays = self._smap(dispatch_once, 3)(self.x, self.topk_idx, self.topk_weights)  # one spec for all
            jax.block_until_ready(arrays)

            def body(y, *leaves):
                def step(tok):  # as in dispatch: a scalar from the last output feeds the next call's mask
                    first = jnp.logical_and(leaves[0], tok != -jnp.inf)
                    out = ep.combine(y, jax.tree.unflatten(handle_tree[0], (first, *leaves[1:])))
                    return out[0, 0].astype(jnp.float32)

                return looped(step, self.iters, self.unroll)(leaves[-1][0].astype(jnp.float32) * 0)[None]

            return self._smap(body, len(arrays)), arrays

        return self._run(name, make, p.exact_bytes(False))

    def uccl_low_latency(self, combine: bool, carried: bool = False) -> OpResult:
        """Low-latency dispatch (the FP8 cast inside the op) or combine (bfloat16 rows), max_tokens_per_rank = T;
        `carried`: the dispatch carries the router weights, so the combine sums each token's rows on the experts'
        ranks (a row per token and rank). The combine's loop starts with one dispatch (for its handle); its byte
        counts are normal mode's."""
        p = self.prob
        name = "uccl_ep LL combine bfloat16" if combine else "uccl_ep LL dispatch fp8"
        name += ", weights carried" if carried else ""

        def make():
            import jax.numpy as jnp

            import jax_uccl_ep as ep

            kw = {"num_experts": p.experts, "max_tokens_per_rank": p.tokens, "axis_name": self.AXIS}

            def dispatch_body(x, idx, w):
                def step(tok):
                    return ep.low_latency_dispatch(x, jnp.where(tok < 0, 0, idx), use_fp8=True, **kw)[1][0]

                return looped(step, self.iters, self.unroll)(idx[0, 0] * 0)[None]

            def combine_body(x, idx, w):
                recv, _, handle = ep.low_latency_dispatch(
                    x, idx, use_fp8=False, topk_weights=w if carried else None, **kw
                )

                def step(tok):
                    if carried:  # the loop's dependency through the routing (the same on every call)
                        routing = jnp.where(tok == jnp.inf, -1, idx)
                        return ep.low_latency_combine(recv, routing, None, handle)[0, 0].astype(jnp.float32)
                    return ep.low_latency_combine(recv, idx, w + tok * 0, handle)[0, 0].astype(jnp.float32)

                return looped(step, self.iters, self.unroll)(w[0, 0] * 0)[None]

            return self._smap(combine_body if combine else dispatch_body, 3), (self.x, self.topk_idx, self.topk_weights)

        return self._run(name, make, p.exact_bytes(not combine), note=f"max_tokens_per_rank {p.tokens}")

    # -- peers -----------------------------------------------------------------------------------------------
    def all_to_all(self) -> OpResult:
        import numpy as np

        p = self.prob
        c = p.capacity_per_peer
        name = f"jax.lax.all_to_all {p.dtype}"

        def make():
            import jax

            jdtype = getattr(jax.numpy, p.dtype)
            host = np.resize(self.x_host, (p.ranks * p.ranks * c, p.hidden)).reshape(p.ranks * p.ranks, c, p.hidden)
            buf = _global_array(self.mesh, self.P(self.AXIS), host.astype(np.dtype(jdtype)))

            def body(b):
                return looped(lambda v: jax.lax.all_to_all(v, self.AXIS, 0, 0, tiled=True), self.iters, self.unroll)(b)

            return self._smap(body, 1), (buf,)

        return self._run(name, make, p.padded_bytes(), note=f"padded [R, {c}, H]")

    def ragged_all_to_all(self) -> OpResult:
        import numpy as np

        p = self.prob
        name = f"jax.lax.ragged_all_to_all {p.dtype}"
        r = p.ranks

        def make():
            import jax

            jdtype = np.dtype(getattr(jax.numpy, p.dtype))
            n = p.counts.astype(np.int32)  # [src, dst]
            send_rows, recv_rows = p.max_send, p.max_recv
            operand = np.zeros((r, send_rows, p.hidden), jdtype)
            for s in range(r):  # rows sorted by destination rank, as a dispatch would pack them
                rows = np.concatenate([np.nonzero(p.in_rank[s, :, d])[0] for d in range(r)])
                operand[s, : rows.size] = self.x_host[s * p.tokens + rows].astype(jdtype)
            input_offsets = np.concatenate([np.zeros((r, 1), np.int32), np.cumsum(n, 1)[:, :-1]], 1)
            send_sizes = n
            # Where src's chunk lands in dst's output: after the chunks of lower source ranks.
            col_offsets = np.concatenate([np.zeros((1, r), np.int32), np.cumsum(n, 0)[:-1]], 0)  # [src, dst]
            output_offsets = col_offsets  # row s: offsets in each destination's output
            recv_sizes = n.T.copy()  # row d: rows from each source
            spec = self.P(self.AXIS)
            args = [
                _global_array(self.mesh, spec, operand.reshape(r * send_rows, p.hidden)),
                _global_array(self.mesh, spec, np.zeros((r * recv_rows, p.hidden), jdtype)),
                *[
                    _global_array(self.mesh, spec, a.reshape(-1).astype(np.int32))
                    for a in (input_offsets, send_sizes, output_offsets, recv_sizes)
                ],
            ]

            def body(operand, output, io, ss, oo, rs):
                def step(out):
                    return jax.lax.ragged_all_to_all(operand, out, io, ss, oo, rs, axis_name=self.AXIS)

                return looped(step, self.iters, self.unroll)(output)

            return self._smap(body, 6), tuple(args)

        return self._run(name, make, p.exact_bytes(False), note="exact ragged rows")

    def op(self, name: str) -> OpResult:
        """Runs one op by name: 'dispatch', 'dispatch_fp8', 'dispatch_expert', 'combine', 'll_dispatch_fp8',
        'll_combine', 'll_combine_carried', 'all_to_all', 'ragged_all_to_all'."""
        table = {
            "dispatch": lambda: self.uccl_dispatch(False),
            "dispatch_fp8": lambda: self.uccl_dispatch(True),
            "dispatch_expert": self.uccl_dispatch_expert,
            "combine": self.uccl_combine,
            "ll_dispatch_fp8": lambda: self.uccl_low_latency(False),
            "ll_combine": lambda: self.uccl_low_latency(True),
            "ll_combine_carried": lambda: self.uccl_low_latency(True, carried=True),
            "all_to_all": self.all_to_all,
            "ragged_all_to_all": self.ragged_all_to_all,
        }
        return table[name]()


def run_ep_ops(prob: EPProblem, ops: Sequence[str], *, iters: int, repeats: int, devices=None) -> list[dict]:
    """Runs the named ops (see EPBench.op)."""
    bench = EPBench(prob, devices, iters=iters, repeats=repeats)
    return [bench.op(o).as_dict() for o in ops]


def merge_rank_results(per_rank: list[list[dict]]) -> list[dict]:
    """Combines the results of several processes: the slowest rank's median is the op's time."""
    merged = []
    for rows in zip(*per_rank):
        base = dict(rows[0])
        errors = [r["error"] for r in rows if r["error"]]
        if errors:
            base["error"], base["timing"] = errors[0], None
        else:
            slowest = max(rows, key=lambda r: r["timing"]["median_s"])
            base["timing"] = dict(slowest["timing"])
            base["timing"]["per_rank_median_s"] = [r["timing"]["median_s"] for r in rows]
        merged.append(base)
    return merged


def op_table_rows(results: list[dict], mode: str) -> list[list[str]]:
    rows = []
    for r in results:
        if r["error"]:
            rows.append(
                [
                    r["name"],
                    mode,
                    "n/a",
                    "n/a",
                    "n/a",
                    "n/a",
                    fmt_bytes(r["bytes_deepep"]),
                    f"n/a ({short_error(r['error'], 100)})",
                ]
            )
            continue
        t = r["timing"]["median_s"]
        rows.append(
            [
                r["name"],
                mode,
                fmt_time(t),
                fmt_time(r["timing"]["min_s"]),
                fmt_gbps(gbps(r["bytes_deepep"], t)),
                fmt_gbps(gbps(r["bytes_remote"], t)),
                fmt_bytes(r["bytes_deepep"]),
                r.get("note", ""),
            ]
        )
    return rows


OP_HEADERS = ["op", "mode", "time/call", "min", "GB/s DeepEP", "GB/s remote", "bytes/rank", "note"]
