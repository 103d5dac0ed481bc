"""Normal mode's NVLink kernels on one GPU, pointed at the GPU's own memory: two ranks (--ranks) on GPU 0, each
sending its rows into the others' buffers as if they were peers (nvl_loopback_bench). What a kernel moves here
bounds what it can move over NVLink (NV18: 450 GB/s per direction), so at a budget it must move well over that here.

Sweeps the SM budget (UCCL_EP_NUM_SMS: send + receive blocks of each rank) for the SM-store kernels and the bulk-copy
(TMA) kernels (UCCL_EP_NVL_BULK), DeepSeek-V3 shapes by default, with the ops sent, or with --pulls pulled (the ranks
are GPUs of one process, which pull by default: every block receives, reading the other ranks' inputs where they lie).
Per call: BF16 dispatch, FP8 dispatch (rows + scales) and BF16 combine, timed with CUDA events over --iters calls (the
slowest rank). GB/s: the rows a rank sends the others per call over the time ("remote", the bytes NVLink would carry),
and all rows it receives including its own ("DeepEP"), and for one more call of each op the bulk kernels' spans over all
ranks (start after the op's first kernel / length, us; all ranks' kernels start together, behind one gate), each side's
GB/s over its span. The ranks run at once, so the GPU's memory carries about 4x the remote bytes (send: read + write,
receive: read + write) of each rank: with two ranks at 24 SMs that saturates one H200's memory (bench/RESULTS.md).
--one-way sends from rank 0 only (the others route to their own experts), about halving that traffic: rank 0's send side
and the others' receive sides. --sides-apart holds dispatch's receive side back in the spans' call until every rank's
rows have landed, so that its send and receive spans are each side with the memory to itself. Each run checks the last
call's rows, scales and sums. --rings sweeps the bulk kernels' ring shapes (testing hook). --gpus N spreads the ranks
over GPUs 0..N-1 of this process (rank r on GPU r % N): the same kernels, spans and sides apart over NVLink; the spans
over all ranks then mix the GPUs' clocks (which disagree by up to milliseconds), so each GPU's own spans print too
("routing": dispatch's receive blocks waiting for every member's routing; "scan": the routing scan after it; "acks": the
send blocks waiting for the members' acknowledgements; "routing_sent": a send block's start until its routing is
announced). The stamped call follows three unstamped ones back to back, as in the timed loop (the first NVLink traffic
after an idle gap is ~110 us slower).

    python bench/loopback.py --out $OUT/loopback.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HEADERS = ["op", "copies", "send+recv SMs", "time/call", "GB/s remote", "GB/s DeepEP", "rows ok"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--sms", default="8,12,16,24", help="comma-separated SM budgets")
    ap.add_argument("--copies", default="stores,bulk", help="stores, bulk or both")
    ap.add_argument("--send-sms", default="0", help="comma-separated send blocks of each budget (0: the default)")
    ap.add_argument(
        "--rings",
        default="0:0",
        help="comma-separated lag:stages[:combine[:producers[:rows]]] of the bulk kernels' rings (jobs a stage is "
        "refilled behind its stores, stages per issuing thread, stages per warp of the combine receiver, issuing "
        "threads of a dispatch send block: 4 or 8, consecutive tokens' rows a dispatch send job moves: 1 to 4; 0: the "
        "default)",
    )
    ap.add_argument("--ranks", type=int, default=2, help="ranks (a GPU's ranks x SMs must fit on it)")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs the ranks are spread over (rank r on GPU r %% gpus)")
    ap.add_argument(
        "--one-way",
        action="store_true",
        help="only rank 0's tokens go to other ranks (the others' to their own experts): GB/s remote is rank 0's",
    )
    ap.add_argument(
        "--sides-apart",
        action="store_true",
        help="in the spans' call, dispatch's receive side starts only once every rank's rows have landed: each "
        "side's span (and its GB/s) is what it moves with the GPU's memory to itself",
    )
    ap.add_argument(
        "--pulls",
        action="store_true",
        help="dispatch and combine pull (bulk copies only): the spans then hold the pulled kernels' phases (routing: "
        "the wait for every rank's words; scan; dispatch_receive; acks: the tail to the end of the wait for the "
        "ranks' reads)",
    )
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="loopback.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from jax_uccl_ep import Config, _runtime, _uccl_ep_testing

    where = f"GPU 0, {args.ranks} ranks on it" if args.gpus == 1 else f"{args.ranks} ranks on GPUs 0-{args.gpus - 1}"
    header = common.run_header(where + (", one way" if args.one_way else ""))
    print(f"# {header['date']}  {header['command']}", flush=True)
    rows, record = [], {"header": header, "args": vars(args), "runs": []}
    sweep = [
        (copies, ring, int(b), int(s))
        for copies in args.copies.split(",")
        for ring in (args.rings.split(",") if copies == "bulk" else ["0:0"])
        for b in args.sms.split(",")
        for s in args.send_sms.split(",")
    ]
    for copies, ring, budget, send_sms in sweep:
        if send_sms >= budget or (args.pulls and copies != "bulk"):
            continue
        _uccl_ep_testing.nvl_set_bulk_tuning(*common.bulk_tuning(ring))
        label = (copies if ring == "0:0" else f"{copies} {ring}") + (" pulled" if args.pulls else "")
        _runtime.configure_native(
            Config(
                num_sms=budget,
                num_send_sms=send_sms,
                nvl_bulk=copies == "bulk",
                nvl_pull_dispatch=args.pulls,
                nvl_pull_combine=args.pulls,
            )
        )
        send_blocks = 0 if args.pulls else _uccl_ep_testing.nvl_send_blocks()  # a pulled op's blocks all receive
        split = f"{send_blocks}+{budget - send_blocks}"
        for fp8 in (False, True):
            r = dict(
                _uccl_ep_testing.nvl_loopback_bench(
                    0,
                    args.tokens,
                    args.hidden,
                    args.topk,
                    args.experts,
                    fp8,
                    args.iters,
                    7,
                    args.ranks,
                    args.one_way,
                    args.sides_apart,
                    args.gpus,
                )
            )
            r.update(copies=label, budget=budget, split=split, fp8=fp8)
            record["runs"].append(r)
            remote = r["remote_rows"] / (1 if args.one_way else args.ranks) * r["x_row_bytes"]  # per sending rank
            received = r["received_rows"] / args.ranks * r["x_row_bytes"]
            ok = (
                "yes"
                if r["mismatched_rows"] == 0
                and r["mismatched_expert_counts"] == 0
                and r["mismatched_combine_rows"] == 0
                else f"NO ({r['mismatched_rows']} rows, {r['mismatched_expert_counts']} expert counts, "
                f"{r['mismatched_combine_rows']} sums)"
            )
            ops = [("dispatch fp8" if fp8 else "dispatch bf16", r["dispatch_us"])]
            if not fp8:
                ops.append(("combine bf16", r["combine_us"]))
            for name, us in ops:
                rows.append(
                    [
                        name,
                        label,
                        split,
                        f"{us:.1f} us",
                        f"{remote / us / 1e3:.0f}",
                        f"{received / us / 1e3:.0f}",
                        ok,
                    ]
                )
            print(
                f"# {label} {split} SMs fp8={fp8}: "
                + ", ".join(f"{n} {us:.1f} us" for n, us in ops)
                + f", rows ok: {ok}",
                flush=True,
            )
            spans = r.get("spans_us", {})
            if spans:  # bulk kernels only: where one more call's time went, (start, length) in us
                # A side's GB/s over its span: the send sides' remote rows (a sending rank's), the receive sides'
                # rows (a rank's, its own included), as in the table's two columns.
                moved = {"send": remote, "receive": received}
                print(
                    "#   spans: "
                    + ", ".join(
                        f"{k} +{s:.0f}/{n:.0f}"
                        + "".join(
                            f" ({b / n / 1e3:.0f} GB/s)" for side, b in moved.items() if k.endswith(side) and n > 0
                        )
                        for k, (s, n) in spans.items()
                    ),
                    flush=True,
                )
            gpu_spans = r.get("gpu_spans_us", [])
            for g, own in enumerate(gpu_spans if len(gpu_spans) > 1 else []):  # each GPU on its own clock
                print(f"#   GPU {g}: " + ", ".join(f"{k} +{s:.0f}/{n:.0f}" for k, (s, n) in own.items()), flush=True)
    _uccl_ep_testing.nvl_set_bulk_tuning(0, 0)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print()
    rows.sort(key=lambda row: (row[0], sum(map(int, row[2].split("+"))), row[2], row[1]))
    common.print_table(
        HEADERS,
        rows,
        title=f"loopback on GPU 0, {args.ranks} ranks: T={args.tokens}/rank, H={args.hidden}, "
        f"top-{args.topk} of {args.experts}, {args.iters} calls",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
