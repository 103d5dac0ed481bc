"""Low-latency mode: low_latency_dispatch (FP8) and low_latency_combine (BF16) beside jax.lax.all_to_all.

Decode sizes by default: 128 tokens per rank, hidden 7168, top-8 of 256 experts, random routing. Every op runs
`--iters` times inside one jit (a fori_loop in a shard_map; each call's output feeds the next call's input) and
the time is the median over `--repeats` of (call time / iters). Dispatch includes the FP8 cast (in our kernel); combine
is timed alone on fixed expert outputs. all_to_all moves the static equivalent of the LL payload: [R, N * K, H]
BF16 rows per rank (every destination could receive up to N * K rows).
Reference on 2xH200 (DeepEP v1 LL): dispatch 28.4 us, combine 39.8 us (the project's design notes, not in this
repository).

    python bench/low_latency.py                 # the devices JAX finds
    python bench/low_latency.py --cpu --ranks 2 --tokens 32 --hidden 512 --experts 16
    UCCL_EP_KERNEL_TIMING=2 python bench/low_latency.py    # GPUs: also where each kernel spends its time
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (= max_tokens_per_rank)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=None)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--fori", action="store_true", help="loop with lax.fori_loop instead of unrolling the calls")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cpu", action="store_true", help="CPU devices (JAX_NUM_CPU_DEVICES=--ranks)")
    ap.add_argument("--out", default=None, help="write the timings as JSON here")
    ap.add_argument(
        "--cupti",
        action="store_true",
        help="GPUs: also time our kernels with CUPTI through torch.profiler (needs torch)",
    )
    args = ap.parse_args(argv)
    # GPU: events around our kernels (kernel_spans); 2 also stamps each kernel's phases (kernel_phases)
    os.environ.setdefault("UCCL_EP_KERNEL_TIMING", "1")
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["JAX_NUM_CPU_DEVICES"] = str(args.ranks or 2)
    elif args.ranks:  # the runtime spans every visible GPU: show it only these (the buffer is sized for R of them)
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(args.ranks)))

    import common
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_uccl_ep as ep

    devices = jax.devices()[: args.ranks] if args.ranks else jax.devices()
    r, t, h, k, e = len(devices), args.tokens, args.hidden, args.topk, args.experts
    mesh = Mesh(np.array(devices), ("ep",))
    rng = np.random.default_rng(0)
    idx = np.stack([np.stack([rng.choice(e, k, replace=False) for _ in range(t)]) for _ in range(r)]).astype(np.int32)
    sharding = NamedSharding(mesh, P("ep"))

    def put(a):
        return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])

    x = put(rng.standard_normal((r, t, h)).astype(jnp.bfloat16))
    topk_idx, weights = put(idx), put(rng.random((r, t, k)).astype(np.float32))
    header = common.run_header(f"{r}x {devices[0].device_kind}")
    gpu = devices[0].platform == "gpu"
    # Sized for the largest rows timed here (BF16 dispatch); FP8 dispatch + BF16 combine alone need the first.
    ll_need = ep.low_latency_buffer_bytes(t, h, num_ranks=r, num_experts=e, topk=k) if gpu else None
    ll_bytes = ep.low_latency_buffer_bytes(t, h, num_ranks=r, num_experts=e, topk=k, fp8=False) if gpu else None
    ep.initialize(nvl_buffer_bytes=16 << 20, low_latency_buffer_bytes=ll_bytes)
    local = e // r
    unroll = not args.fori
    y_rows = jax.make_array_from_callback(
        (r * local, r * t, h),
        sharding,  # fixed expert outputs, made once
        lambda i: np.ones((local, r * t, h), jnp.bfloat16),
    )
    kw = dict(num_experts=e, max_tokens_per_rank=t, axis_name="ep")

    def smap(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))

    def routing(i, tok):  # the previous call's output enters the next call's routing (nothing loop-invariant)
        return jnp.where(tok < 0, 0, i[0])

    def busy_zero(like):
        """0 of like's dtype, after ~ms of GPU matmuls: the host enqueues the timed calls meanwhile, so they run
        back to back on the GPUs instead of at the host's launch pace (kernel spans then exclude launch skew)."""
        if not gpu:
            return like * 0
        m = jnp.full((8192, 8192), 0.5, jnp.bfloat16) + like.astype(jnp.bfloat16)
        for _ in range(3):
            m = (m @ m) * jnp.bfloat16(1e-4)
        return like * 0 + (m[0, 0] * 0).astype(like.dtype)

    def ll_dispatch(use_fp8):
        def body(x, i, w):
            def step(tok):
                _, count, _ = ep.low_latency_dispatch(x[0], routing(i, tok), use_fp8=use_fp8, **kw)
                return count[0]

            return common.looped(step, args.iters, unroll)(busy_zero(i[0, 0, 0]))[None]

        return body

    def ll_combine(x, i, w, y):
        _, _, handle = ep.low_latency_dispatch(x[0], i[0], **kw)

        def step(tok):
            out = ep.low_latency_combine(y, i[0], w[0] + tok * 0, handle)
            return out[0, 0].astype(jnp.float32)

        return common.looped(step, args.iters, unroll)(busy_zero(w[0, 0, 0]))[None]

    def ll_combine_carried(x, i, w, y):  # the dispatch carried the weights: a row per token and rank comes back
        _, _, handle = ep.low_latency_dispatch(x[0], i[0], topk_weights=w[0], **kw)

        def step(tok):
            out = ep.low_latency_combine(y, jnp.where(tok == jnp.inf, -1, i[0]), None, handle)
            return out[0, 0].astype(jnp.float32)

        return common.looped(step, args.iters, unroll)(busy_zero(w[0, 0, 0]))[None]

    def ll_roundtrip(x, i, w, y):
        def step(tok):
            _, count, handle = ep.low_latency_dispatch(x[0], routing(i, tok), **kw)
            return ep.low_latency_combine(y, i[0], w[0], handle)[0, 0].astype(jnp.int32) * 0 + count[0]

        return common.looped(step, args.iters, unroll)(busy_zero(i[0, 0, 0]))[None]

    def all_to_all(x, i, w):
        def step(buf):
            return jax.lax.all_to_all(buf, "ep", 0, 0, tiled=True)

        buf = jnp.zeros((r * t * k, h), jnp.bfloat16) + x[0, :1] + busy_zero(x[0, 0, 0])
        return common.looped(step, args.iters, unroll)(buf)[:1, :1][None]

    # One fused kernel per op, or its two launches (split calls, UCCL_EP_LL_FUSED=0)
    d = ["low_latency_dispatch", "low_latency_dispatch send", "low_latency_dispatch receive"]
    c = ["low_latency_combine", "low_latency_combine send", "low_latency_combine receive"]
    # DeepEP's reference figures were taken on 2xH200 at these sizes: no ratio for other R or sizes.
    ref = r == 2 and gpu and (t, h, k, e) == (128, 7168, 8, 256)
    ops = (
        ("uccl_ep LL dispatch fp8", ll_dispatch(True), 28.4e-6 if ref else None, d),
        ("uccl_ep LL dispatch bf16", ll_dispatch(False), None, d),
        ("uccl_ep LL combine bf16", ll_combine, 39.8e-6 if ref else None, c),
        ("uccl_ep LL combine bf16, weights carried", ll_combine_carried, None, c),
        ("uccl_ep LL dispatch fp8 + combine", ll_roundtrip, 68.2e-6 if ref else None, d + c),
        ("jax.lax.all_to_all bf16 [R, N*K, H]", all_to_all, None, []),
    )
    rows, results = [], {}
    for name, body, deepep, labels in ops:
        try:
            takes_y = body in (ll_combine, ll_combine_carried, ll_roundtrip)
            inputs = (x, topk_idx, weights, y_rows) if takes_y else (x, topk_idx, weights)
            kernel_spans(gpu)  # drop earlier spans
            fn = smap(body)
            tm = common.time_jitted(fn, inputs, iters=args.iters, repeats=args.repeats)
            spans = {k: v for k, v in kernel_spans(gpu).items() if k in labels}
            phases = kernel_phases(gpu)
            cupti = {}
            for _ in range(2 if args.cupti else 0):  # the first profiled call pays CUPTI's start
                cupti = cupti_kernel_us(lambda fn=fn, inputs=inputs: jax.block_until_ready(fn(*inputs)), labels)
            results[name] = dict(tm.as_dict(), kernel_spans_us=spans, kernel_phases_us=phases, cupti_us=cupti)
            if phases:
                print(f"# {name}: phases of the last call (block 0, us): {phases}")
            span_s = sum(spans.values()) * 1e-6 if spans else None
            ratio = f"{deepep / span_s:.2f}x" if deepep and span_s else ""
            cupti_s = sum(cupti.values()) * 1e-6 if cupti and "error" not in cupti else None
            rows.append(
                [
                    name,
                    common.fmt_time(tm.median_s),
                    common.fmt_time(span_s),
                    " + ".join(f"{v:.1f}" for v in spans.values()),
                    common.fmt_time(cupti_s) if cupti_s else "",
                    common.fmt_time(deepep) if deepep else "",
                    ratio,
                    f"{deepep / cupti_s:.2f}x" if deepep and cupti_s else "",
                ]
            )
        except Exception as exc:  # noqa: BLE001
            results[name] = {"error": str(exc)[:500]}
            rows.append([name, "n/a", common.short_error(exc, 60), "", "", "", "", ""])
    held = ep.buffer_bytes_held()
    ep.check_errors()
    ep.shutdown()
    print(f"# {header}")
    if gpu:
        print(
            f"# low-latency buffer per GPU: {common.fmt_bytes(ll_need)} for FP8 dispatch + BF16 combine, "
            f"{common.fmt_bytes(ll_bytes)} with BF16 dispatch (DeepEP v1 LL at EP2 for this size: 1.9 GB); "
            f"held per GPU (normal, LL): {held.get(0)}; blocks: 128 per send or fused kernel, "
            f"{_uccl_ep_blocks()} per receive kernel"
        )
    print(
        "# time/call: jitted calls end to end (host launch and a ~ms matmul prologue on GPUs included, divided by "
        "the calls); kernels: median GPU span of our kernels, one fused kernel per op or send + receive (waiting "
        "for the peer included; the FP8 cast runs inside our dispatch kernel, as DeepEP's does)"
    )
    if args.cupti:
        print(
            "# CUPTI: median device time per call of our kernels, from torch.profiler (CUPTI kernel records, how "
            "DeepEP's test times its kernels); no launch gaps or events"
        )
    common.print_table(
        ["op", "time/call", "kernels", "spans us", "CUPTI", "DeepEP", "DeepEP/kernels", "DeepEP/CUPTI"],
        rows,
        title=f"low-latency mode on {r}x {devices[0].device_kind}: N={t}/rank, H={h}, top-{k} of {e}, "
        f"{'fori_loop' if args.fori else 'unrolled'} x{args.iters}",
    )
    if args.out:
        common.write_json(args.out, {"header": header, "results": results, "low_latency_buffer_bytes": ll_bytes})
    return 0


def kernel_spans(gpu: bool) -> dict:
    """Median span (microseconds) of each kind of op on local GPU 0 since the last call."""
    if not gpu:
        return {}
    import statistics

    from jax_uccl_ep import _uccl_ep_testing

    spans: dict = {}
    for label, us in _uccl_ep_testing.nvl_kernel_times()[0]:
        spans.setdefault(label, []).append(us)
    return {k: statistics.median(v) for k, v in spans.items()}


PHASES = {  # kernel: names of the intervals between its stamps (kernels/nvl/low_latency.cu)
    0: ("dispatch send", ["routing", "copies", "announce"]),
    1: ("dispatch receive", ["wait", "counts", "copies", "padding"]),
    2: ("combine send", ["layout", "copies", "announce"]),
    3: ("combine receive", ["slots", "wait", "reduce"]),
}


def kernel_phases(gpu: bool) -> dict:
    """With UCCL_EP_KERNEL_TIMING=2: each low-latency kernel's phase lengths (us) in its last launch on GPU 0."""
    if not gpu:
        return {}
    from jax_uccl_ep import _uccl_ep_testing

    stamps = _uccl_ep_testing.nvl_kernel_phases()[0]
    if not stamps:  # UCCL_EP_KERNEL_TIMING is not 2
        return {}
    out = {}
    for k, (kernel, names) in PHASES.items():
        ts = stamps[k * 8 : k * 8 + len(names) + 1]
        if all(t > 0 for t in ts):
            out[kernel] = {n: round(b - a, 2) for n, a, b in zip(names, ts, ts[1:])}
    return out


# Kernel names of each op label (kernels/nvl/low_latency.cu), as CUPTI reports them (demangled).
CUPTI_KERNELS = {"low_latency_dispatch": "DispatchPhases", "low_latency_combine": "CombinePhases"}


def cupti_kernel_us(call, labels) -> dict:
    """Median duration (us) on GPU 0 of each of our low-latency kernels (per template instance: fused, or send and
    receive) that `call` launches and `labels` name; {"error": ...} without torch."""
    import statistics

    import common

    try:
        activity = common.cupti_activity(call)
    except Exception as exc:  # noqa: BLE001
        return {"error": common.short_error(exc, 120)}
    wanted = {CUPTI_KERNELS[label] for label in labels if label in CUPTI_KERNELS}
    durations: dict = {}
    for name, us, _ in activity:
        if "uccl_ep" in name and any(w in name for w in wanted):
            durations.setdefault(name, []).append(us)
    return {k: statistics.median(v) for k, v in durations.items()}


def _uccl_ep_blocks() -> int:
    from jax_uccl_ep import _uccl_ep_testing

    return int(_uccl_ep_testing.nvl_low_latency_blocks())


if __name__ == "__main__":
    raise SystemExit(main())
