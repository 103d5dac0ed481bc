"""The expert layout's steps after token rows on one device, as the NVLink and GPU-initiated paths run them: the
counting sort of the received (row, slot) pairs, the rows' move into their pair slots (XLA's gather, which writes
every slot, zeros outside the groups; or the FFI's expand_pairs, which copies the slots inside the groups only:
zero_padding=False, the layer's), and the sum of each row's pairs back (combine's first step: the FFI's sum_pairs;
XLA's gather and sum beside it).

The problem is one rank of the fine-grained config on 4 GPUs (4096 tokens per GPU, top-8 of 64 experts, d_model
2048): the rows this rank receives (each names 1 to 8 of its 16 local experts) in a buffer of the layer's worst
case, R * T * min(K, E/R) pair slots. Each case is its own jit, called --iters times back to back (the device
queue stays full) and ended by block_until_ready; time = median over --repeats of wall time / iters, and with
torch the device time a call on device 0 (CUPTI, every kernel and copy the call runs).

    python bench/pair_layout.py --out $OUT/pair_layout.json
    python bench/pair_layout.py --cpu --tokens 256 --hidden 128   # smoke test on a CPU device
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def received_routing(tokens: int, ranks: int, topk: int, experts: int, seed: int):
    """[C, K] local expert of each slot of the rows rank 0 receives (-1 where a slot names another rank's
    expert): every token of every rank with at least one of its top-k among rank 0's experts, uniform routing."""
    import numpy as np

    rng = np.random.default_rng(seed)
    local = experts // ranks
    chosen = np.argsort(rng.random((ranks * tokens, experts)), axis=1)[:, :topk]  # distinct experts per token
    mine = np.where(chosen < local, chosen, -1).astype(np.int32)
    return mine[(mine >= 0).any(axis=1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="CPU device (smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_uccl_ep import _pairs

    groups = args.experts // args.ranks
    expert = received_routing(args.tokens, args.ranks, args.topk, args.experts, seed=0)
    c = expert.shape[0]
    slots = _pairs.never_dropping_pairs(args.ranks * args.tokens, args.topk, groups, 1)
    rng = np.random.default_rng(1)
    rows = jnp.asarray(rng.standard_normal((c, args.hidden)), jnp.bfloat16)
    expert_d = jnp.asarray(expert)
    layout = jax.jit(lambda e: _pairs.pair_layout(e, c, groups, 1, slots))(expert_d)
    pairs_y = jnp.asarray(rng.standard_normal((slots, args.hidden)), jnp.bfloat16)
    valid = int(np.asarray(layout.num_tokens_per_expert).sum())

    cases = [
        ("pair layout (counting sort)", lambda e: _pairs.pair_layout(e, c, groups, 1, slots), (expert_d,)),
        (
            "rows to slots, zeros (XLA gather)",
            lambda r, p: _pairs.expand(r, p, None, True),
            (rows, layout.pair_row),
        ),
        (
            "rows to slots, unwritten (expand_pairs)",
            lambda r, p: _pairs.expand(r, p, None, False),
            (rows, layout.pair_row),
        ),
        (
            "pairs back to float32 rows (XLA gather, sum)",
            lambda y, r, p: _pairs.reduce_pairs(y, r, p, True, jnp.float32, False),
            (pairs_y, layout.pair_row, layout.pair_of),
        ),
        (
            "pairs back to bf16 rows (XLA gather, sum)",
            lambda y, r, p: _pairs.reduce_pairs(y, r, p, True, jnp.bfloat16, False),
            (pairs_y, layout.pair_row, layout.pair_of),
        ),
        (
            "pairs back to bf16 rows (sum_pairs)",
            lambda y, r, p: _pairs.reduce_pairs(y, r, p, False, jnp.bfloat16, True),
            (pairs_y, layout.pair_row, layout.pair_of),
        ),
    ]

    def timed(f, operands) -> float:
        jax.block_until_ready(f(*operands))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.iters):
                out = f(*operands)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - start) / args.iters)
        return statistics.median(times)

    def device_us(f, operands) -> float | None:
        if args.cpu:
            return None
        try:
            activity = common.cupti_activity(lambda: jax.block_until_ready([f(*operands) for _ in range(args.iters)]))
        except Exception:  # noqa: BLE001 - no torch: the wall time stands alone
            return None
        return sum(us for _, us, _ in activity) / args.iters

    results, table = [], []
    for name, fn, operands in cases:
        f = jax.jit(fn)
        row: dict = {"case": name}
        try:
            row["wall_us"] = timed(f, operands) * 1e6
            row["device_us"] = device_us(f, operands)
        except Exception as e:  # noqa: BLE001 - a case that cannot run prints its error
            row["error"] = common.short_error(e, 100)
        results.append(row)
        table.append(
            [
                name,
                f"{row['wall_us']:.1f}" if "wall_us" in row else "n/a",
                f"{row['device_us']:.1f}" if row.get("device_us") is not None else "",
                row.get("error", ""),
            ]
        )
    device = jax.devices()[0]
    title = (
        f"expert layout after token rows on {device.device_kind}: {c} received rows of {args.hidden} bf16, "
        f"{slots} pair slots ({valid} inside the groups), {groups} local experts; median of {args.repeats} x "
        f"{args.iters} calls"
    )
    common.print_table(["step", "wall us/call", "device us/call", "note"], table, title=title)
    if args.out:
        header = common.run_header("CPU device (smoke test)" if args.cpu else device.device_kind)
        common.write_json(
            args.out,
            {"header": header, "args": vars(args), "rows": c, "slots": slots, "valid": valid, "results": results},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
