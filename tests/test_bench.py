"""The benchmarks' own arithmetic, on CPU: bench/fixed_cost.py's line through intranode.py's results."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import numpy as np

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _result(name: str, megabytes: float, us: float, sms: str | None = None, span: bool = True) -> dict:
    """One entry of intranode.py's results: ours carry GPU 0's span (and a wall time that must not be used)."""
    extra = {"sms": sms} if sms else {}
    wall_s = us * 1e-6
    if span:
        extra["device_span_us_per_call"] = us
        wall_s = us * 1e-6 + 40e-6  # the jit's own cost, which the fit must not see
    return {
        "name": name,
        "error": None,
        "bytes_deepep": megabytes * 1e6,
        "extra": extra,
        "timing": {"median_s": wall_s},
    }


def test_the_fixed_cost_fit_recovers_each_sides_line_and_where_they_cross(tmp_path):
    rng = np.random.default_rng(53)
    ours_fixed, ours_rate = rng.uniform(25, 45), rng.uniform(600, 700)  # us, GB/s
    nccl_fixed, nccl_rate = rng.uniform(15, 25), rng.uniform(450, 590)
    paths = []
    for i, row_bytes in enumerate((14336, 4096)):  # two jobs' shapes, each a BF16 and an FP8 dispatch
        rows = rng.integers(7000, 8200)
        results = []
        for dtype, nccl_name, share in (
            ("bfloat16", "NCCL all_to_all_single bfloat16 ragged", 1.0),
            ("fp8", "NCCL all_to_all_single fp8 rows ragged", 0.5156),
        ):
            mb = rows * row_bytes * share / 1e6
            noise = rng.uniform(-0.3, 0.3, 2)
            results.append(_result(f"uccl_ep dispatch {dtype}", mb, ours_fixed + mb * 1e3 / ours_rate + noise[0], "24"))
            results.append(_result(nccl_name, mb, nccl_fixed + mb * 1e3 / nccl_rate + noise[1], span=False))
        if i == 0:  # combine in one run only: one size, no line
            results.append(_result("uccl_ep combine bfloat16", rows * row_bytes / 1e6, 99.0, "24"))
        results.append(dict(_result("uccl_ep dispatch bfloat16", 1.0, 1e6, "24"), error="n/a"))  # skipped
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps({"results": results}))
        paths.append(str(path))

    fixed_cost = _load("fixed_cost")
    found = {f.series: f for f in fixed_cost.main(paths)}
    ours, nccl = found["ours dispatch, 24 SMs"], found["NCCL"]
    assert len(ours.points) == len(nccl.points) == 4
    assert abs(ours.fixed_us - ours_fixed) < 1.0 and abs(ours.rate_gbps / ours_rate - 1) < 0.02, ours
    assert abs(nccl.fixed_us - nccl_fixed) < 1.0 and abs(nccl.rate_gbps / nccl_rate - 1) < 0.02, nccl
    assert ours.worst_residual_us < 0.7 and nccl.worst_residual_us < 0.7
    meets = fixed_cost.crossing_mb(ours, nccl)
    expected = (ours_fixed - nccl_fixed) / (1e3 / nccl_rate - 1e3 / ours_rate)
    assert meets is not None and abs(meets - expected) < 0.1 * expected, (meets, expected)
    assert abs(ours.time_us(meets) - nccl.time_us(meets)) < 1e-6
    one_size = found["ours combine, 24 SMs"]
    assert (
        len(one_size.points) == 1 and math.isnan(one_size.fixed_us) and fixed_cost.crossing_mb(one_size, nccl) is None
    )


def test_the_nccl_ratios_set_each_op_beside_the_nccl_row_of_its_rows():
    rng = np.random.default_rng(55)
    nccl_bf16, nccl_fp8 = rng.uniform(200, 240), rng.uniform(110, 140)
    labels = ("8 pulled", "24 pulled", "6+6 bulk", "12+12 bulk", "13+11 bulk")
    ours = {  # (op, SMs label): GPU 0's span a call
        (op, sms): rng.uniform(100, 400)
        for op in ("dispatch bfloat16", "dispatch fp8", "combine bfloat16")
        for sms in labels
    }
    results = [_result(f"uccl_ep {op}", 100.0, us, sms) for (op, sms), us in ours.items()]
    results.append(_result("uccl_ep dispatch fp8", 100.0, 1.0, "16 pulled") | {"error": "n/a (skipped)"})
    results.append(_result("uccl_ep dispatch bfloat16", 100.0, 50.0, "4 pulled", span=False))  # no --cupti
    results.append(_result("uccl_ep dispatch expert-major bfloat16", 100.0, 77.0, "24 pulled"))  # no NCCL peer
    results.append(_result("NCCL all_to_all_single bfloat16 ragged", 100.0, nccl_bf16, span=False))
    results.append(_result("NCCL all_to_all_single bfloat16 padded", 100.0, 1.0, span=False))
    results.append(_result("NCCL all_to_all_single fp8 rows ragged", 100.0, nccl_fp8, span=False))

    against = _load("against_nccl")
    assert [against.sm_count(s) for s in labels] == [8, 24, 12, 24, 24] and against.sm_count("?") is None
    found = {(r.op, r.sms): r for r in against.ratios({"results": results})}
    assert set(found) == set(ours) | {("dispatch bfloat16", "4 pulled")}, sorted(found)
    for (op, sms), us in ours.items():
        r = found[(op, sms)]
        peer = nccl_fp8 if op == "dispatch fp8" else nccl_bf16
        assert r.span and r.ours_us == us and r.nccl_us == peer, r
        assert abs(r.to_nccl - us / peer) < 1e-12
        # Pulled against pulled at 24 SMs; sent against the faster of its two 24-SM splits.
        base = ours[(op, "24 pulled")] if "pulled" in sms else min(ours[(op, "12+12 bulk")], ours[(op, "13+11 bulk")])
        assert abs(r.to_most_sms - us / base) < 1e-12, (r, base)
    wall = found[("dispatch bfloat16", "4 pulled")]
    assert not wall.span and abs(wall.ours_us - 50.0) < 1e-9  # the median wall time, marked as such in the rows
    assert wall.to_most_sms == 1.0  # a wall time is set beside wall times only (here none but its own)
    assert any("(wall)" in row[2] for row in against.rows([wall]))
    # Without NCCL's rows (an --cpu run, or NCCL failed) the ratio is n/a, the SM one stays.
    no_peer = against.ratios({"results": [r for r in results if not r["name"].startswith("NCCL")]})
    assert all(r.nccl_us is None and r.to_nccl is None and r.to_most_sms is not None for r in no_peer)
    assert all(row[3] == "n/a" and row[4] == "n/a" for row in against.rows(no_peer))


def test_intranode_on_cpu_devices_ends_with_the_table_against_nccl(tmp_path):
    """The bench end to end on 2 CPU devices (its smoke mode): our three ops timed, NCCL's rows n/a (--cpu), and
    the last table sets each op beside them."""
    import subprocess

    out = tmp_path / "run.json"
    cmd = [sys.executable, os.path.join(BENCH, "intranode.py"), "--cpu", "--tokens", "64", "--hidden", "256"]
    cmd += ["--iters", "2", "--repeats", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    for name in ("uccl_ep dispatch bfloat16", "uccl_ep dispatch fp8", "uccl_ep combine bfloat16"):
        assert results[name]["error"] is None and results[name]["timing"]["median_s"] > 0, results[name]
    table = proc.stdout[proc.stdout.index("ours against NCCL") :].splitlines()
    rows = [line.split() for line in table if line.startswith(("dispatch", "combine"))]
    assert sorted(r[0] + " " + r[1] for r in rows) == ["combine bfloat16", "dispatch bfloat16", "dispatch fp8"], table
    assert all("(wall)" in " ".join(r) and r[-3:-1] == ["n/a", "n/a"] for r in rows), table
