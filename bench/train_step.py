"""Training step time of the same MoE transformer with each expert-parallel implementation, in one run.

Trains examples/train_moe.py's model (token + position embeddings, causal attention, the package's MoE
feed-forward: softmax top-k router, SwiGLU experts, load-balancing loss; AdamW; float32 parameters, the experts'
matmuls in --compute-dtype) once per implementation, with the same sizes, seed and data:

  uccl        jax_uccl_ep dispatch/combine, dropless, grouped matmuls  (jax_uccl_ep.layers.moe_ffn_local)
  uccl_capacity  the same layer with MoEConfig.capacity_factor = --a2a-capacity-factor: a pair buffer of
              MaxText's capacity instead of the dropless bound, dropping past it as all_to_all does (not run
              unless named)
  uccl_sized  the dropless layer with MoEConfig.pair_buffer_factor = --pair-buffer-factor: its experts on a pair
              buffer of that factor x the mean pairs whenever a device's pairs fit, else on the worst-case one (not
              run unless named)
  all_to_all  MaxText's GPU path: all_to_all of an [E, C, D] buffer at capacity factor --a2a-capacity-factor,
              experts as batched einsums                               (moe_layer.moe_ffn_all_to_all)
  ragged      jax.lax.ragged_all_to_all, dropless, grouped matmuls     (moe_layer.moe_ffn_ragged; MaxText's)
  dense       every expert on every token, expert weights all-gathered (jax_uccl_ep.layers.moe_ffn_reference; no EP)

Each implementation runs in its own child process (`python examples/train_moe.py --json ...`) that drives every
local device (one process, R devices, data and expert parallel over them), so one that fails, hangs (--timeout) or
runs out of memory prints n/a and the others still run. Step time: the wall time of each whole training step
(forward, backward, AdamW; host-synchronized by reading the loss), median over the steps after --warmup;
tokens/s = tokens per step (all devices) / that median. "vs uccl" is step time / uccl's step time (> 1: slower).
The losses of all implementations should agree to float rounding (same model, data and initialization): the
"|loss - dense|" column is the largest difference over the steps.

The default sizes are a fine-grained MoE of the kind DeepSeek made standard (--preset fine: 64 experts top-8,
d_model 2048, d_ff 1024, 4 layers, 4 x 1024 tokens per GPU); --preset v3 takes DeepSeek-V3's routing (256 experts
top-8) at d_ff 256; --preset mixtral the older 8 experts top-2 at d_ff 4096. uccl and ragged run their experts
through the package's grouped matmul (jax_uccl_ep.grouped: tokamax's kernels on Hopper in bf16, else
jax.lax.ragged_dot) on receive buffers of static size (uccl R * tokens rows holding R * tokens * top-k pairs,
ragged R * tokens * top-k rows); all_to_all drops the slots past its capacity. Besides the step, each child times
the layer's parts as standalone jitted calls on the step's shapes (forward only: router, dispatch, experts,
combine; and the whole layer forward+backward), and profiles one more step: the "profile" column is the device time
(ms per device, forward and backward, summed over the layers) of the ops under each of the layer's named scopes
(layers.SCOPES; all_to_all's layer has the same scopes; "layout" is the XLA pair layout after token rows, which
only the GPU paths run) and of everything else in the step ("other": attention, the optimizer, ...).

    python bench/train_step.py --out $OUT/train_step.json        # GPUs: defaults sized for 2x H200
    python bench/train_step.py --cpu --small                     # smoke run on 2 CPU devices (ragged: n/a)
    JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=2 python bench/train_step.py --small
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

TRAIN = os.path.join(common.REPO_ROOT, "examples", "train_moe.py")
JSON_MARK = "TRAIN_MOE_JSON "
IMPLS = ["uccl", "all_to_all", "ragged", "dense"]
MORE_IMPLS = ["uccl_capacity", "uccl_sized"]

# Model sizes: a fine-grained MoE (64 experts, top-8: the issue's user), DeepSeek-V3's routing, the older
# Mixtral-like MoE (8 experts, top-2), and a smoke-test size for CPUs.
GPU_SIZES = dict(
    d_model=2048,
    d_ff=1024,
    heads=16,
    experts=64,
    top_k=8,
    layers=4,
    seq_len=1024,
    batch_per_device=4,
    steps=20,
    warmup=5,
)
PRESETS = {
    "fine": GPU_SIZES,
    "v3": dict(GPU_SIZES, experts=256, d_ff=256),
    "mixtral": dict(GPU_SIZES, experts=8, top_k=2, d_ff=4096),
}
SMALL_SIZES = dict(
    d_model=64, d_ff=128, heads=4, experts=4, top_k=2, layers=2, seq_len=32, batch_per_device=4, steps=6, warmup=2
)
HEADERS = [
    "impl",
    "experts",
    "step ms",
    "min ms",
    "tokens/s",
    "vs uccl",
    "final loss",
    "|loss - dense|",
    "pairs dropped",
    "layer fwd / fwd+bwd ms",
    "router / dispatch / experts / combine ms",
    "profile: router / dispatch / layout / experts / combine / other ms",
    "1st step s",
    "error",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, in run order: of {IMPLS + MORE_IMPLS}")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="fine", help="model sizes (see above)")
    ap.add_argument("--small", action="store_true", help=f"smoke-test sizes {SMALL_SIZES}")
    ap.add_argument("--cpu", action="store_true", help="CPU devices (JAX_PLATFORMS=cpu, JAX_NUM_CPU_DEVICES=--devices)")
    ap.add_argument("--devices", type=int, default=2, help="CPU devices with --cpu")
    for name, value in GPU_SIZES.items():
        ap.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=None,
            help=f"default {value} with --preset fine ({SMALL_SIZES[name]} with --small)",
        )
    ap.add_argument(
        "--a2a-capacity-factor",
        type=float,
        default=1.25,
        help="all_to_all: slots per (sender, expert) = factor x tokens x top-k / experts (MaxText's; 0: never drops); "
        "uccl_capacity: the layer's pair buffer at the same factor",
    )
    ap.add_argument(
        "--pair-buffer-factor",
        type=float,
        default=1.5,
        help="uccl_sized: its pair buffer in mean pairs a device receives (it falls back to the worst case, no drops)",
    )
    ap.add_argument(
        "--compute-dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="the experts' matmuls for every implementation (auto: bfloat16 on GPUs)",
    )
    ap.add_argument(
        "--scan-layers",
        action="store_true",
        help="every implementation's layers stacked and run by one jax.lax.scan (MaxText's default): compiled once",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW's peak learning rate")
    ap.add_argument("--lr-warmup-steps", type=int, default=10, help="linear warmup; with --clip-norm, no loss spikes")
    ap.add_argument("--clip-norm", type=float, default=1.0, help="gradient clipping by global norm (0: none)")
    ap.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds per implementation, compilation included (its child process is killed after that: n/a); "
        "on 4x H100 uccl's first step compiled for ~60-70 s, and the part timings compile six more programs",
    )
    ap.add_argument("--verbose", action="store_true", help="echo each child's per-step lines")
    ap.add_argument(
        "--no-parts", action="store_true", help="skip the layer's standalone timings (each compiles its own programs)"
    )
    ap.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the profiled step after the timed ones (its parts' device time; compiles the step once more)",
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    sizes = SMALL_SIZES if args.small else PRESETS[args.preset]
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not 0 <= args.warmup < args.steps:
        ap.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    impls = [i for i in args.impls.split(",") if i]
    unknown = set(impls) - set(IMPLS + MORE_IMPLS)
    if unknown or not impls:
        ap.error(f"--impls: unknown {sorted(unknown)}; choose from {IMPLS + MORE_IMPLS}")
    if "uccl_capacity" in impls and args.a2a_capacity_factor <= 0:
        ap.error("--impls uccl_capacity needs --a2a-capacity-factor > 0 (its pair buffer's factor)")
    args.impl_list = impls
    return args


def train_argv(args: argparse.Namespace, impl: str) -> list[str]:
    """examples/train_moe.py's arguments for one implementation (the same model for all)."""
    argv = [
        "--lr",
        str(args.lr),
        "--lr-warmup-steps",
        str(args.lr_warmup_steps),
        "--clip-norm",
        str(args.clip_norm),
        "--compute-dtype",
        args.compute_dtype,
        "--ep-impl",
        "uccl" if impl in MORE_IMPLS else impl,
        "--json",
        "--time-every",
        "0" if args.no_parts else str(args.steps),
        "--seed",
        str(args.seed),
        "--steps",
        str(args.steps),
        "--batch-per-device",
        str(args.batch_per_device),
        "--seq-len",
        str(args.seq_len),
        "--d-model",
        str(args.d_model),
        "--d-ff",
        str(args.d_ff),
        "--heads",
        str(args.heads),
        "--experts",
        str(args.experts),
        "--top-k",
        str(args.top_k),
        "--layers",
        str(args.layers),
    ]
    if args.scan_layers:
        argv.append("--scan-layers")
    if not args.no_profile:
        argv.append("--profile-parts")
    if impl == "uccl_sized":
        argv += ["--pair-buffer-factor", str(args.pair_buffer_factor)]
    if impl in ("all_to_all", "uccl_capacity") and args.a2a_capacity_factor > 0:
        argv += ["--capacity-factor", str(args.a2a_capacity_factor)]
    return argv


def error_line(text: str, limit: int = 160) -> str:
    """The exception line of a child's traceback (JAX adds notes after it), shortened for a table cell."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    pattern = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)|Killed|Segmentation fault)\b")
    found = [l for l in lines if pattern.match(l)]
    line = found[-1] if found else (lines[-1] if lines else "no output")
    return common.short_error(line, limit)


def child_env(args: argparse.Namespace) -> dict[str, str]:
    """The children's environment. jax_uccl_ep's NVLink buffer keeps its default (UCCL_EP_NVL_BUFFER_BYTES, 1 GiB):
    float32 dispatch/combine of 16384 tokens x 2048 on 2 GPUs need 513 MiB (jax_uccl_ep.nvl_buffer_bytes)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.cpu:
        env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(args.devices))
    env.setdefault("UCCL_EP_TIMEOUT_S", "120")
    return env


def run_impl(args: argparse.Namespace, impl: str, env: dict[str, str]) -> dict[str, Any]:
    """Trains with one implementation in a child process; returns its summary plus timing, or an error."""
    cmd = [sys.executable, TRAIN, *train_argv(args, impl)]
    result: dict[str, Any] = {"impl": impl, "command": " ".join(["python", os.path.relpath(TRAIN)] + cmd[2:])}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        result["error"] = f"timed out after {args.timeout:.0f} s"
        result["stdout_tail"] = out[-2000:]
        return result
    result["wall_s"] = time.perf_counter() - start
    if args.verbose:
        print(proc.stdout, end="", flush=True)
    summary = None
    for line in proc.stdout.splitlines():
        if line.startswith(JSON_MARK):
            summary = json.loads(line[len(JSON_MARK) :])
    if proc.returncode != 0 or summary is None:
        result["error"] = error_line(proc.stderr or proc.stdout)
        if proc.returncode < 0:
            result["error"] = f"killed by signal {-proc.returncode}; " + result["error"]
        result["stderr_tail"] = proc.stderr[-4000:]
        return result
    steps_ms = summary["step_ms"][args.warmup :]
    median_ms = statistics.median(steps_ms)
    result.update(summary)
    result.update(
        step_ms_median=median_ms,
        step_ms_min=min(steps_ms),
        first_step_s=summary["step_ms"][0] / 1e3,
        tokens_per_s=summary["tokens_per_step"] / (median_ms / 1e3),
        final_loss=summary["losses"][-1],
    )
    result["header"] = next((l for l in proc.stdout.splitlines() if l.startswith("train_moe:")), "")
    return result


def dropped_share(result: dict[str, Any]) -> str:
    """The (token, expert) pairs an implementation dropped, as a share of all pairs over the steps."""
    if "pairs_dropped" not in result:
        return "n/a"
    return f"{sum(result['pairs_dropped']) / (result['pairs_per_step'] * len(result['pairs_dropped'])):.2%}"


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    by_impl = {r["impl"]: r for r in results if "error" not in r}
    uccl_ms = by_impl["uccl"]["step_ms_median"] if "uccl" in by_impl else None
    dense_losses = by_impl["dense"]["losses"] if "dense" in by_impl else None
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["impl"], "", *["n/a"] * (len(HEADERS) - 3), r["error"]])
            continue
        ms = r["step_ms_median"]
        ratio = f"{ms / uccl_ms:.2f}x" if uccl_ms else "n/a"
        diff = (
            f"{max(abs(a - b) for a, b in zip(r['losses'], dense_losses)):.1e}"
            if dense_losses and len(dense_losses) == len(r["losses"])
            else "n/a"
        )
        experts = {"dense": "all", "all_to_all": "batched"}.get(r["impl"], "grouped")
        layer = "/".join(f"{r[k]:.2f}" for k in ("moe_fwd_ms", "moe_fwd_bwd_ms") if k in r)
        parts = "/".join(f"{r[k]:.2f}" for k in ("router_ms", "dispatch_ms", "experts_ms", "combine_ms") if k in r)
        profile = r.get("profile_ms") or {}
        profiled = "/".join(
            f"{profile[k]:.2f}"
            for k in ("router", "dispatch", "pair_layout", "experts", "combine", "other")
            if k in profile
        )
        rows.append(
            [
                r["impl"],
                experts,
                f"{ms:.1f}",
                f"{r['step_ms_min']:.1f}",
                f"{r['tokens_per_s']:.0f}",
                ratio,
                f"{r['final_loss']:.4f}",
                diff,
                dropped_share(r),
                layer or "-",
                parts or "-",
                profiled or "-",
                f"{r['first_step_s']:.1f}",
                "",
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = child_env(args)
    # The parent never imports jax: on GPUs that would take the devices' memory away from the children.
    header = common.run_header("see the table's title")
    tokens = args.batch_per_device * args.seq_len
    config = {k: getattr(args, k) for k in GPU_SIZES} | {
        "a2a_capacity_factor": args.a2a_capacity_factor,
        "pair_buffer_factor": args.pair_buffer_factor,
        "compute_dtype": args.compute_dtype,
        "preset": None if args.small else args.preset,
        "seed": args.seed,
        "tokens_per_device": tokens,
        "cpu": args.cpu,
        "scan_layers": args.scan_layers,
    }
    print(f"# {header}", flush=True)
    print(f"# config: {config}", flush=True)

    results = []
    for impl in args.impl_list:
        res = run_impl(args, impl, env)
        status = res.get("error") or (
            f"{res['step_ms_median']:.1f} ms/step, {res['tokens_per_s']:.0f} tok/s, final loss {res['final_loss']:.4f}"
        )
        print(f"# {impl}: {status} ({res.get('wall_s', args.timeout):.1f} s)", flush=True)
        if "header" in res:
            print(f"#   {res['header']}", flush=True)
        results.append(res)

    ok = [r for r in results if "error" not in r]
    desc = f"{ok[0]['devices']}x {ok[0]['device_kind']}" if ok else "? (no implementation ran)"
    header["device"] = desc
    if args.out:
        common.write_json(args.out, {"header": header, "config": config, "results": results})
    title = (
        f"training step on {desc}, one process: d_model {args.d_model}, d_ff {args.d_ff}, heads {args.heads}, "
        f"{args.experts} experts top-{args.top_k}, {args.layers} layers, {args.batch_per_device}x{args.seq_len} "
        f"tokens/device, float32 AdamW, experts in {args.compute_dtype} (auto: bf16 on GPUs), all_to_all at capacity "
        f"factor {args.a2a_capacity_factor:g}, median of steps {args.warmup + 1}-{args.steps}"
        + (", layers scanned" if args.scan_layers else "")
    )
    common.print_table(HEADERS, table_rows(results), title=title)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
