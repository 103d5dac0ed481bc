"""The fixed cost and the copy rate of dispatch and combine, ours and NCCL's, from bench/intranode.py runs.

An op's time a call is close to fixed + bytes / rate, bytes being what a rank receives (its own rows included): on
2x H200 four EP2 dispatches (DeepSeek-V3's and a fine layer's shapes, BF16 and FP8) lay within 2 us of one line on
each side (bench/RESULTS.md, 2026-11-29). Fitting that line through the runs of one lease tells whether a change
moved the fixed part (the routing scan, the handovers, the acknowledgements) or the rate of the copies, and at what
size NCCL's line crosses ours. Ours is timed by GPU 0's device span (intranode.py --cupti), NCCL by its CUDA events.
A series needs points at two sizes at least: the same job at V3's shapes and at the layer's, say.

    python bench/intranode.py --sms 8,24 --cupti --out $OUT/v3.json
    python bench/intranode.py --sms 8,24 --cupti --tokens 4096 --hidden 2048 --topk 8 --experts 64 --out $OUT/layer.json
    python bench/fixed_cost.py $OUT/v3.json $OUT/layer.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict

import numpy as np


def family(name: str) -> str | None:
    """The series an intranode.py result is fitted in, by its name: both of our dispatches share a line (the FP8
    rows are fewer bytes of the same work), combine has its own, and NCCL's ragged all_to_all_single of the same
    rows (BF16, and FP8 as uint8 rows) serves as the peer of both. None for the rest (padded payloads, XLA's ops,
    the expert-major dispatch, whose pair rows are more bytes than a rank receives)."""
    if name.startswith("NCCL all_to_all_single") and name.endswith(" ragged"):
        return "NCCL"
    if name.startswith("uccl_ep dispatch ") and "expert-major" not in name:
        return "dispatch"
    if name.startswith("uccl_ep combine "):
        return "combine"
    return None


@dataclasses.dataclass
class Fit:
    """A line time_us = fixed_us + megabytes / rate through one series' points."""

    series: str  # e.g. "ours dispatch, 24 pulled SMs" or "NCCL"
    points: list[tuple[float, float]]  # (MB received a rank, us a call)
    fixed_us: float = float("nan")
    rate_gbps: float = float("nan")  # GB/s received a rank
    worst_residual_us: float = float("nan")

    def time_us(self, megabytes: float) -> float:
        return self.fixed_us + megabytes * 1e3 / self.rate_gbps


def time_us_of(result: dict) -> float | None:
    """A result's time a call: GPU 0's device span where the run measured it, else its median wall time."""
    span = (result.get("extra") or {}).get("device_span_us_per_call")
    if span:
        return float(span)
    timing = result.get("timing") or {}
    return float(timing["median_s"]) * 1e6 if timing.get("median_s") else None


def collect(runs: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """The (MB received a rank, us a call) points of each series in intranode.py's JSON outputs."""
    points: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for run in runs:
        for r in run.get("results", []):
            t = time_us_of(r)
            if r.get("error") or t is None or not r.get("bytes_deepep"):
                continue
            megabytes, kind = float(r["bytes_deepep"]) / 1e6, family(r["name"])
            if kind == "NCCL":
                points[kind].append((megabytes, t))
            elif kind is not None:
                sms = (r.get("extra") or {}).get("sms", "?")
                points[f"ours {kind}, {sms} SMs"].append((megabytes, t))
    return points


def fit(series: str, points: list[tuple[float, float]]) -> Fit:
    """The least-squares line through `points`; NaNs where they hold fewer than two sizes."""
    out = Fit(series, sorted(points))
    x = np.array([p[0] for p in points])
    y = np.array([p[1] for p in points])
    if len(np.unique(np.round(x, 3))) < 2:
        return out
    slope, fixed = np.polyfit(x, y, 1)
    out.fixed_us, out.rate_gbps = float(fixed), float(1e3 / slope) if slope > 0 else float("inf")
    out.worst_residual_us = float(np.max(np.abs(y - (fixed + slope * x))))
    return out


def crossing_mb(a: Fit, b: Fit) -> float | None:
    """The bytes received a rank (MB) where the two lines meet, or None where they do not at a positive size (or
    are unfitted)."""
    slope_a, slope_b = 1e3 / a.rate_gbps, 1e3 / b.rate_gbps
    if not np.isfinite(slope_a - slope_b) or abs(slope_a - slope_b) < 1e-12:
        return None
    mb = (b.fixed_us - a.fixed_us) / (slope_a - slope_b)
    return float(mb) if np.isfinite(mb) and mb > 0 else None


def fits(paths: list[str]) -> list[Fit]:
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))

    def order(name: str) -> tuple:  # NCCL first, then each family by its SM budget
        words = name.replace(",", "").split()
        return (
            name != "NCCL",
            words[1] if len(words) > 1 else "",
            int(words[2]) if len(words) > 2 and words[2].isdigit() else 0,
        )

    return [fit(name, pts) for name, pts in sorted(collect(runs).items(), key=lambda kv: order(kv[0]))]


def main(argv: list[str] | None = None) -> list[Fit]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="bench/intranode.py --out files of one lease")
    args = parser.parse_args(argv)
    found = fits(args.runs)
    nccl = next((f for f in found if f.series == "NCCL"), None)
    print(f"{'series':32} {'points':>6} {'fixed us':>9} {'GB/s':>7} {'worst residual us':>18} {'meets NCCL at MB':>17}")
    for f in found:
        meets = crossing_mb(f, nccl) if nccl is not None and f is not nccl else None
        print(
            f"{f.series:32} {len(f.points):6d} {f.fixed_us:9.1f} {f.rate_gbps:7.0f} {f.worst_residual_us:18.1f} "
            f"{'' if meets is None else f'{meets:.1f}':>17}"
        )
    return found


if __name__ == "__main__":
    main()
