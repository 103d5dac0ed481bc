"""Normal-mode dispatch and combine (jax_uccl_ep) on CPU devices, beside jax.lax.all_to_all and ragged_all_to_all.

Runs the same random-routing problem (top-k of E experts, random normal x) in each process layout given by
--processes, in fresh child processes:
  - 1 process holding all R ranks as CPU devices (JAX_NUM_CPU_DEVICES=R, no jax.distributed);
  - R processes of one CPU device each (jax.distributed on 127.0.0.1, gloo for XLA's CPU collectives).
Every op runs `--iters` times inside one jit (a fori_loop in a jax.shard_map); the time is the median over
`--repeats` calls of (call time / iters), the slowest rank's when there are several processes. GB/s are per rank,
averaged over ranks: "DeepEP" counts every received token row (x only, as DeepEP's tests do), own rows included;
"remote" counts rows that came from another rank. all_to_all moves the padded [R, capacity_per_peer, H] payload,
so its bytes are the padded ones; ragged_all_to_all and dispatch/combine move the exact rows.

CPU numbers are informational only: 2 cores shared by XLA, the proxy threads and every rank.

With --gpus, every rank is a process of its own on one GPU, and UCCL_EP_GPUS_PER_NODE (default 1) makes them
separate nodes: the path GPUs on several hosts take (proxy runtime, staged through host memory), for the record.

    python bench/normal.py                      # defaults: ~1 minute on a 2-core machine
    python bench/normal.py --ranks 2 --processes 2 --tokens 4096 --hidden 7168 --topk 8 --experts 256
    python bench/normal.py --gpus --ranks 2 --tokens 4096 --hidden 7168 --topk 8 --experts 256
    UCCL_EP_GPUS_PER_NODE=2 python bench/normal.py --gpus --share-gpu --ranks 4 --ops dispatch,combine

With more ranks than GPUs, rank i runs on GPU i mod the GPU count; --share-gpu puts every rank on GPU 0 (two-level
routing on one GPU: two nodes of two). Such times are of processes taking turns on a GPU, not of the protocol; the
bytes the proxies post per op, and those that cross nodes (the note), are exact.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DEFAULT_OPS = ["dispatch", "dispatch_fp8", "combine", "all_to_all", "ragged_all_to_all"]
ALL_OPS = DEFAULT_OPS + [
    "dispatch_expert",
    "ll_dispatch_fp8",
    "ll_combine",
    "ll_combine_carried",
]  # ll_*: --tokens is max_tokens_per_rank


def child(cfg: dict) -> dict:
    """In each spawned process: initialize the runtime, run every op, return this rank's results."""
    import jax

    prob = common.EPProblem(
        cfg["ranks"], cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"], cfg["dtype"], seed=cfg["seed"]
    )
    common.set_uccl_env_defaults(prob)
    import jax_uccl_ep as ep

    t0 = time.perf_counter()
    ep.initialize()
    init_s = time.perf_counter() - t0
    devices = sorted(jax.devices(), key=lambda d: d.id)
    results = common.run_ep_ops(prob, cfg["ops"], iters=cfg["iters"], repeats=cfg["repeats"], devices=devices)
    out = {
        "results": results,
        "init_s": init_s,
        "process": jax.process_index(),
        "buffer_bytes": int(os.environ["UCCL_EP_BUFFER_BYTES"]),
    }
    ep.shutdown()
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--ranks", type=int, default=2, help="EP ranks (CPU devices in all)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--processes",
        default=None,
        help="comma-separated process counts to run, each dividing --ranks (default: '1,R')",
    )
    ap.add_argument(
        "--ops",
        default=",".join(DEFAULT_OPS),
        help=f"comma-separated subset of {ALL_OPS} (dispatch_fp8: x float8_e4m3fn + scales [T, H/128])",
    )
    ap.add_argument("--iters", type=int, default=20, help="op calls inside one jitted loop")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls; the median is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per process layout")
    ap.add_argument("--json", "--out", default=None, help="also write the results here")
    ap.add_argument(
        "--gpus",
        action="store_true",
        help="one process per GPU, each its own node (UCCL_EP_GPUS_PER_NODE, default 1): the proxy path",
    )
    ap.add_argument("--share-gpu", action="store_true", help="with --gpus: every process on GPU 0")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    r = args.ranks
    layouts = [r] if args.gpus else [int(p) for p in (args.processes or f"1,{r}").split(",")]
    for p in layouts:
        if p < 1 or r % p:
            sys.exit(f"--processes {p} does not divide --ranks {r}")
    ops = [o for o in args.ops.split(",") if o]
    unknown = set(ops) - set(ALL_OPS)
    if unknown:
        sys.exit(f"unknown --ops {sorted(unknown)}; choose from {ALL_OPS}")
    cfg = dict(
        ranks=r,
        tokens=args.tokens,
        hidden=args.hidden,
        topk=args.topk,
        experts=args.experts,
        dtype=args.dtype,
        seed=args.seed,
        ops=ops,
        iters=args.iters,
        repeats=args.repeats,
    )
    prob = common.EPProblem(r, args.tokens, args.hidden, args.topk, args.experts, args.dtype, seed=args.seed)
    header = common.run_header("GPUs as separate nodes (proxy path)" if args.gpus else "CPU devices")
    print(f"# {header['date']}  {header['command']}  (load average {header['load_avg_1m']})", flush=True)
    print(f"# problem: {prob.describe()}", flush=True)

    rows, record = [], {"header": header, "problem": prob.describe(), "layouts": {}}
    platform = "gpu" if args.gpus else "cpu"
    env = {"UCCL_EP_BUFFER_BYTES": os.environ.get("UCCL_EP_BUFFER_BYTES", str(prob.uccl_buffer_bytes(platform)))}
    if args.gpus:
        env["UCCL_EP_GPUS_PER_NODE"] = os.environ.get("UCCL_EP_GPUS_PER_NODE", "1")
    for p in layouts:
        mode = f"{p}p x {r // p}dev"
        if args.gpus:
            mode = (
                f"{p}p on {'GPU 0' if args.share_gpu else 'the GPUs'} (nodes of "
                f"{env['UCCL_EP_GPUS_PER_NODE']}, two-level {os.environ.get('UCCL_EP_TWO_LEVEL', 'auto')})"
            )
        t0 = time.perf_counter()
        try:
            outs = common.spawn(
                __file__,
                "child",
                p,
                args=[cfg],
                devices_per_process=r // p,
                env=env,
                timeout_s=args.timeout,
                distributed=p > 1,
                gpus=args.gpus,
                share_gpu=args.share_gpu,
            )
        except Exception as e:
            print(f"# layout {mode} failed:\n{e}", file=sys.stderr, flush=True)
            failed = [dict(name=o, error=common.short_error(e), bytes_deepep=0, bytes_remote=0, note="") for o in ops]
            rows += common.op_table_rows(failed, mode)
            record["layouts"][mode] = {"error": str(e)}
            continue
        merged = common.merge_rank_results([o["results"] for o in outs])
        print(
            f"# layout {mode}: {time.perf_counter() - t0:.1f} s wall, initialize {outs[0]['init_s']:.2f} s, "
            f"UCCL_EP_BUFFER_BYTES={outs[0]['buffer_bytes']}",
            flush=True,
        )
        rows += common.op_table_rows(merged, mode)
        record["layouts"][mode] = merged
    if args.json:
        common.write_json(args.json, record)
    print()
    common.print_table(
        common.OP_HEADERS,
        rows,
        title=f"normal mode, R={r}, T={args.tokens}, H={args.hidden}, top-{args.topk} of "
        f"{args.experts}, {args.dtype}, {args.iters} calls/jit, median of {args.repeats}",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
