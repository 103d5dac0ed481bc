"""Our ops against NCCL's all_to_all_single of the same rows, in one bench/intranode.py run: the ratio a RESULTS.md
table carries, with the SM budget beside each time.

Each of our dispatches and combines (at every SM budget the run swept) is set beside the NCCL row that moves the same
rows in the same run: BF16 dispatch and combine beside NCCL's ragged BF16 all_to_all_single, FP8 dispatch beside its
ragged uint8 rows of H + H/32 bytes. Ours is GPU 0's device span a call where the run had --cupti (NCCL's time is its
CUDA events, so a wall time of ours, which carries the jit call's own cost, is marked as such); "/ most SMs" is the
time against the same op's run the same way (pulled, or sent with bulk copies or SM stores) and timed alike at the
run's largest budget (the best there, where several send splits of it ran): the SM economy figure.

    python bench/intranode.py --sms 8,12,16,24 --cupti --out $OUT/v3.json   # prints this table last
    python bench/against_nccl.py $OUT/v3.json                              # the same from the file
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import fixed_cost  # noqa: E402


def peer_name(name: str) -> str | None:
    """The NCCL row moving the rows our op `name` moves, or None where it has none (the expert-major dispatch,
    whose pair rows are more bytes than a rank receives, and the non-ours rows)."""
    family = fixed_cost.family(name)
    if family not in ("dispatch", "combine"):
        return None
    dtype = name.split()[-1]
    return "NCCL all_to_all_single fp8 rows ragged" if dtype == "fp8" else f"NCCL all_to_all_single {dtype} ragged"


def sm_count(label: str) -> int | None:
    """SMs of a budget label as intranode.py writes it ("24 pulled", "12+12 bulk"), or None ("?")."""
    m = re.match(r"\s*(\d+)(?:\+(\d+))?", label or "")
    return None if m is None else int(m.group(1)) + int(m.group(2) or 0)


def setting(label: str) -> str:
    """How a budget's ops ran, without its SMs: "pulled", "bulk" (sent with bulk copies) or "stores"."""
    return re.sub(r"^\s*[\d+]+\s*", "", label or "")


@dataclasses.dataclass
class Ratio:
    op: str
    sms: str  # the budget as the run labelled it
    ours_us: float
    span: bool  # ours_us is GPU 0's device span (else a wall time)
    nccl_us: float | None
    to_most_sms: float | None  # ours_us / the same op's, run the same way, at the run's largest budget

    @property
    def to_nccl(self) -> float | None:
        return None if self.nccl_us is None else self.ours_us / self.nccl_us


def ratios(run: dict) -> list[Ratio]:
    """Every timed dispatch and combine of ours in one intranode.py run (its JSON record), in the run's order."""
    results = [r for r in run.get("results", []) if not r.get("error") and fixed_cost.time_us_of(r) is not None]
    by_name = {r["name"]: fixed_cost.time_us_of(r) for r in results if not r["name"].startswith("uccl_ep")}
    found = []
    for r in results:
        peer = peer_name(r["name"])
        if peer is None:
            continue
        extra = r.get("extra") or {}
        found.append(
            Ratio(
                op=r["name"].removeprefix("uccl_ep "),
                sms=extra.get("sms", "?"),
                ours_us=fixed_cost.time_us_of(r),
                span=bool(extra.get("device_span_us_per_call")),
                nccl_us=by_name.get(peer),
                to_most_sms=None,
            )
        )
    # The SM economy baseline of each op and setting: its time at the largest budget (the best there, where
    # several splits of it ran), timed the same way.
    most: dict[tuple[str, str, bool], tuple[int, float]] = {}
    for f in found:
        n, key = sm_count(f.sms), (f.op, setting(f.sms), f.span)
        if n is not None and (key not in most or (n, -f.ours_us) > (most[key][0], -most[key][1])):
            most[key] = (n, f.ours_us)
    for f in found:
        top = most.get((f.op, setting(f.sms), f.span))
        if top is not None and sm_count(f.sms) is not None:
            f.to_most_sms = f.ours_us / top[1]
    return found


HEADERS = ["op", "SMs", "ours us", "NCCL us", "ours / NCCL", "/ most SMs"]


def rows(found: list[Ratio]) -> list[list[str]]:
    def num(x: float | None, f: str) -> str:
        return "n/a" if x is None else format(x, f)

    return [
        [
            r.op,
            r.sms,
            f"{r.ours_us:.1f}" + ("" if r.span else " (wall)"),
            num(r.nccl_us, ".1f"),
            num(r.to_nccl, ".2f"),
            num(r.to_most_sms, ".2f"),
        ]
        for r in found
    ]


TITLE = "ours against NCCL all_to_all_single of the same rows (ours: GPU 0's span a call, or wall; NCCL: CUDA events)"


def main(argv: list[str] | None = None) -> list[Ratio]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="bench/intranode.py --out files")
    args = parser.parse_args(argv)
    found = []
    for path in args.runs:
        with open(path) as f:
            run_ratios = ratios(json.load(f))
        common.print_table(HEADERS, rows(run_ratios), title=f"{path}: {TITLE}")
        found += run_ratios
    return found


if __name__ == "__main__":
    main()
