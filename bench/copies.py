"""What one kernel of N SMs copies, with Hopper bulk copies (TMA, the way our NVLink kernels move rows) or with SM
loads and stores: within a GPU, into the next GPU's memory (push: what our senders do over NVLink) or out of it into
its own (pull: what a combine that reads its peers' rows and reduces them would do). With --gpus N every GPU runs the
kernel at once (GPU g pushes to / pulls from GPU g + 1), as both directions of an op do; the figure is per GPU.

It answers, before a combine is built either way, whether reading peers' rows over NVLink moves more or less per SM
than writing them (the comparison issue 23 asks for): push and pull at 8 to 32 SMs beside NV18's 450 GB/s per
direction. On one GPU push and pull are the local copy (the next GPU is itself).

    python bench/copies.py --gpus 2 --out $OUT/copies.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HEADERS = ["direction", "copies", "SMs", "GB/s per GPU", "GB/s per SM"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sms", default="8,12,16,24,32", help="comma-separated blocks (one per SM) of the kernel")
    ap.add_argument("--directions", default="local,push,pull", help="comma-separated local, push, pull")
    ap.add_argument("--copies", default="bulk,stores", help="bulk (TMA) and/or stores (SM loads and stores)")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs 0..N-1, each copying at once")
    ap.add_argument("--mib-per-gpu", type=int, default=512, help="MiB each GPU copies per kernel")
    ap.add_argument("--stage-bytes", type=int, default=14336, help="bytes a copy moves: a BF16 row at hidden 7168")
    ap.add_argument("--stages", type=int, default=3, help="stages per issuing thread (bulk)")
    ap.add_argument("--producers", type=int, default=4, help="issuing threads per block (bulk)")
    ap.add_argument("--out", default="copies.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from jax_uccl_ep import _uccl_ep_testing

    header = common.run_header(f"GPUs 0-{args.gpus - 1}" if args.gpus > 1 else "GPU 0")
    print(f"# {header['date']}  {header['command']}", flush=True)
    rows, runs = [], []
    for direction in args.directions.split(","):
        for copies in args.copies.split(","):
            for sms in (int(s) for s in args.sms.split(",")):
                # Each block copies a whole number of stages.
                per_block = args.mib_per_gpu * 2**20 // sms // args.stage_bytes * args.stage_bytes
                gbps = _uccl_ep_testing.nvl_copy_bench(
                    0,
                    sms,
                    per_block,
                    args.stage_bytes,
                    args.stages,
                    args.producers,
                    copies == "stores",
                    direction,
                    args.gpus,
                )
                runs.append(dict(direction=direction, copies=copies, sms=sms, bytes_per_block=per_block, gbps=gbps))
                rows.append([direction, copies, sms, f"{gbps:.0f}", f"{gbps / sms:.1f}"])
                print(f"#  {direction:5} {copies:6} {sms:3} SMs  {gbps:7.0f} GB/s per GPU", flush=True)
    common.print_table(HEADERS, rows, title=f"copies, {header['device']}")
    common.write_json(args.out, {"header": header, "args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
