"""One MoE layer at decode sizes, per step, with each expert-parallel implementation in the same run.

A decode step sends a few hundred tokens per rank through the MoE feed-forward; the exchange's latency, not its
bandwidth, sets the step time. This times the package's MoE layer (jax_uccl_ep.layers) and the baselines of
examples/moe_layer.py on the same parameters and tokens (the same function: router, SwiGLU experts):

  uccl LL fp8 / bf16   layers.moe_ffn_decode (jax_uccl_ep low-latency dispatch/combine, static buffers)
  uccl LL fp8 batched  the same with its experts as batched matmuls over every slot (grouped_matmul="xla")
  uccl normal          layers.moe_ffn_local (jax_uccl_ep dispatch/combine)
  all_to_all           moe_layer.moe_ffn_all_to_all (jax.lax.all_to_all, fixed capacity, never drops)
  dense                moe_layer.moe_ffn_dense (layers.moe_ffn_reference, expert weights all-gathered; no EP)

Each layer runs `--steps` times in one jit, unrolled, each step's output feeding the next step's input; the time
is the median over `--repeats` of (call time / steps). All layers must agree with dense (checked on the first step;
FP8 within its bound).

    python bench/decode_step.py                      # the devices JAX finds
    python bench/decode_step.py --cpu --small        # smoke test on CPU devices
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank per step")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--impls", default="uccl_ll_fp8,uccl_ll_fp8_batched,uccl_ll_bf16,uccl,all_to_all,dense")
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test)")
    ap.add_argument("--cpu", action="store_true", help="CPU devices (JAX_NUM_CPU_DEVICES, default 2)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.small:
        args.tokens, args.d_model, args.d_ff, args.experts, args.top_k, args.steps = 8, 256, 128, 8, 2, 4
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")

    import common
    import jax
    import jax.numpy as jnp
    import moe_layer as ml
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_uccl_ep as ep
    from jax_uccl_ep import layers

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("ep",))
    r, t = len(devices), args.tokens
    ep.initialize()
    dtype = jnp.bfloat16
    params = layers.init_moe_params(
        jax.random.key(0), d_model=args.d_model, d_ff=args.d_ff, num_experts=args.experts, dtype=dtype
    )
    specs = layers.moe_param_specs("ep")
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    x = jax.device_put(jax.random.normal(jax.random.key(1), (r * t, args.d_model), dtype), NamedSharding(mesh, P("ep")))
    config = layers.MoEConfig(num_experts=args.experts, top_k=args.top_k)
    # The decode layer's experts as batched matmuls over every slot (XLA) rather than on the rows received.
    batched = layers.MoEConfig(num_experts=args.experts, top_k=args.top_k, grouped_matmul="xla")
    kw = dict(axis_name="ep", max_tokens_per_rank=t)
    impls = {
        "uccl_ll_fp8": lambda p, x: layers.moe_ffn_decode(p, x, config, use_fp8=True, **kw),
        "uccl_ll_bf16": lambda p, x: layers.moe_ffn_decode(p, x, config, use_fp8=False, **kw),
        "uccl_ll_fp8_batched": lambda p, x: layers.moe_ffn_decode(p, x, batched, use_fp8=True, **kw),
        "uccl": lambda p, x: layers.moe_ffn_local(p, x, config, axis_name="ep").y,
        "all_to_all": lambda p, x: ml.moe_ffn_all_to_all(p, x, config, axis_name="ep").y,
        "dense": lambda p, x: ml.moe_ffn_dense(p, x, config, axis_name="ep").y,
    }

    def stepped(layer):
        def body(p, x):
            # Normalized so that repeated steps stay in range; the output feeds the next step.
            def step(h):
                y = layer(p, h)
                return (y * jax.lax.rsqrt(jnp.mean(jnp.square(y.astype(jnp.float32))) + 1e-6)).astype(h.dtype)

            return common.looped(step, args.steps, unroll=True)(x)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep")))

    def once(layer):
        return jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep")))

    header = common.run_header(f"{r}x {devices[0].device_kind}")
    reference = np.asarray(once(impls["dense"])(params, x), np.float32)
    rows, results = [], {}
    base = None
    for name in args.impls.split(","):
        try:
            got = np.asarray(once(impls[name])(params, x), np.float32)
            err = float(np.abs(got - reference).max() / (np.abs(reference).max() + 1e-30))
            tm = common.time_jitted(stepped(impls[name]), (params, x), iters=args.steps, repeats=args.repeats)
            base = base or tm.median_s
            results[name] = dict(tm.as_dict(), max_rel_error_vs_dense=err)
            rows.append(
                [
                    name,
                    common.fmt_time(tm.median_s),
                    common.fmt_time(tm.min_s),
                    f"{tm.median_s / base:.2f}x",
                    f"{err:.1e}",
                ]
            )
        except Exception as exc:  # noqa: BLE001
            results[name] = {"error": str(exc)[:500]}
            rows.append([name, "n/a", common.short_error(exc, 50), "", ""])
    ep.check_errors()
    ep.shutdown()
    print(f"# {header}")
    common.print_table(
        ["layer", "time/step", "min", "vs first", "max rel err vs dense"],
        rows,
        title=f"MoE layer per decode step on {r}x {devices[0].device_kind}: {t} tokens/rank, "
        f"d_model {args.d_model}, d_ff {args.d_ff}, top-{args.top_k} of {args.experts}, bf16",
    )
    if args.out:
        common.write_json(args.out, {"header": header, "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
