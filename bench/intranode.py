"""Intranode normal-mode benchmark for one GPU host (2x H200 first): jax_uccl_ep dispatch/combine beside
jax.lax.all_to_all, jax.lax.ragged_all_to_all and NCCL all_to_all_single (torch.distributed), in one run.

Defaults are DeepSeek-V3's: 4096 tokens per rank, hidden 7168, top-8 of 256 experts, random routing (uniform top-k,
random normal x), BF16 payload. Measured:
  - jax_uccl_ep dispatch BF16, dispatch FP8 (x float8_e4m3fn + scales [T, H/128] float32), combine BF16 — "n/a"
    rows (with the reason) where the package or its ops are not available on this platform yet; with --ops
    dispatch_expert, dispatch(layout="expert") as the layer calls it (the pair writer against token rows and the XLA
    layout: run once as it is and once with UCCL_EP_NVL_DISPATCH_PAIRS=0);
  - jax.lax.all_to_all on the padded [R, capacity_per_peer, H] payload (capacity = the largest src->dst count);
  - jax.lax.ragged_all_to_all on the exact rows (those dispatch moves);
  - NCCL all_to_all_single, padded and ragged (split sizes = the same counts), BF16; BF16 ragged after an exchange
    of the split sizes that the host reads (what a torch MoE must run: its sizes come from routing); the FP8 row bytes
    (H + 4*H/128 bytes per token, as uint8) ragged — one process per GPU via torch.multiprocessing, timed with
    torch.cuda.Event over --iters calls, median of --repeats; NCCL_NVLS_ENABLE=0. Runs before JAX takes the GPUs.
JAX ops run --iters times inside one jit (a straight line of calls in jax.shard_map over all R devices of this
process, as NCCL's calls run back to back; --loop: a fori_loop instead, whose bookkeeping between calls cost XLA's
all_to_all ~64 us a call on 4x H200, bench/RESULTS.md); time = median over --repeats of wall time / iters after
block_until_ready (JAX exposes no device events), which carries the jit call's own cost (~20-45 us a call at 30
calls on 4x H200) that NCCL's event timing does not; with --cupti (or --trace) each op's note adds GPU 0's device
span per call (first kernel's start to the last one's end over one profiled call, / iters), the figure to set
beside NCCL's. GB/s per rank, mean over ranks: "DeepEP" = all received token
bytes incl. the rank's own (DeepEP's test formula: x only, FP8 = (1 + 4/128)/2 of BF16), "remote" = bytes from
other ranks (NVLink).

    python bench/intranode.py --out $OUT/intranode.json               # on the GPU host
    python bench/intranode.py --sms 8,12,16,24,32 --send-sms 0,13,14  # budgets, and splits beside the default
    python bench/intranode.py --sms 8,24 --pulls 0,1                  # sent and pulled ops at each budget
    python bench/intranode.py --cupti --trace $OUT/trace                # device spans; Chrome traces of each op
    python bench/intranode.py --cpu --tokens 64 --hidden 256          # smoke test on CPU devices
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import against_nccl  # noqa: E402
import common  # noqa: E402

# Reference figures from the project's design notes (not in this repository; bench/RESULTS.md lists them beside
# the runs): 2xH200, 2026-11-21, DeepSeek-V3 sizes.
REFERENCE_US = {
    "DeepEP v1 dispatch fp8": 245.0,
    "DeepEP v1 dispatch bfloat16": 345.0,
    "DeepEP v1 combine bfloat16": 408.0,
    "NCCL all-to-all (design notes)": 256.0,
    "JAX all_to_all (design notes)": 558.0,
}
DEEPSEEK = dict(tokens=4096, hidden=7168, topk=8, experts=256)
HEADERS = ["op", "impl", "time/call", "min", "GB/s DeepEP", "GB/s remote", "SMs", "note"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------------------
# NCCL through torch.distributed
# ------------------------------------------------------------------------------------------------------------


def torch_status(ranks: int) -> str | None:
    """None if torch with CUDA, NCCL and `ranks` GPUs is usable, else why not (no CUDA context is created)."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:
        return f"torch not importable: {common.short_error(e, 60)}"
    if not torch.cuda.is_available():
        return "torch has no CUDA"
    if not dist.is_available() or not dist.is_nccl_available():
        return "torch.distributed without NCCL"
    if torch.cuda.device_count() < ranks:
        return f"{torch.cuda.device_count()} GPUs < {ranks} ranks"
    return None


def nccl_worker(rank: int, world: int, port: int, cfg: dict, outdir: str) -> None:
    """One process per GPU: times all_to_all_single on the padded and the ragged payloads."""
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev)
    counts = np.array(cfg["counts"], dtype=np.int64)  # [src, dst]
    h, cap, iters, repeats = cfg["hidden"], cfg["capacity_per_peer"], cfg["iters"], cfg["repeats"]
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg["dtype"]]
    fp8_row = h + 4 * (h // 128)
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}

    results = {}
    try:
        send = torch.randn(world * cap, h, device=dev, generator=gen).to(dtype)
        recv = torch.empty_like(send)
        results["padded"] = timed(lambda: dist.all_to_all_single(recv, send))
        del send, recv
        in_splits = [int(c) for c in counts[rank]]
        out_splits = [int(c) for c in counts[:, rank]]
        send = torch.randn(sum(in_splits), h, device=dev, generator=gen).to(dtype)
        recv = torch.empty(sum(out_splits), h, device=dev, dtype=dtype)
        results["ragged"] = timed(lambda: dist.all_to_all_single(recv, send, out_splits, in_splits))
        # What a torch MoE runs for the same rows: the split sizes are known only on the GPU after routing, so they
        # are exchanged first and read back to the host, which all_to_all_single needs them on.
        count_send = torch.tensor(in_splits, device=dev, dtype=torch.int64)
        count_recv = torch.empty_like(count_send)

        def with_counts() -> None:
            dist.all_to_all_single(count_recv, count_send)
            dist.all_to_all_single(recv, send, count_recv.tolist(), in_splits)

        results["ragged_counted"] = timed(with_counts)
        del send, recv
        send = torch.randint(0, 255, (sum(in_splits), fp8_row), device=dev, dtype=torch.uint8, generator=gen)
        recv = torch.empty(sum(out_splits), fp8_row, device=dev, dtype=torch.uint8)
        results["ragged_fp8"] = timed(lambda: dist.all_to_all_single(recv, send, out_splits, in_splits))
    except Exception as e:
        results["error"] = common.short_error(e, 300)
    results["device"] = torch.cuda.get_device_name(dev)
    results["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def run_nccl(prob: common.EPProblem, iters: int, repeats: int, timeout_s: float) -> dict:
    import torch.multiprocessing as tmp

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast on the lent machines
    cfg = {
        "counts": prob.counts.tolist(),
        "hidden": prob.hidden,
        "capacity_per_peer": prob.capacity_per_peer,
        "iters": iters,
        "repeats": repeats,
        "dtype": prob.dtype,
    }
    with tempfile.TemporaryDirectory(prefix="uccl_ep_nccl_") as outdir:
        ctx = tmp.spawn(nccl_worker, args=(prob.ranks, free_port(), cfg, outdir), nprocs=prob.ranks, join=False)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"NCCL workers did not finish in {timeout_s:.0f} s")
        per_rank = [json.load(open(os.path.join(outdir, f"rank{r}.json"))) for r in range(prob.ranks)]
    return {"per_rank": per_rank}


def nccl_results(prob: common.EPProblem, nccl: dict | None, reason: str | None) -> list[common.OpResult]:
    specs = [
        (
            "padded",
            f"NCCL all_to_all_single {prob.dtype} padded",
            prob.padded_bytes(),
            f"[R*{prob.capacity_per_peer}, H]",
        ),
        ("ragged", f"NCCL all_to_all_single {prob.dtype} ragged", prob.exact_bytes(False), "exact split sizes"),
        (
            "ragged_counted",
            f"NCCL split sizes + all_to_all_single {prob.dtype}",
            prob.exact_bytes(False),
            "the [R] sizes exchanged and read on the host first",
        ),
        (
            "ragged_fp8",
            "NCCL all_to_all_single fp8 rows ragged",
            prob.exact_bytes(True),
            "uint8 rows of H + H/32 bytes",
        ),
    ]
    out = []
    for key, name, nbytes, note in specs:
        res = common.OpResult(
            name, bytes_deepep=nbytes[0], bytes_remote=nbytes[1], note=note, extra={"impl": "torch/NCCL"}
        )
        if nccl is None:
            res.error = reason or "not run"
        else:
            ranks = nccl["per_rank"]
            err = next((r["error"] for r in ranks if "error" in r), None)
            if err or any(key not in r for r in ranks):
                res.error = err or "missing"
            else:
                slowest = max(ranks, key=lambda r: r[key]["median_s"])[key]
                res.timing = common.Timing(slowest["median_s"], slowest["min_s"], slowest["max_s"], 0, 0)
                res.note += f"; NCCL {ranks[0].get('nccl', '?')}"
        out.append(res)
    return out


# ------------------------------------------------------------------------------------------------------------
# JAX
# ------------------------------------------------------------------------------------------------------------

UCCL_OPS = ("dispatch", "dispatch_fp8", "dispatch_expert", "combine")


def sms_used(pulled: bool = False) -> str:
    """SMs the jax_uccl_ep kernels occupy at once (the SM budget, UCCL_EP_NUM_SMS): "send+receive" blocks of
    one block per SM, and how rows move (bulk copies or SM stores); with `pulled`, every block receives."""
    try:
        from jax_uccl_ep import _uccl_ep_testing

        n = int(_uccl_ep_testing.nvl_num_sms())
        send = int(_uccl_ep_testing.nvl_send_blocks())
        copies = "bulk" if _uccl_ep_testing.nvl_bulk_copies() else "stores"
    except Exception:
        return "?"
    return f"{n} pulled" if pulled else f"{send}+{n - send} {copies}"


def run_jax(
    prob: common.EPProblem,
    ops: list[str],
    iters: int,
    repeats: int,
    cupti: bool = False,
    budgets: list[tuple[int, int]] | None = None,
    unroll: bool = False,
    trace_dir: str | None = None,
    pulls: list[bool] | None = None,
    phases: bool = False,
) -> tuple[list[common.OpResult], dict]:
    """The XLA ops once, and jax_uccl_ep's at each (SM budget, send blocks of it; 0: the default split) in
    `budgets` (default: the environment's), each sent and or pulled as `pulls` says (default: the environment's);
    with `trace_dir`, each op's timeline as a Chrome trace there."""
    import jax

    devices = jax.devices()[: prob.ranks]
    info = {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "jax": jax.__version__,
        "num_devices": len(jax.devices()),
    }
    if len(devices) < prob.ranks:
        raise SystemExit(f"{len(devices)} JAX devices < --ranks {prob.ranks}")
    bench = common.EPBench(
        prob, devices, iters=iters, repeats=repeats, cupti=cupti, unroll=unroll, trace_dir=trace_dir, phases=phases
    )
    results = []

    def run_op(op: str) -> common.OpResult:
        t0 = time.perf_counter()
        res = bench.op(op)
        print(
            f"# {res.name}: {'error' if res.error else common.fmt_time(res.timing.median_s)} "
            f"({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        if "cupti_us_per_call" in res.extra:
            shown = {k[:90]: v for k, v in res.extra["cupti_us_per_call"].items()}  # names are long templates
            print(f"#   device time per call on GPU 0 (us, CUPTI): {shown}", flush=True)
            span = res.extra.get("device_span_us_per_call")
            if span:
                print(f"#   GPU 0 span per call (first start to last end / calls): {span:.1f} us", flush=True)
                res.note = (res.note + "; " if res.note else "") + f"GPU 0 span {span:.1f} us/call"
        for g, gpu in enumerate(res.extra.get("phases_us", [])):
            shown = ", ".join(f"{k} +{a:.1f} for {n:.1f}" for k, (a, n) in sorted(gpu.items(), key=lambda kv: kv[1]))
            print(f"#   phases on GPU {g}, one call alone (us): {shown}", flush=True)
        return res

    uccl_ops = [o for o in ops if o in UCCL_OPS]
    runs = [(b, p) for b in budgets or [None] for p in pulls or [None]]
    for budget, pull in runs if uccl_ops else []:
        if budget is not None:
            os.environ["UCCL_EP_NUM_SMS"], os.environ["UCCL_EP_NUM_SEND_SMS"] = str(budget[0]), str(budget[1])
        if pull is not None:
            for name in ("UCCL_EP_NVL_PULL_DISPATCH", "UCCL_EP_NVL_PULL_COMBINE"):
                os.environ[name] = "1" if pull else "0"
        uccl_error = None
        try:
            common.set_uccl_env_defaults(prob, devices[0].platform)
            import jax_uccl_ep as ep

            if devices[0].platform == "gpu":
                # The NVLink buffer sized from the shapes, and reported: DeepEP's users meet ~2-3 GB per GPU.
                nbytes = ep.nvl_buffer_bytes(
                    prob.tokens, prob.hidden, num_ranks=len(jax.devices()), topk=prob.topk, dtype=prob.dtype
                )
                info["nvl_buffer_bytes"] = nbytes
                print(f"# NVLink buffer per GPU: {nbytes / 2**20:.1f} MiB", flush=True)
                ep.initialize(nvl_buffer_bytes=nbytes)
            else:
                ep.initialize()
            info["jax_uccl_ep"] = getattr(ep, "__version__", "?")
        except BaseException as e:  # the package may not be built for this platform yet
            if isinstance(e, KeyboardInterrupt):
                raise
            uccl_error = f"jax_uccl_ep unavailable: {common.short_error(e, 200)}"
        # The environment's setting where --pulls is not given (pulled by default); dispatch's names the row.
        pulled = bool(pull) if pull is not None else not uccl_error and ep.Config.from_env().nvl_pull_dispatch
        sms = sms_used(pulled and devices[0].platform == "gpu")
        for op in uccl_ops:
            if uccl_error:
                name = {
                    "dispatch": f"uccl_ep dispatch {prob.dtype}",
                    "dispatch_fp8": "uccl_ep dispatch fp8",
                    "dispatch_expert": f"uccl_ep dispatch expert-major {prob.dtype}",
                    "combine": f"uccl_ep combine {prob.dtype}",
                }[op]
                nbytes = prob.exact_bytes(op == "dispatch_fp8")
                res = common.OpResult(name, error=uccl_error, bytes_deepep=nbytes[0], bytes_remote=nbytes[1])
            else:
                res = run_op(op)
            res.extra["impl"] = "jax_uccl_ep"
            res.extra["sms"] = sms
            results.append(res)
        if uccl_error is None:
            ep.shutdown()
    bench.phases = False  # the stamps are our kernels'
    for op in ops:
        if op not in UCCL_OPS:
            res = run_op(op)
            res.extra.setdefault("impl", "XLA")
            results.append(res)
    return results, info


# ------------------------------------------------------------------------------------------------------------


def rows_of(results: list[common.OpResult]) -> list[list[str]]:
    rows = []
    for r in results:
        impl = r.extra.get("impl", "")
        s = r.extra.get("sms", "?")
        if r.error or r.timing is None:
            rows.append([r.name, impl, "n/a", "n/a", "n/a", "n/a", s, f"n/a ({common.short_error(r.error or '', 90)})"])
            continue
        t = r.timing.median_s
        rows.append(
            [
                r.name,
                impl,
                common.fmt_time(t),
                common.fmt_time(r.timing.min_s),
                common.fmt_gbps(common.gbps(r.bytes_deepep, t)),
                common.fmt_gbps(common.gbps(r.bytes_remote, t)),
                s,
                r.note,
            ]
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=DEEPSEEK["tokens"], help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=DEEPSEEK["hidden"])
    ap.add_argument("--topk", type=int, default=DEEPSEEK["topk"])
    ap.add_argument("--experts", type=int, default=DEEPSEEK["experts"])
    ap.add_argument("--ranks", type=int, default=None, help="GPUs (default: every local device, or 2 with --cpu)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--ops", default="dispatch,dispatch_fp8,combine,all_to_all,ragged_all_to_all")
    ap.add_argument("--iters", type=int, default=50, help="calls per timed loop")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="CPU devices (smoke test); skips NCCL")
    ap.add_argument("--no-torch", action="store_true", help="skip the NCCL rows")
    ap.add_argument("--torch-timeout", type=float, default=300.0)
    ap.add_argument(
        "--loop",
        action="store_true",
        help="the JAX ops' timed calls as a fori_loop in the jit rather than a straight line (the runs before "
        "2026-11-27 were looped)",
    )
    ap.add_argument(
        "--cupti",
        action="store_true",
        help="also list each op's kernels and copies per call on GPU 0 (CUPTI through torch.profiler)",
    )
    ap.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="write each op's profiled calls as a Chrome trace (every GPU's kernels, the host's CUDA calls) into DIR "
        "(implies --cupti; a file per op and SM budget)",
    )
    ap.add_argument(
        "--sms",
        default=None,
        help="comma-separated SM budgets (send + receive blocks) to sweep jax_uccl_ep's ops over, e.g. "
        "8,12,16,24,32 (default: UCCL_EP_NUM_SMS, else 24)",
    )
    ap.add_argument(
        "--send-sms",
        default="0",
        help="comma-separated send blocks of each budget, e.g. 12,13,14 to compare splits of 24 (0: the default "
        "split; a value not below a budget is skipped for it)",
    )
    ap.add_argument(
        "--pulls",
        default=None,
        help="comma-separated 0/1: jax_uccl_ep's ops sent (0) and/or pulled (1: UCCL_EP_NVL_PULL_DISPATCH=1 and "
        "UCCL_EP_NVL_PULL_COMBINE=1, every block of the budget receiving, one process driving every GPU) at each "
        "budget (default: the environment's)",
    )
    ap.add_argument(
        "--rings",
        default=None,
        help="lag:stages[:combine[:producers[:rows[:one_fence]]]] of the bulk kernels' rings, by the testing hook "
        "(bench/loopback.py); 0 is each one's default, and one_fence 2 makes the words to several members a release "
        "each",
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help="also one call of each jax_uccl_ep op alone with the NVLink kernels' phase stamps on: each GPU's "
        "routing wait, scan, receive and acknowledgements (us, its own clock)",
    )
    ap.add_argument("--out", default="intranode.json", help="JSON of the results")
    args = ap.parse_args(argv)

    if args.cpu:
        ranks = args.ranks or 2
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["JAX_NUM_CPU_DEVICES"] = str(ranks)
    else:
        ranks = args.ranks
        if ranks is None:
            try:
                import torch

                ranks = torch.cuda.device_count() if torch.cuda.is_available() else 0
            except Exception:
                ranks = 0
            if ranks < 2:  # ask JAX (this starts its backend; fine, torch is not used then)
                import jax

                ranks = len(jax.devices())
    ops = [o for o in args.ops.split(",") if o]
    prob = common.EPProblem(ranks, args.tokens, args.hidden, args.topk, args.experts, args.dtype, seed=args.seed)
    header = common.run_header("CPU devices (smoke test)" if args.cpu else "GPU")
    print(f"# {header['date']}  {header['command']}  (load average {header['load_avg_1m']})", flush=True)
    print(f"# problem: {prob.describe()}", flush=True)

    results: list[common.OpResult] = []
    record = {"header": header, "problem": prob.describe(), "args": vars(args)}
    # NCCL first: the torch workers must have the GPUs before JAX preallocates their memory.
    reason = "--cpu" if args.cpu else "--no-torch" if args.no_torch else torch_status(ranks)
    nccl = None
    if reason is None:
        try:
            t0 = time.perf_counter()
            nccl = run_nccl(prob, args.iters, args.repeats, args.torch_timeout)
            print(f"# NCCL part: {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:
            reason = common.short_error(e, 200)
            print(f"# NCCL part failed: {e}", file=sys.stderr, flush=True)
    record["nccl"] = nccl

    sends = [int(s) for s in args.send_sms.split(",") if s]
    if args.sms or sends != [0]:
        sms = [int(b) for b in args.sms.split(",") if b] if args.sms else [int(os.environ.get("UCCL_EP_NUM_SMS", 24))]
        budgets = [(b, s) for b in sms for s in sends if s < b]
    else:
        budgets = None
    pull_values = [p.strip() for p in args.pulls.split(",") if p.strip()] if args.pulls else []
    if not set(pull_values) <= {"0", "1"}:
        raise SystemExit(f"--pulls takes 0 and/or 1, got {args.pulls!r}")
    pulls = [p == "1" for p in pull_values] or None
    if args.rings and not args.cpu:
        from jax_uccl_ep import _uccl_ep_testing

        _uccl_ep_testing.nvl_set_bulk_tuning(*common.bulk_tuning(args.rings))
    jax_results, info = run_jax(
        prob,
        ops,
        args.iters,
        args.repeats,
        cupti=args.cupti,
        budgets=budgets,
        unroll=not args.loop,
        trace_dir=args.trace,
        pulls=pulls,
        phases=args.phases and not args.cpu,
    )
    record["jax"] = info
    results += jax_results
    results += nccl_results(prob, nccl, reason)
    record["results"] = [r.as_dict() for r in results]
    for r in record["results"]:
        t = r["timing"]["median_s"] if r["timing"] else None
        r["gbps_deepep"], r["gbps_remote"] = common.gbps(r["bytes_deepep"], t), common.gbps(r["bytes_remote"], t)
    rows = rows_of(results)
    is_deepseek = all(getattr(args, k) == v for k, v in DEEPSEEK.items()) and ranks == 2 and not args.cpu
    if is_deepseek:
        for name, us in REFERENCE_US.items():
            fp8 = "fp8" in name
            nbytes = prob.padded_bytes() if "JAX all_to_all" in name else prob.exact_bytes(fp8)
            t = us * 1e-6
            rows.append(
                [
                    name,
                    "reference",
                    common.fmt_time(t),
                    "",
                    common.fmt_gbps(common.gbps(nbytes[0], t)),
                    common.fmt_gbps(common.gbps(nbytes[1], t)),
                    "",
                    "design-notes figure, this payload's bytes",
                ]
            )
    common.write_json(args.out, record)
    print(f"# wrote {args.out}", flush=True)
    print()
    kind = info.get("device_kind", "?")
    common.print_table(
        HEADERS,
        rows,
        title=f"intranode normal mode on {ranks}x {kind}: T={args.tokens}/rank, "
        f"H={args.hidden}, top-{args.topk} of {args.experts}, {args.iters} "
        f"calls/loop, median of {args.repeats}",
    )
    found = against_nccl.ratios(record)
    if found:
        print()
        common.print_table(against_nccl.HEADERS, against_nccl.rows(found), title=against_nccl.TITLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
