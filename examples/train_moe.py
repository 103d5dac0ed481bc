"""Train a small MoE transformer with expert parallelism (jax_uccl_ep dispatch/combine) on synthetic data.

The data are sequences of a fixed random Markov chain over a small vocabulary, so the best achievable loss is the
chain's entropy rate (printed at the end) and the loss visibly falls towards it. The model: token + position
embeddings, ``--layers`` blocks of [causal multi-head attention, MoE feed-forward] with pre-RMSNorm and residuals,
and an output head. Training is data parallel over the mesh axis "ep" (each device its own slice of the batch) and
expert parallel over the same axis (each device its ``experts / R`` experts).

Run it on 4 local CPU processes, one device each::

    python -m jax_uccl_ep.launch -n 4 examples/train_moe.py --steps 50

or in one process with 4 CPU devices, or on the GPUs of a machine (one process per GPU)::

    JAX_NUM_CPU_DEVICES=4 python examples/train_moe.py --steps 5
    python -m jax_uccl_ep.launch -n 8 examples/train_moe.py --steps 50

The MoE feed-forward is the package's layer, ``jax_uccl_ep.layers`` (softmax top-k router, SwiGLU experts as
grouped matmuls, Switch Transformer's load-balancing loss weighted by ``--aux-loss-coef``). ``--ep-impl`` picks how
its tokens reach the experts; all compute the same function on the same parameters, so the loss curves agree to
float rounding:

* ``uccl`` (default): jax_uccl_ep dispatch/combine (``jax_uccl_ep.layers.moe_ffn_local``; ``--capacity-factor``
  bounds the (token, expert) pairs each device receives and drops the rest, tokens in order of source device;
  default: never drops);
* ``all_to_all``: MaxText's GPU path: ``jax.lax.all_to_all`` of a fixed-capacity expert-major ``[E, C, D]``
  buffer, the experts as batched matmuls (``examples/moe_layer.py``'s ``moe_ffn_all_to_all``; C slots per expert
  from ``--capacity-factor`` or ``--capacity``, default tokens: never drops);
* ``ragged``: ``jax.lax.ragged_all_to_all``, MaxText's dropless path (``moe_ffn_ragged``; not on XLA:CPU);
* ``dense``: the package's reference (``jax_uccl_ep.layers.moe_ffn_reference``: every expert on every token, expert
  weights all-gathered).

``--generate N`` then serves the trained model: greedy decoding of N tokens for every sequence of a batch, one
token a step, with a key/value cache and each MoE layer through ``layers.moe_ffn_decode`` (low-latency dispatch and
combine into static per-expert buffers, the router weights carried to the experts' ranks; FP8 rows with
``--decode-fp8``). It checks the decoded logits against the training forward over the finished sequences (the
same function, computed whole) and reports how many generated transitions the chain allows.

``bench/train_step.py`` times the four side by side. The printed ``loss`` is the next-token cross-entropy (what the
chain's entropy bounds); ``aux`` is the load-balancing loss summed over the layers (about ``--layers`` times
``--aux-loss-coef`` when the experts are balanced), and the step minimizes their sum.

Timing columns are honest about what they measure: ``ms/step`` and ``tok/s`` are the wall time of a whole training
step (forward, backward, optimizer; host-synchronized). Every ``--time-every`` steps the script also times, in
separate jitted calls on this step's shapes (tokens per device, d_model, top-k; median of 3), one MoE layer
forward (``moe fwd``) and, for ``--ep-impl uccl``, one standalone ``dispatch`` and one standalone ``combine`` with
random routing. Those are not slices of the training step; ``--profile-parts`` gives the slices: one more step,
profiled, its device time split by the layer's named scopes (``layers.SCOPES``), forward and backward together.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_layer  # (the baselines beside the package's layer, next to this file)
import step_profile

import jax_uccl_ep as ep
from jax_uccl_ep import layers

AXIS = "ep"
JSON_MARK = "TRAIN_MOE_JSON "
# LayerTimer's standalone timings (ms), in the order they print.
PART_KEYS = ("moe_fwd_ms", "moe_fwd_bwd_ms", "router_ms", "dispatch_ms", "experts_ms", "combine_ms")
PROFILE_TOP = 8  # heaviest kernels of each part the profile lists


class Config(NamedTuple):
    """Model sizes."""

    vocab: int = 64
    seq_len: int = 32
    d_model: int = 64
    num_heads: int = 4
    d_ff: int = 128
    num_experts: int = 8
    top_k: int = 2
    num_layers: int = 2
    aux_loss_coef: float = 0.01  # Switch Transformer's load-balancing loss, per MoE layer
    capacity_factor: float | None = None  # pairs a device may receive per its own tokens' slots (None: never drops)
    pair_buffer_factor: float | None = None  # uccl, never dropping: a buffer of factor x the mean pairs when they fit
    compute_dtype: str | None = None  # the experts' matmuls (None: bfloat16 on GPUs, the parameters' elsewhere)
    scan_layers: bool = False  # the layers' parameters stacked and run by one jax.lax.scan (compiled once)

    def moe(self) -> layers.MoEConfig:
        """The MoE layers' configuration."""
        return layers.MoEConfig(
            num_experts=self.num_experts,
            top_k=self.top_k,
            aux_loss_coef=self.aux_loss_coef,
            capacity_factor=self.capacity_factor,
            pair_buffer_factor=self.pair_buffer_factor,
            compute_dtype=self.compute_dtype,
        )


# ----------------------------------------------------------------------------------------------- data


class MarkovData:
    """Sequences from a fixed random Markov chain: each token has a few likely successors."""

    def __init__(self, vocab: int, seed: int, successors: int = 4):
        rng = np.random.default_rng([seed, 1234])
        trans = np.zeros((vocab, vocab))
        for i in range(vocab):
            nxt = rng.choice(vocab, size=successors, replace=False)
            trans[i, nxt] = rng.dirichlet(np.ones(successors))
        self.trans = trans
        self.cum = np.cumsum(trans, axis=1)
        self.vocab = vocab
        self.seed = seed

    def entropy_rate(self) -> float:
        """Nats per token of an ideal predictor (the loss floor), under the stationary distribution."""
        pi = np.full(self.vocab, 1.0 / self.vocab)
        for _ in range(1000):
            pi = pi @ self.trans
        logs = np.log(np.where(self.trans > 0, self.trans, 1.0))
        return float(-(pi[:, None] * self.trans * logs).sum())

    def batch(self, step: int, num_sequences: int, length: int) -> np.ndarray:
        """[num_sequences, length] int32, a pure function of (seed, step): every process builds the same batch."""
        rng = np.random.default_rng([self.seed, step])
        out = np.empty((num_sequences, length), np.int32)
        out[:, 0] = rng.integers(0, self.vocab, num_sequences)
        for t in range(1, length):
            u = rng.random(num_sequences)
            nxt = (self.cum[out[:, t - 1]] < u[:, None]).sum(axis=1)
            out[:, t] = np.minimum(nxt, self.vocab - 1)
        return out


# ----------------------------------------------------------------------------------------------- model


def init_params(key: jax.Array, cfg: Config) -> dict:
    """Global parameters (all experts). Shard them with `param_specs`."""
    keys = jax.random.split(key, 3 + cfg.num_layers)
    d = cfg.d_model
    params: dict[str, Any] = {
        "embed": jax.random.normal(keys[0], (cfg.vocab, d)) * 0.02,
        "pos": jax.random.normal(keys[1], (cfg.seq_len, d)) * 0.02,
        "head": jax.random.normal(keys[2], (d, cfg.vocab)) * d**-0.5,
        "norm_f": jnp.ones((d,)),
        "layers": [],
    }
    for i in range(cfg.num_layers):
        k_qkv, k_out, k_moe = jax.random.split(keys[3 + i], 3)
        params["layers"].append(
            {
                "norm_attn": jnp.ones((d,)),
                "qkv": jax.random.normal(k_qkv, (d, 3 * d)) * d**-0.5,
                "out": jax.random.normal(k_out, (d, d)) * d**-0.5 / cfg.num_layers,
                "norm_moe": jnp.ones((d,)),
                "moe": layers.init_moe_params(k_moe, d_model=d, d_ff=cfg.d_ff, num_experts=cfg.num_experts),
            }
        )
    if cfg.scan_layers:  # one tree of [layers, ...] arrays
        params["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *params["layers"])
    return params


def param_specs(cfg: Config) -> dict:
    """Everything replicated except the experts, which are split over the EP axis."""
    layer = {"norm_attn": P(), "qkv": P(), "out": P(), "norm_moe": P(), "moe": layers.moe_param_specs(AXIS)}
    if cfg.scan_layers:
        stacked = jax.tree.map(lambda s: P(None, *s), layer, is_leaf=lambda s: isinstance(s, P))
        return {"embed": P(), "pos": P(), "head": P(), "norm_f": P(), "layers": stacked}
    return {"embed": P(), "pos": P(), "head": P(), "norm_f": P(), "layers": [layer] * cfg.num_layers}


def layer_params(params: dict, cfg: Config, i: int) -> dict:
    """Layer i's parameters, stacked (--scan-layers) or not."""
    return jax.tree.map(lambda a: a[i], params["layers"]) if cfg.scan_layers else params["layers"][i]


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def attention(layer: dict, x: jax.Array, num_heads: int) -> jax.Array:
    """Causal multi-head self-attention over x [B, S, D]."""
    b, s, d = x.shape
    q, k, v = jnp.split(x @ layer["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, s, num_heads, d // num_heads) for a in (q, k, v))
    scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) * (d // num_heads) ** -0.5
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, -1e30)
    out = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, d)
    return out @ layer["out"]


MoeFn = Callable[[dict, jax.Array], layers.MoEOutput]
EP_IMPLS = tuple(moe_layer.LAYERS)  # uccl, all_to_all, ragged, dense


def moe_fn_for(impl: str, cfg: Config, capacity: int | None = None) -> MoeFn:
    """The MoE feed-forward of one rank: (params, x [..., D]) -> MoEOutput (inside shard_map).

    capacity: all_to_all's slots per (sender, expert), overriding cfg.capacity_factor; None for the others.
    """
    if capacity is not None:
        if impl != "all_to_all":
            raise ValueError(f"capacity (slots per sender and expert) is all_to_all's; {impl} takes capacity_factor")
        return partial(moe_layer.moe_ffn_all_to_all, config=cfg.moe(), axis_name=AXIS, capacity=capacity)
    return moe_layer.local_layer(impl, cfg.moe(), axis_name=AXIS)


def forward(params: dict, tokens: jax.Array, cfg: Config, moe_fn: MoeFn) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logits [B, S, vocab], this rank's load-balancing loss and its dropped (token, expert) pairs, each summed
    over the layers) for this rank's tokens [B, S] (inside shard_map)."""
    s = tokens.shape[1]
    x = params["embed"][tokens] + params["pos"][None, :s]
    carry = (x, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))

    def block(carry: tuple[jax.Array, ...], layer: dict) -> tuple[tuple[jax.Array, ...], None]:
        x, aux, dropped = carry
        x = x + attention(layer, rms_norm(x, layer["norm_attn"]), cfg.num_heads)
        out = moe_fn(layer["moe"], rms_norm(x, layer["norm_moe"]))
        return (x + out.y, aux + out.aux_loss, dropped + jnp.sum(out.stats.pairs_dropped)), None

    if cfg.scan_layers:
        # Each rank's aux loss and drops are its own: the loop's carry says so from the start (shard_map checks it).
        carry = (x, *(jax.lax.pcast(c, AXIS, to="varying") for c in carry[1:]))
        carry, _ = jax.lax.scan(block, carry, params["layers"])
    else:
        for layer in params["layers"]:
            carry, _ = block(carry, layer)
    x, aux, dropped = carry
    return rms_norm(x, params["norm_f"]) @ params["head"], aux, dropped


def local_loss(params: dict, batch: jax.Array, cfg: Config, moe_fn: MoeFn) -> tuple[jax.Array, dict]:
    """(cross-entropy + aux loss, {"ce", "aux", "dropped"}); each rank sees its slice [B, S+1].

    The cross-entropy is the mean over the whole (global) batch; the aux loss the ranks' mean, as
    ``layers.moe_ffn`` reports it; dropped the (token, expert) pairs dropped on all ranks and layers.
    """
    logits, aux, dropped = forward(params, batch[:, :-1], cfg, moe_fn)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)
    ce, aux = jax.lax.pmean((jnp.mean(nll), aux), AXIS)
    return ce + aux, {"ce": ce, "aux": aux, "dropped": jax.lax.psum(dropped, AXIS)}


# ----------------------------------------------------------------------------------------------- decoding


def attention_step(
    layer: dict, x: jax.Array, cache: tuple[jax.Array, jax.Array], t: jax.Array, num_heads: int
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """`attention` for position t alone: x [B, D] the new tokens' inputs, cache (keys, values) [B, S, H, C] holding
    positions < t; returns its output [B, D] and the cache with position t written."""
    b, d = x.shape
    c = d // num_heads
    q, k, v = (a.reshape(b, num_heads, c) for a in jnp.split(x @ layer["qkv"], 3, axis=-1))
    keys = jax.lax.dynamic_update_slice_in_dim(cache[0], k[:, None], t, axis=1)
    values = jax.lax.dynamic_update_slice_in_dim(cache[1], v[:, None], t, axis=1)
    scores = jnp.einsum("bhc,bkhc->bhk", q, keys) * c**-0.5
    scores = jnp.where(jnp.arange(keys.shape[1]) <= t, scores, -1e30)
    out = jnp.einsum("bhk,bkhc->bhc", jax.nn.softmax(scores, axis=-1), values).reshape(b, d)
    return out @ layer["out"], (keys, values)


def generate(params: dict, prompts: jax.Array, num_tokens: int, cfg: Config, use_fp8: bool) -> tuple[jax.Array, ...]:
    """Greedy decoding on this rank (inside shard_map): prompts [B] (one token each) -> (tokens [B, 1 + num_tokens],
    logits [B, num_tokens, vocab] of each step). A step embeds the B newest tokens at their position, runs each
    block on them alone (attention against the key/value cache, the MoE feed-forward by `layers.moe_ffn_decode`:
    B tokens a rank, the low-latency buffers' static size) and appends the argmax."""
    b, layers_ = prompts.shape[0], [layer_params(params, cfg, i) for i in range(cfg.num_layers)]
    c = cfg.d_model // cfg.num_heads
    empty = jnp.zeros((b, cfg.seq_len, cfg.num_heads, c), params["embed"].dtype)
    tokens = jnp.zeros((b, 1 + num_tokens), jnp.int32).at[:, 0].set(prompts)
    logits = jnp.zeros((b, num_tokens, cfg.vocab), jnp.float32)

    def step(t, carry):
        tokens, logits, caches = carry
        x = params["embed"][tokens[:, t]] + params["pos"][t]
        written = []
        for layer, cache in zip(layers_, caches):
            a, cache = attention_step(layer, rms_norm(x, layer["norm_attn"]), cache, t, cfg.num_heads)
            x = x + a
            x = x + layers.moe_ffn_decode(
                layer["moe"],
                rms_norm(x, layer["norm_moe"]),
                cfg.moe(),
                axis_name=AXIS,
                max_tokens_per_rank=b,
                use_fp8=use_fp8,
            )
            written.append(cache)
        out = (rms_norm(x, params["norm_f"]) @ params["head"]).astype(jnp.float32)
        tokens = tokens.at[:, t + 1].set(jnp.argmax(out, axis=-1).astype(jnp.int32))
        return tokens, logits.at[:, t].set(out), tuple(written)

    # The loop's carry is this rank's from the start (shard_map checks it).
    logits, empty = (jax.lax.pcast(a, AXIS, to="varying") for a in (logits, empty))
    caches = tuple((empty, empty) for _ in layers_)
    tokens, logits, _ = jax.lax.fori_loop(0, num_tokens, step, (tokens, logits, caches))
    return tokens, logits


def check_generation(
    params: dict, mesh: Mesh, cfg: Config, moe_fn: MoeFn, data: MarkovData, args: argparse.Namespace
) -> dict[str, Any]:
    """Decodes --generate tokens for --batch-per-device prompts a device (twice: the second call is timed), then
    runs the training forward over the finished sequences: its logits at each position must be the decoded ones
    (the same function; float rounding apart). Returns the figures the summary reports."""
    r, n, b = mesh.size, args.generate, args.batch_per_device
    specs = param_specs(cfg)
    decode = jax.jit(
        jax.shard_map(
            partial(generate, num_tokens=n, cfg=cfg, use_fp8=args.decode_fp8),
            mesh=mesh,
            in_specs=(specs, P(AXIS)),
            out_specs=(P(AXIS), P(AXIS)),
        )
    )
    whole = jax.jit(
        jax.shard_map(
            lambda p, t: forward(p, t, cfg, moe_fn)[0], mesh=mesh, in_specs=(specs, P(AXIS)), out_specs=P(AXIS)
        )
    )
    prompts = _global_array(data.batch(10**6, r * b, 1)[:, 0], NamedSharding(mesh, P(AXIS)))
    jax.block_until_ready(decode(params, prompts))  # compiles
    start = time.perf_counter()
    tokens, logits = jax.block_until_ready(decode(params, prompts))
    elapsed = time.perf_counter() - start
    full = whole(params, tokens[:, :-1])
    tokens, logits, full = (
        np.asarray(multihost_utils.process_allgather(a, tiled=True)) for a in (tokens, logits, full)
    )
    scale = float(np.abs(full).max())
    steps = tokens[:, :-1], tokens[:, 1:]
    return {
        "tokens": n,
        "sequences": r * b,
        "decode_ms_per_token": elapsed * 1e3 / n,
        "decode_tokens_per_s": r * b * n / elapsed,
        "max_logit_diff": float(np.abs(logits - full).max()) / max(scale, 1e-30),  # relative to the largest logit
        "argmax_agree": float((full.argmax(-1) == steps[1]).mean()),
        "legal_transitions": float((data.trans[steps[0], steps[1]] > 0).mean()),
        "sample": tokens[0].tolist(),
    }


# ----------------------------------------------------------------------------------------------- timing


def _median_ms(fn: Callable[[], Any], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


class LayerTimer:
    """Standalone jitted MoE-layer / dispatch / combine calls on the training step's shapes."""

    def __init__(
        self,
        mesh: Mesh,
        cfg: Config,
        impl: str,
        tokens_per_rank: int,
        capacity: int | None,
        seed: int,
    ):
        self.impl = impl
        r = mesh.size
        rng = np.random.default_rng([seed, 99])
        shard = NamedSharding(mesh, P(AXIS))
        self.x = _global_array(rng.standard_normal((r * tokens_per_rank, cfg.d_model), np.float32), shard)
        # Random routing: top_k distinct experts per token, random weights summing to one.
        idx = np.argsort(rng.random((r * tokens_per_rank, cfg.num_experts)), axis=1)[:, : cfg.top_k]
        w = rng.random(idx.shape).astype(np.float32)
        self.idx = _global_array(idx.astype(np.int32), shard)
        self.w = _global_array(w / w.sum(axis=1, keepdims=True), shard)
        moe_fn = moe_fn_for(impl, cfg, capacity)
        specs = layers.moe_param_specs(AXIS)
        moe = cfg.moe()
        dtype = moe.experts_dtype(jnp.float32)

        def shard(fn, in_specs, out_specs=P(AXIS)):
            return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

        def layer_grads(p, x):
            return jax.grad(lambda p, x: jnp.sum(moe_fn(p, x).y), argnums=(0, 1))(p, x)

        self.layer = shard(lambda p, x: moe_fn(p, x).y, (specs, P(AXIS)))
        self.layer_grads = shard(layer_grads, (specs, P(AXIS)), (specs, P(AXIS)))
        # The pairs the layer's own dispatch may take (moe_ffn_local's, from the capacity factor).
        pairs = None
        if cfg.capacity_factor is not None:
            pairs = layers.capacity_for(tokens_per_rank, cfg.top_k, r, cfg.capacity_factor, cfg.num_experts)
        # Where the layer runs the load-sized buffer it dispatches token rows and lays their pairs out itself, on
        # the small buffer while a rank's pairs fit (moe_ffn_local): the parts run that way too.
        small = layers.load_sized_pairs(moe, tokens_per_rank, r)

        def dispatch(x, idx, w):
            if small is not None:
                res = ep.dispatch(x.astype(dtype), idx, w, num_experts=cfg.num_experts, axis_name=AXIS)
                return (res.x, res.topk_idx, res.topk_weights, res.num_tokens.reshape(1)), res.handle
            res = ep.dispatch(
                x.astype(dtype),
                idx,
                w,
                num_experts=cfg.num_experts,
                axis_name=AXIS,
                capacity=pairs,
                overflow="drop",
                layout="expert",
            )
            return (res.x, res.num_tokens_per_expert, res.weights), res.handle

        def experts(p, received):
            if small is not None:
                rows, expert, w, num_rows = received
                return layers.swiglu_experts(
                    p,
                    rows,
                    expert,
                    w,
                    num_rows=num_rows[0],
                    pair_buffer=small,
                    compute_dtype=dtype,
                    backend=moe.grouped_matmul,
                )
            pairs, sizes, w = received
            y = layers.swiglu_pairs(p, pairs, sizes, compute_dtype=dtype, backend=moe.grouped_matmul)
            return y.astype(jnp.float32) * w[:, None]

        self.router = shard(lambda p, x: layers.route(p["router"], x, moe)[:2], (specs, P(AXIS)))
        self.dispatch = shard(dispatch, P(AXIS))
        self.experts = shard(experts, (specs, P(AXIS)))
        self.combine = shard(lambda y, handle: ep.combine(y.astype(dtype), handle), P(AXIS))

    def measure(self, moe_params: dict) -> dict[str, float]:
        """Median ms of standalone calls: the layer forward and forward+backward; for uccl also its parts
        (router, dispatch, experts, combine; forward)."""
        out = {
            "moe_fwd_ms": _median_ms(lambda: self.layer(moe_params, self.x)),
            "moe_fwd_bwd_ms": _median_ms(lambda: self.layer_grads(moe_params, self.x)),
        }
        if self.impl == "uccl":
            received, handle = self.dispatch(self.x, self.idx, self.w)
            y = self.experts(moe_params, received)
            out["router_ms"] = _median_ms(lambda: self.router(moe_params, self.x))
            out["dispatch_ms"] = _median_ms(lambda: self.dispatch(self.x, self.idx, self.w))
            out["experts_ms"] = _median_ms(lambda: self.experts(moe_params, received))
            out["combine_ms"] = _median_ms(lambda: self.combine(y, handle))
        return out


# ----------------------------------------------------------------------------------------------- training


def _global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global jax.Array from a host array that every process holds in full (works multi-process)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument(
        "--ep-impl",
        choices=EP_IMPLS,
        default="uccl",
        help="uccl: jax_uccl_ep dispatch/combine (the package's layer); all_to_all: jax.lax.all_to_all, fixed "
        "capacity; ragged: jax.lax.ragged_all_to_all, dropless (GPU/TPU); dense: the package's reference "
        "without dispatch",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-per-device", type=int, default=8, help="sequences per device per step")
    p.add_argument("--seq-len", type=int, default=Config().seq_len)
    p.add_argument("--d-model", type=int, default=Config().d_model)
    p.add_argument("--d-ff", type=int, default=Config().d_ff)
    p.add_argument("--heads", type=int, default=Config().num_heads)
    p.add_argument("--experts", type=int, default=Config().num_experts)
    p.add_argument("--top-k", type=int, default=Config().top_k)
    p.add_argument("--layers", type=int, default=Config().num_layers)
    p.add_argument(
        "--aux-loss-coef",
        type=float,
        default=Config().aux_loss_coef,
        help="weight of each MoE layer's load-balancing loss (MoEConfig.aux_loss_coef; 0: none)",
    )
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="MoEConfig.capacity_factor: uccl receives at most factor x tokens * top-k (token, expert) pairs per "
        "device, a device's tokens being its share of the batch (the rest are dropped); all_to_all sends at most "
        "factor x tokens * top-k / experts slots to each expert and drops the rest: the same pairs per device "
        "(default: never drop); ignored by ragged and dense",
    )
    p.add_argument(
        "--pair-buffer-factor",
        type=float,
        default=None,
        help="MoEConfig.pair_buffer_factor (uccl, never dropping): each device's experts run on a pair buffer of "
        "factor x its mean pairs whenever its pairs fit, else on the worst-case one (default: always the worst case)",
    )
    p.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="all_to_all only: slots each device sends to each expert (default: from --capacity-factor, or "
        "tokens: never drops); uccl takes --capacity-factor; ignored by ragged and dense",
    )
    p.add_argument(
        "--compute-dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="the experts' matmuls (parameters stay float32; outputs summed in float32): auto = bfloat16 on GPUs, "
        "float32 elsewhere",
    )
    p.add_argument(
        "--scan-layers",
        action="store_true",
        help="stack the layers' parameters and run them with one jax.lax.scan, as MaxText does by default: the "
        "layer compiles once instead of once per layer",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-warmup-steps", type=int, default=0, help="linear learning-rate warmup from 0 (0: none)")
    p.add_argument("--clip-norm", type=float, default=0.0, help="clip gradients to this global norm (0: no clipping)")
    p.add_argument("--time-every", type=int, default=10, help="time the MoE layer every N steps (0: never)")
    p.add_argument(
        "--profile-parts",
        action="store_true",
        help="after the last step, profile one more and report the device time of the layer's parts in it (router, "
        "dispatch, the XLA pair layout, experts, combine; forward and backward; ms per device)",
    )
    p.add_argument(
        "--generate",
        type=int,
        default=0,
        help="after training, decode this many tokens greedily for --batch-per-device prompts a device, one token a "
        "step with the MoE layers in low-latency mode (layers.moe_ffn_decode), and check them against the training "
        "forward (at most --seq-len - 1; 0: no decoding)",
    )
    p.add_argument("--decode-fp8", action="store_true", help="--generate's dispatch sends FP8 rows (default: bf16/f32)")
    p.add_argument("--json", action="store_true", help=f"print a final '{JSON_MARK}{{...}}' line on process 0")
    return p.parse_args(argv)


def train(argv: Sequence[str] | None = None, *, verbose: bool = True) -> dict:
    """Runs the training; returns {"losses": [...], ...} on every process (the losses are global)."""
    import optax

    args = parse_args(argv)
    cfg = Config(
        seq_len=args.seq_len,
        d_model=args.d_model,
        num_heads=args.heads,
        d_ff=args.d_ff,
        num_experts=args.experts,
        top_k=args.top_k,
        num_layers=args.layers,
        aux_loss_coef=args.aux_loss_coef,
        capacity_factor=args.capacity_factor,
        pair_buffer_factor=args.pair_buffer_factor,
        compute_dtype=None if args.compute_dtype == "auto" else args.compute_dtype,
        scan_layers=args.scan_layers,
    )
    # Every buffer sized for what this run's EP ops move, whatever the routing: the uccl layer's dispatch and
    # combine (the other implementations run none) and the decoding's low-latency ops. initialize() joins
    # jax.distributed when a launcher set JAX_COORDINATOR_ADDRESS, then calls this with the platform.
    ep.initialize(
        shapes=lambda platform: layers.moe_job_shapes(
            cfg.moe(),
            tokens_per_rank=args.batch_per_device * cfg.seq_len if args.ep_impl == "uccl" else 0,
            d_model=cfg.d_model,
            platform=platform,
            decode_tokens_per_rank=args.batch_per_device if args.generate else 0,
            decode_fp8=args.decode_fp8,
        )
    )
    if args.capacity is not None and args.ep_impl == "uccl":
        raise SystemExit("--capacity counts all_to_all's slots; bound uccl's received rows with --capacity-factor")
    capacity = args.capacity if args.ep_impl == "all_to_all" else None
    if not 0 <= args.generate < cfg.seq_len:
        raise SystemExit(f"--generate {args.generate}: at most --seq-len - 1 = {cfg.seq_len - 1} (positions)")
    if args.decode_fp8 and cfg.d_model % 128:
        raise SystemExit(
            f"--decode-fp8 casts rows in blocks of 128 channels: --d-model {cfg.d_model} is not a multiple"
        )
    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh = Mesh(np.array(devices), (AXIS,))
    r = mesh.size
    if cfg.num_experts % r:
        raise SystemExit(f"--experts {cfg.num_experts} must be divisible by the number of devices ({r})")
    log = verbose and jax.process_index() == 0

    def say(*a: Any) -> None:
        if log:
            print(*a, flush=True)

    say(
        f"train_moe: {r} device(s) [{devices[0].platform}] in {jax.process_count()} process(es), "
        f"ep-impl={args.ep_impl}, {cfg.num_experts} SwiGLU experts ({cfg.num_experts // r}/device), "
        f"top-{cfg.top_k}, aux loss x{cfg.aux_loss_coef:g}, "
        f"experts in {cfg.moe().experts_dtype(jnp.float32).name}, "
        + (f"capacity factor {cfg.capacity_factor:g}, " if cfg.capacity_factor is not None else "")
        + (f"capacity {capacity} slots, " if capacity is not None else "")
        + f"d_model={cfg.d_model}, d_ff={cfg.d_ff}, heads={cfg.num_heads}, layers={cfg.num_layers}, "
        f"batch {args.batch_per_device}x{cfg.seq_len} tokens/device" + (", layers scanned" if cfg.scan_layers else "")
    )

    specs = param_specs(cfg)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    params = jax.jit(lambda: init_params(jax.random.key(args.seed), cfg), out_shardings=shardings)()
    # Linear warmup and clipping keep AdamW's first steps (sign-sized updates of every parameter) from spiking
    # the loss of a large model; both are off by default.
    learning_rate = optax.linear_schedule(0.0, args.lr, args.lr_warmup_steps) if args.lr_warmup_steps else args.lr
    optimizer = optax.adamw(learning_rate, weight_decay=0.01)
    if args.clip_norm:
        optimizer = optax.chain(optax.clip_by_global_norm(args.clip_norm), optimizer)
    # The optimizer's moments are sharded like the parameters (its step count is replicated). Say so explicitly:
    # zeros that depend on no input would otherwise land on one device.
    replicated = NamedSharding(mesh, P())
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        jax.eval_shape(optimizer.init, params),
        shardings,
        transform_non_params=lambda _: replicated,
    )
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)

    moe_fn = moe_fn_for(args.ep_impl, cfg, capacity)
    loss_fn = jax.shard_map(
        partial(local_loss, cfg=cfg, moe_fn=moe_fn), mesh=mesh, in_specs=(specs, P(AXIS)), out_specs=P()
    )

    @partial(jax.jit, donate_argnums=(0, 1), out_shardings=(shardings, opt_shardings, replicated))
    def train_step(params, opt_state, batch):
        (_, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, parts

    data = MarkovData(cfg.vocab, args.seed)
    batch_sharding = NamedSharding(mesh, P(AXIS))
    tokens_per_device = args.batch_per_device * cfg.seq_len
    tokens_per_step = r * tokens_per_device
    timer = LayerTimer(mesh, cfg, args.ep_impl, tokens_per_device, capacity, args.seed) if args.time_every > 0 else None

    losses: list[float] = []
    aux_losses: list[float] = []
    pairs_dropped: list[int] = []
    step_s: list[float] = []
    timings: list[dict[str, float]] = []
    for step in range(1, args.steps + 1):
        batch = _global_array(data.batch(step, r * args.batch_per_device, cfg.seq_len + 1), batch_sharding)
        start = time.perf_counter()
        params, opt_state, parts = train_step(params, opt_state, batch)
        loss = float(parts["ce"])  # waits for the step
        elapsed = time.perf_counter() - start
        aux = float(parts["aux"])
        pairs_dropped.append(int(parts["dropped"]))
        losses.append(loss)
        aux_losses.append(aux)
        step_s.append(elapsed)
        line = (
            f"step {step:4d}/{args.steps}  loss {loss:.4f}  aux {aux:.4f}  {tokens_per_step / elapsed:9.0f} tok/s  "
            f"{elapsed * 1e3:8.1f} ms/step" + ("  (includes compilation)" if step == 1 else "")
        )
        if timer is not None and (step % args.time_every == 0 or step == args.steps):
            t = timer.measure(layer_params(params, cfg, 0)["moe"])
            timings.append(t)
            line += f"  | moe fwd {t['moe_fwd_ms']:.2f} ms, fwd+bwd {t['moe_fwd_bwd_ms']:.2f} ms"
            if "dispatch_ms" in t:
                line += ", " + ", ".join(f"{k[:-3]} {t[k]:.2f}" for k in PART_KEYS[2:]) + " ms"
        say(line)

    profile = None
    if args.profile_parts:
        batch = _global_array(data.batch(args.steps + 1, r * args.batch_per_device, cfg.seq_len + 1), batch_sharding)
        profile = step_profile.profile_parts(train_step, (params, opt_state, batch), layers.SCOPES, top=PROFILE_TOP)
        params, opt_state, _ = profile.pop("_results")
        top_kernels = profile.pop("_top", {})
        say(
            "profile of one step (ms per device, forward and backward): "
            + (", ".join(f"{k} {v:.2f}" for k, v in profile.items()) or "the profile named none of its ops")
        )
        for part, heaviest in top_kernels.items():
            if heaviest:
                say(f"  {part}: " + "; ".join(f"{name[:60]} ({what}) {t:.2f} ms x{n}" for name, t, n, what in heaviest))
    generation = check_generation(params, mesh, cfg, moe_fn, data, args) if args.generate else None
    if generation is not None:
        say(
            f"generate: {generation['sequences']} sequences x {generation['tokens']} tokens, "
            f"{generation['decode_ms_per_token']:.2f} ms a token ({generation['decode_tokens_per_s']:.0f} tok/s, "
            f"low-latency {'FP8' if args.decode_fp8 else 'unquantized'} dispatch); against the training forward: "
            f"logits within {generation['max_logit_diff']:.1e} of the largest, argmax agrees at "
            f"{generation['argmax_agree']:.1%}; {generation['legal_transitions']:.1%} of the transitions are the "
            f"chain's; sequence 0: {' '.join(map(str, generation['sample']))}"
        )
    ep.check_errors()  # GPU kernels report bad routing or exceeded capacity here (CPU ops raise themselves)
    steady = step_s[1:] or step_s
    summary: dict[str, Any] = {
        "ep_impl": args.ep_impl,
        "aux_loss_coef": cfg.aux_loss_coef,
        "capacity_factor": cfg.capacity_factor,
        "pair_buffer_factor": cfg.pair_buffer_factor,
        "capacity": capacity,
        "compute_dtype": cfg.moe().experts_dtype(jnp.float32).name,
        "scan_layers": cfg.scan_layers,
        "devices": r,
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "processes": jax.process_count(),
        "steps": args.steps,
        "losses": losses,  # cross-entropy
        "aux_losses": aux_losses,  # load-balancing loss, summed over the layers
        "pairs_dropped": pairs_dropped,  # (token, expert) pairs dropped in each step, over all devices and layers
        "pairs_per_step": tokens_per_step * cfg.top_k * cfg.num_layers,
        "loss_floor": data.entropy_rate(),
        "tokens_per_step": tokens_per_step,
        "step_ms": [t * 1e3 for t in step_s],  # wall time of each step, the first one with compilation
        "tokens_per_s": tokens_per_step / float(np.median(steady)) if steady else 0.0,
    }
    if generation is not None:
        summary["generate"] = generation
    if profile is not None:
        summary["profile_ms"] = profile
        summary["profile_top_kernels"] = top_kernels  # {part: [[kernel, ms per device, launches, what], ...]}
    for key in PART_KEYS:
        values = [t[key] for t in timings if key in t]
        if values:
            summary[key] = float(np.median(values))
    if losses:
        k = min(5, len(losses))
        timed = [f"{key[:-3].replace('_', ' ')} {summary[key]:.2f} ms" for key in PART_KEYS if key in summary]
        say(
            f"summary: loss {np.mean(losses[:k]):.4f} (first {k} steps) -> {np.mean(losses[-k:]):.4f} "
            f"(last {k}); floor (chain entropy) {summary['loss_floor']:.4f}; aux {np.mean(aux_losses[-k:]):.4f} "
            f"(last {k}); "
            f"{summary['tokens_per_s']:.0f} tok/s (median step after the first)"
            + (f"; {', '.join(timed)} (standalone calls on the step's shapes, median)" if timed else "")
        )
    if args.json and jax.process_index() == 0:
        print(JSON_MARK + json.dumps(summary), flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    train(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
