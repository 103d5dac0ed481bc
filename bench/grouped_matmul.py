"""The MoE layer's expert matmul on one GPU: the package's grouped matmul beside XLA's ragged_dot and the
batched-einsum floor, forward and forward+backward, in one run.

The problem is the layer's on one rank of the fine-grained config on 4 GPUs (64 experts top-8, 4096 tokens per
GPU, d_model 2048, d_ff 1024): 32768 valid (token, expert) pairs in a buffer of 131072 slots (the layer's
worst case, R * T * K), spread over 16 local experts at random, times [16, 2048, 1024]. Measured:

  grouped, slots   jax_uccl_ep.grouped.grouped_matmul on the 131072-slot buffer (what the layer runs)
  grouped, rows    the same on exactly the 32768 valid rows
  xla, rows        jax.lax.ragged_dot on the 32768 valid rows (XLA: one dense matmul per group on GPUs)
  einsum floor     a batched einsum over an expert-major [16, 2560, 2048] buffer (capacity factor 1.25:
                   MaxText's GPU path; 1.25x the useful work)
  dense            one [32768, 2048] x [2048, 1024] matmul: the rate the useful work could run at

Time: median over --repeats of (wall time of --iters calls in one jit) / iters. TFLOP/s counts the useful work
only (2 * valid rows * K * N forward, 3x that forward+backward), so the floor's padding costs it. Every case's
loop consumes all of its outputs (y against a random cotangent; forward+backward also the loss and the sums of both
gradients), the same few elementwise passes for every case, and its operands pass an optimization barrier each
iteration. Without these XLA simplified the dense and einsum cases (a cotangent of ones, one element of a gradient,
a dropped forward product, work hoisted out of the loop: it once timed dense forward+backward at 1190 TFLOP/s,
past an H200's peak), while the kernels under a custom VJP ran in full.

    python bench/grouped_matmul.py --out $OUT/grouped_matmul.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32768, help="valid (token, expert) pairs")
    ap.add_argument("--slots", type=int, default=131072, help="the layer's buffer (rows and padding)")
    ap.add_argument("--groups", type=int, default=16, help="local experts")
    ap.add_argument("--k", type=int, default=2048, help="contracted dimension (d_model)")
    ap.add_argument("--n", type=int, default=1024, help="output dimension (d_ff)")
    ap.add_argument("--capacity-factor", type=float, default=1.25, help="the einsum floor's padding")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_uccl_ep.grouped import grouped_backend, grouped_matmul

    rng = np.random.default_rng(0)
    g, k, n, rows = args.groups, args.k, args.n, args.rows
    sizes = np.bincount(rng.integers(0, g, rows), minlength=g).astype(np.int32)
    bf16 = jnp.bfloat16
    lhs_slots = jnp.asarray(rng.standard_normal((args.slots, k)), bf16)
    lhs_rows = lhs_slots[:rows]
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), bf16)
    capacity = int(np.ceil(args.capacity_factor * rows / g))
    lhs_ecd = jnp.asarray(rng.standard_normal((g, capacity, k)), bf16)
    dense_rhs = rhs[0]
    gs = jnp.asarray(sizes)
    backend = grouped_backend("auto", bf16)

    def grouped(a, b):
        return grouped_matmul(a, b, gs)

    def xla(a, b):
        return jax.lax.ragged_dot(a, b, gs, preferred_element_type=jnp.float32).astype(bf16)

    # (name, the product, its operands)
    cases = [
        (f"grouped ({backend}), slots", grouped, (lhs_slots, rhs)),
        (f"grouped ({backend}), rows", grouped, (lhs_rows, rhs)),
        ("xla ragged_dot, rows", xla, (lhs_rows, rhs)),
        ("einsum floor [G, C, K]", lambda a, b: jnp.einsum("eck,ekn->ecn", a, b), (lhs_ecd, rhs)),
        ("dense [rows, K] x [K, N]", lambda a, b: a @ b, (lhs_rows, dense_rhs)),
    ]

    def timed(fn, operands) -> float:
        """Seconds per call of fn(*operands) (a float32 scalar), args.iters calls in one jitted loop. The operands
        pass through an optimization barrier each iteration, so XLA can neither hoist the loop-invariant work out
        of the loop nor specialise it to constants."""

        def loop(operands):
            def body(_, carry):
                operands, acc = jax.lax.optimization_barrier(carry)
                return operands, acc + fn(*operands)

            return jax.lax.fori_loop(0, args.iters, body, (operands, jnp.zeros((), jnp.float32)))[1]

        f = jax.jit(loop)
        jax.block_until_ready(f(operands))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(f(operands))
            times.append((time.perf_counter() - start) / args.iters)
        return statistics.median(times)

    def forward(fn):
        def step(a, b, cotangent):
            return jnp.sum(fn(a, b).astype(jnp.float32) * cotangent)

        return step

    def forward_backward(fn):
        def step(a, b, cotangent):
            # The loss value is kept too: without it XLA may drop the forward product, which the gradients of a
            # linear map do not need.
            loss, (da, db) = jax.value_and_grad(forward(fn), argnums=(0, 1))(a, b, cotangent)
            return loss + jnp.sum(da.astype(jnp.float32)) + jnp.sum(db.astype(jnp.float32))

        return step

    flops = 2.0 * rows * k * n
    results, table = [], []
    for name, fn, (a, b) in cases:
        row = {"case": name}
        cotangent = jnp.asarray(rng.standard_normal(jax.eval_shape(fn, a, b).shape), jnp.float32)
        for what, f, work in (("fwd", forward(fn), flops), ("fwd+bwd", forward_backward(fn), 3 * flops)):
            try:
                seconds = timed(f, (a, b, cotangent))
                row[what + "_ms"] = seconds * 1e3
                row[what + "_tflops"] = work / seconds / 1e12
            except Exception as e:  # noqa: BLE001 - a case that cannot run prints n/a
                row[what + "_error"] = common.short_error(str(e).splitlines()[0] if str(e) else repr(e), 100)
        results.append(row)
    dense = next(r for r in results if r["case"].startswith("dense"))
    for r in results:
        cells = [r["case"]]
        for what in ("fwd", "fwd+bwd"):
            if what + "_ms" in r:
                share = r[what + "_tflops"] / dense[what + "_tflops"] if what + "_tflops" in dense else float("nan")
                cells += [f"{r[what + '_ms']:.3f}", f"{r[what + '_tflops']:.0f}", f"{share:.0%}"]
            else:
                cells += ["n/a", "n/a", r.get(what + "_error", "")]
        table.append(cells)
    header = common.run_header(f"{jax.devices()[0].device_kind}")
    if args.out:
        common.write_json(args.out, {"header": header, "args": vars(args), "sizes": sizes.tolist(), "results": results})
    common.print_table(
        ["case", "fwd ms", "TFLOP/s", "of dense", "fwd+bwd ms", "TFLOP/s", "of dense"],
        table,
        title=(
            f"grouped matmul on {jax.devices()[0].device_kind}, bf16: {rows} valid rows of {args.slots} slots x "
            f"[{g}, {k}, {n}], useful TFLOP/s, median of {args.repeats} x {args.iters} calls"
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
