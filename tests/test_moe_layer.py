"""The package's MoE layer against its dense reference: forward, gradients, aux loss and counts, under jit,
remat and scan; the decoding variant; the Flax NNX module when flax is installed. 4 CPU devices, one process."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_uccl_ep as ep
from jax_uccl_ep import layers

R, B, S, D, F, E, K = 4, 8, 6, 128, 96, 16, 3


@pytest.fixture(scope="module", autouse=True)
def runtime():
    ep.initialize()
    yield


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:R]), ("ep",))


def _inputs(seed: int, dtype=jnp.float32):
    kp, kx = jax.random.split(jax.random.key(seed))
    params = layers.init_moe_params(kp, d_model=D, d_ff=F, num_experts=E, dtype=dtype)
    x = jax.random.normal(kx, (B, S, D), dtype)
    mesh = _mesh()
    specs = layers.moe_param_specs("ep")
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    return params, jax.device_put(x, NamedSharding(mesh, P("ep"))), mesh


def _per_rank_reference(params, x, config, ranks=R):
    """The reference on each rank's tokens, x's first dimension split over `ranks` (the layer's aux loss and
    counts are per rank, then reduced): (y, mean aux loss, pairs per expert)."""
    per = x.shape[0] // ranks
    outs = [layers.moe_ffn_reference(params, x[r * per : (r + 1) * per], config) for r in range(ranks)]
    y = jnp.concatenate([o.y for o in outs])
    aux = jnp.mean(jnp.stack([o.aux_loss for o in outs]))
    per_expert = sum(o.stats.tokens_per_expert for o in outs)
    return y, aux, per_expert


@pytest.mark.parametrize(
    "config",
    [
        layers.MoEConfig(num_experts=E, top_k=K, aux_loss_coef=0.01),
        layers.MoEConfig(num_experts=E, top_k=2, score="sigmoid", renormalize=False),
    ],
    ids=["softmax-aux", "sigmoid"],
)
def test_forward_matches_the_dense_reference(config):
    params, x, mesh = _inputs(1)
    out = jax.jit(lambda p, x: layers.moe_ffn(p, x, mesh=mesh, config=config))(params, x)
    y, aux, per_expert = _per_rank_reference(params, x, config)
    assert out.y.shape == x.shape
    np.testing.assert_allclose(np.asarray(out.y), np.asarray(y), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(float(out.aux_loss), float(aux), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.stats.tokens_per_expert), np.asarray(per_expert))
    # Against NumPy from the spec (tests/reference.py), which shares nothing with the layer: each rank's output,
    # Switch loss (two-sided) and counts.
    host = {k: np.asarray(v) for k, v in params.items()}
    shards = np.split(np.asarray(x).reshape(-1, D), R)
    refs = [
        reference.moe_layer(host, xr, config.top_k, score=config.score, renormalize=config.renormalize) for xr in shards
    ]
    np.testing.assert_allclose(
        np.asarray(out.y).reshape(-1, D), np.concatenate([r[0] for r in refs]), rtol=1e-4, atol=1e-5
    )
    want_aux = config.aux_loss_coef * np.mean([r[1] for r in refs])
    np.testing.assert_allclose(float(out.aux_loss), want_aux, rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(np.asarray(out.stats.tokens_per_expert), sum(r[2] for r in refs))
    # Rank r received one row per token that has an expert in [r*E/R, (r+1)*E/R).
    owners = np.concatenate([r[3] for r in refs]) // (E // R)
    want_rows = [int((owners == r).any(-1).sum()) for r in range(R)]
    np.testing.assert_array_equal(np.asarray(out.stats.rows_received), want_rows)
    assert (float(out.aux_loss) > 0) == (config.aux_loss_coef > 0)


@pytest.mark.parametrize("pair_buffer_factor", [None, 1.0], ids=["worst-case buffer", "load-sized buffer"])
def test_gradients_match_the_dense_reference_under_remat_and_scan(pair_buffer_factor):
    config = layers.MoEConfig(num_experts=E, top_k=K, aux_loss_coef=0.01, pair_buffer_factor=pair_buffer_factor)
    params, x, mesh = _inputs(2)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a * 0.5]), params)  # two layers, scanned

    def model(ffn):
        def loss(stacked, x):
            @jax.checkpoint
            def layer(h, p):
                y, aux = ffn(p, h)
                return h + y, aux

            h, aux = jax.lax.scan(layer, x, stacked)
            return jnp.mean(h**2) + jnp.sum(aux)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    def ep_ffn(p, h):
        out = layers.moe_ffn(p, h, mesh=mesh, config=config)
        return out.y, out.aux_loss

    def dense_ffn(p, h):
        y, aux, _ = _per_rank_reference(p, h, config)
        return y, aux

    (v1, (gp1, gx1)), (v2, (gp2, gx2)) = model(ep_ffn)(stacked, x), model(dense_ffn)(stacked, x)
    np.testing.assert_allclose(float(v1), float(v2), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx1), np.asarray(gx2), rtol=1e-4, atol=1e-6)
    for name in gp1:
        np.testing.assert_allclose(np.asarray(gp1[name]), np.asarray(gp2[name]), rtol=1e-4, atol=1e-6, err_msg=name)
    assert all(float(jnp.abs(g).sum()) > 0 for g in gp1.values())  # every parameter gets a gradient


@pytest.mark.parametrize("factor", [1.0, 0.3])
def test_a_load_sized_pair_buffer_drops_nothing(factor, monkeypatch):
    """MoEConfig.pair_buffer_factor: a rank's experts run on a pair buffer of factor x its mean pairs where its
    pairs fit and on the every-slot one where they do not, forward and backward: the dense reference's output and
    gradients either way, nothing dropped, and each rank on the path its own pair count calls for (1.0: the ranks
    above the mean take the large path, the others the small; 0.3: every rank the large)."""
    config = layers.MoEConfig(num_experts=E, top_k=K, aux_loss_coef=0.01, pair_buffer_factor=factor)
    params, x, mesh = _inputs(6)
    taken: list[tuple[int, int]] = []
    through_pairs = layers._through_pairs

    def recording(params, rows, weights, expert, num_rows, capacity, dtype, backend):
        jax.debug.callback(lambda r: taken.append((int(r), capacity)), jax.lax.axis_index("ep"))
        return through_pairs(params, rows, weights, expert, num_rows, capacity, dtype, backend)

    monkeypatch.setattr(layers, "_through_pairs", recording)

    def loss(ffn):
        def f(p, x):
            y, aux, dropped = ffn(p, x)
            return jnp.sum(jnp.sin(y)) + aux, dropped

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

    def ep_ffn(p, x):
        out = layers.moe_ffn(p, x, mesh=mesh, config=config)
        return out.y, out.aux_loss, out.stats.pairs_dropped

    def dense_ffn(p, x):
        y, aux, _ = _per_rank_reference(p, x, config)
        return y, aux, jnp.zeros(R, jnp.int32)

    (v1, dropped), (gp1, gx1) = loss(ep_ffn)(params, x)
    jax.effects_barrier()
    (v2, _), (gp2, gx2) = loss(dense_ffn)(params, x)
    np.testing.assert_allclose(float(v1), float(v2), rtol=1e-5)
    for name, got, want in [("x", gx1, gx2)] + [(n, gp1[n], gp2[n]) for n in gp1]:
        scale = float(np.abs(np.asarray(want)).max())  # float32 sums in another order: relative to the largest
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6 * scale, err_msg=name)
    assert np.asarray(dropped).tolist() == [0] * R
    # The pairs each rank receives, from the routing alone; the buffer each rank's pairs called for.
    tokens = B * S // R
    _, idx, _ = reference.moe_route(
        np.asarray(params["router"]), np.asarray(x).reshape(-1, D), K, score=config.score, renormalize=True
    )
    received = np.bincount((idx // (E // R)).ravel(), minlength=R)
    small = layers.capacity_for(tokens, K, R, factor, E)
    every_slot = R * tokens * K
    want = {r: small if received[r] <= small else every_slot for r in range(R)}
    assert {r: {c for q, c in taken if q == r} for r in range(R)} == {r: {want[r]} for r in range(R)}, (received, small)
    if factor == 1.0:
        assert set(want.values()) == {small, every_slot}, received  # both paths ran
    # The large path runs its forward again in the backward pass; the small one keeps its residuals.
    assert all(sum(q == r for q, _ in taken) == (1 if want[r] == small else 2) for r in range(R)), taken


def test_the_config_refuses_buffer_factors_that_cannot_work():
    with pytest.raises(ValueError, match="pair_buffer_factor must be positive"):
        layers.MoEConfig(num_experts=E, top_k=K, pair_buffer_factor=0.0)
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        layers.MoEConfig(num_experts=E, top_k=K, capacity_factor=-1.0)
    with pytest.raises(ValueError, match="set one"):
        layers.MoEConfig(num_experts=E, top_k=K, capacity_factor=1.25, pair_buffer_factor=1.5)
    with pytest.raises(ValueError, match="pair_buffer_factor must be positive and finite"):
        layers.MoEConfig(num_experts=E, top_k=K, pair_buffer_factor=float("inf"))


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(num_experts=E, top_k=0), r"top_k must be an int in \[1, num_experts=16\], got 0"),
        (dict(num_experts=E, top_k=E + 1), r"top_k must be an int in \[1, num_experts=16\], got 17"),
        (dict(num_experts=0, top_k=1), "num_experts must be a positive int, got 0"),
        (dict(num_experts=8.0, top_k=1), "num_experts must be a positive int, got 8.0"),
    ],
)
def test_the_config_refuses_expert_counts_that_cannot_work(kw, words):
    with pytest.raises(ValueError, match=words):
        layers.MoEConfig(**kw)


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda p, x: ({**p, "router": p["router"][:, :-1]}, x), r"params\['router'\] has shape \(128, 15\)"),
        (lambda p, x: ({**p, "w_down": jnp.swapaxes(p["w_down"], 1, 2)}, x), r"params\['w_down'\] has shape"),
        (lambda p, x: ({**p, "w_up": p["w_up"][..., :-1]}, x), r"params\['w_up'\] has shape"),
        (lambda p, x: (p, x[..., :-1]), "x's last dimension is 127, the params' d_model 128"),
        (lambda p, x: (p, x.astype(jnp.int32)), "x must be floating point"),
        (lambda p, x: ({**p, "w_gate": p["w_gate"].astype(jnp.int32)}, x), r"params\['w_gate'\] must be floating"),
    ],
    ids=["router short of an expert", "w_down transposed", "w_up narrower", "x narrower", "int x", "int w_gate"],
)
def test_parameters_and_tokens_the_layer_cannot_take_are_named(change, words):
    """Each rank's parameters and tokens are checked against init_moe_params' shapes before anything runs: a
    router short of an expert would otherwise run, never choosing it; an int x would be truncated."""
    params, x, mesh = _inputs(8)
    params, x = change(params, x)
    config = layers.MoEConfig(num_experts=E, top_k=K)
    with pytest.raises(ValueError, match=words):
        layers.moe_ffn(params, x, mesh=mesh, config=config)


def test_one_token_a_rank_as_a_vector_runs():
    """x [..., D] with no leading dimension (one token on each rank, x [D]): the layer and the decode layer take it."""
    config = layers.MoEConfig(num_experts=8, top_k=2)
    params = layers.init_moe_params(jax.random.key(12), d_model=D, d_ff=F, num_experts=8)
    x = jax.random.normal(jax.random.key(13), (R, D))
    mesh, specs = _mesh(), layers.moe_param_specs("ep")
    want = np.asarray(layers.moe_ffn_reference(params, x, config).y)
    for fn in (
        lambda p, t: layers.moe_ffn_local(p, t[0], config, axis_name="ep").y[None],
        lambda p, t: layers.moe_ffn_decode(p, t[0], config, axis_name="ep", max_tokens_per_rank=1, use_fp8=False)[None],
    ):
        got = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep")))(params, x)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_the_layer_on_one_rank_outside_shard_map_says_where_it_runs():
    params, x, _ = _inputs(9)
    with pytest.raises(ValueError, match="the EP ops run inside jax.shard_map"):
        layers.moe_ffn_local(params, x, layers.MoEConfig(num_experts=E, top_k=K), axis_name="ep")


@pytest.mark.parametrize("spec", [P(("dp", "ep")), P("dp", "ep")], ids=["batch over dp and ep", "sequence over ep"])
def test_tokens_split_over_a_data_parallel_axis_too(spec):
    """token_spec splitting the tokens over a data-parallel axis besides the EP axis: each shard routes its own
    tokens; the aux loss is the mean over the shards, the counts their sums (rows over the dp groups)."""
    config = layers.MoEConfig(num_experts=8, top_k=2, aux_loss_coef=0.01)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "ep"))
    params = layers.init_moe_params(jax.random.key(5), d_model=D, d_ff=F, num_experts=8)
    x = jax.random.normal(jax.random.key(6), (B, S, D))
    out = jax.jit(lambda p, x: layers.moe_ffn(p, x, mesh=mesh, config=config, token_spec=spec))(
        params, jax.device_put(x, NamedSharding(mesh, spec))
    )
    y, auxes, per_expert, rows = np.zeros(x.shape, np.float32), [], 0, 0
    for index in {
        tuple((i.start, i.stop) for i in v[:2]) for v in NamedSharding(mesh, spec).devices_indices_map(x.shape).values()
    }:
        part = x[index[0][0] : index[0][1], index[1][0] : index[1][1]]
        ref = layers.moe_ffn_reference(params, part, config)
        y[index[0][0] : index[0][1], index[1][0] : index[1][1]] = np.asarray(ref.y)
        auxes.append(float(ref.aux_loss))
        per_expert = per_expert + np.asarray(ref.stats.tokens_per_expert)
        _, idx, _ = layers.route(params["router"], part.reshape(-1, D), config)
        rows += sum(len(set(np.asarray(t) // 4)) for t in idx)  # a row per (token, EP rank it goes to)
    np.testing.assert_allclose(np.asarray(out.y), y, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(float(out.aux_loss), np.mean(auxes), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.stats.tokens_per_expert), per_expert)
    assert int(np.asarray(out.stats.rows_received).sum()) == rows


@pytest.mark.parametrize(
    "spec,words",
    [
        (P(), "does not split x's tokens over the EP axis"),
        (P(None, "ep", None), None),
        (P("ep", None, "dp"), "splits D"),
    ],
)
def test_a_token_spec_the_layer_cannot_run_is_named(spec, words):
    params, x, mesh = _inputs(7)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "ep"))
    config = layers.MoEConfig(num_experts=E, top_k=K)
    if words is None:  # the sequence over ep: runs
        layers.moe_ffn(params, x, mesh=mesh, config=config, token_spec=spec)
        return
    with pytest.raises(ValueError, match=words):
        layers.moe_ffn(params, x, mesh=mesh, config=config, token_spec=spec)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_layers_track_the_reference(dtype):
    """bf16 and f16 parameters and tokens (the experts compute in the parameters' dtype on CPU devices): the
    layer's output near the float32-computed reference, and the decoding layer's (low-latency ops take no float16:
    its rows travel as float32 there)."""
    config = layers.MoEConfig(num_experts=E, top_k=K)
    params, x, mesh = _inputs(3, dtype)
    out = jax.jit(lambda p, x: layers.moe_ffn(p, x, mesh=mesh, config=config))(params, x)
    y, _, _ = _per_rank_reference(params, x, config)
    assert out.y.dtype == dtype
    np.testing.assert_allclose(np.asarray(out.y, np.float32), np.asarray(y, np.float32), rtol=5e-2, atol=5e-2)

    def decode(p, t):
        return layers.moe_ffn_decode(p, t[0], config, axis_name="ep", max_tokens_per_rank=t.shape[1], use_fp8=False)

    specs = (layers.moe_param_specs("ep"), P("ep"))
    f = jax.jit(jax.shard_map(lambda p, t: decode(p, t)[None], mesh=mesh, in_specs=specs, out_specs=P("ep")))
    got = f(params, x.reshape(R, B // R * S, D))
    assert got.dtype == dtype
    want = layers.moe_ffn_reference(params, x, config).y
    np.testing.assert_allclose(
        np.asarray(got, np.float32).reshape(B, S, D), np.asarray(want, np.float32), rtol=5e-2, atol=5e-2
    )


@pytest.mark.parametrize("use_fp8", [False, True])
def test_decode_layer_matches_the_reference(use_fp8):
    config = layers.MoEConfig(num_experts=E, top_k=K)
    params, x, mesh = _inputs(4)
    tokens = x.reshape(R, B // R * S, D)

    def body(p, t):
        return layers.moe_ffn_decode(p, t[0], config, axis_name="ep", max_tokens_per_rank=t.shape[1], use_fp8=use_fp8)[
            None
        ]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(layers.moe_param_specs("ep"), P("ep")), out_specs=P("ep")))
    got = np.asarray(f(params, tokens)).reshape(B, S, D)
    want = np.asarray(layers.moe_ffn_reference(params, x, config).y)
    tol = dict(rtol=0.1, atol=0.1) if use_fp8 else dict(rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got, want, **tol)


def _slot_buffers(seed: int, groups: int = 5, slots: int = 12, width: int = 7):
    """Random per-expert slot buffers, padding filled with garbage, and counts including 0 and a full group."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((groups, slots, width)).astype(np.float32)
    counts = rng.integers(0, slots + 1, groups).astype(np.int32)
    counts[0], counts[-1] = 0, slots
    return rows, counts


def test_slot_buffers_pack_into_consecutive_groups_and_back():
    rows, counts = _slot_buffers(7)
    groups, slots, width = rows.shape
    packed = np.asarray(jax.jit(layers._pairs.pack_slots)(rows, counts))
    want = np.zeros((groups * slots, width), np.float32)
    want[: counts.sum()] = np.concatenate([rows[g, : counts[g]] for g in range(groups)])
    np.testing.assert_array_equal(packed, want)
    # Back: each group's rows in its first counts[g] slots, zeros in the padding.
    other = np.random.default_rng(8).standard_normal(packed.shape).astype(np.float32)
    back = np.asarray(jax.jit(layers._pairs.unpack_slots, static_argnums=2)(other, counts, slots))
    start = np.concatenate([[0], np.cumsum(counts)])
    for g in range(groups):
        np.testing.assert_array_equal(back[g, : counts[g]], other[start[g] : start[g + 1]])
        assert not back[g, counts[g] :].any()


def test_expert_slots_through_the_grouped_matmul_match_the_batched_matmuls():
    """The packed path (the one Mosaic kernels take on GPUs) run with XLA's ragged_dot on CPU against the batched
    matmuls over the slots and a NumPy SwiGLU: the same rows, zeros in the padding whatever it held."""
    groups, slots, d_model, d_ff = 4, 10, 16, 24
    params = layers.init_moe_params(jax.random.key(5), d_model=d_model, d_ff=d_ff, num_experts=groups)
    rows, counts = _slot_buffers(9, groups, slots, d_model)
    counts[1] = -3  # no rows, on either path
    batched = layers.swiglu_expert_slots(params, jnp.asarray(rows), jnp.asarray(counts), backend="xla")
    groups_of = np.clip(counts, 0, slots)  # what swiglu_expert_slots gives the grouped matmul on GPUs
    packed = layers._pairs.unpack_slots(
        layers.swiglu_pairs(params, layers._pairs.pack_slots(jnp.asarray(rows), counts), groups_of, backend="xla"),
        counts,
        slots,
    )
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    want = np.zeros(rows.shape)
    for g in range(groups):
        x = rows[g, : max(counts[g], 0)].astype(np.float64)
        gate, up = x @ p["w_gate"][g], x @ p["w_up"][g]
        want[g, : max(counts[g], 0)] = (gate / (1 + np.exp(-gate)) * up) @ p["w_down"][g]
    for got in (batched, packed):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-5)
        for g in range(groups):
            assert not np.asarray(got)[g, max(counts[g], 0) :].any()


def test_capacity_for_follows_the_factor():
    # Counted from a routing: 12 tokens on each of 4 ranks, top-3 of 16 experts (4 a rank), the pairs each rank
    # receives average to capacity_for at factor 1.
    rng = np.random.default_rng(0)
    idx = np.argsort(rng.random((4 * 12, 16)), axis=1)[:, :3]
    received = np.bincount((idx // 4).ravel(), minlength=4)
    assert layers.capacity_for(12, 3, 4, 1.0, 16) == received.mean() == 36
    # 1024 tokens on each of 8 ranks, top-8: 8192 pairs reach a rank on average, whatever the rank count.
    assert layers.capacity_for(1024, 8, 8, 1.0, 64) == 8192
    assert layers.capacity_for(1024, 8, 8, 1.25, 64) == 10240
    assert layers.capacity_for(1024, 8, 2, 1.25, 64) == 10240
    assert layers.capacity_for(10, 2, 4, 100.0, 16) == 80  # never more than R * T * min(K, E / R)
    assert layers.capacity_for(10, 4, 4, 100.0, 8) == 80  # min(K, E / R) = 2 pairs a token at most
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        layers.capacity_for(10, 2, 4, 0, 16)


def test_flax_nnx_module_trains_like_the_functional_layer():
    nnx = pytest.importorskip("flax.nnx")
    from jax_uccl_ep.nnx import MoE

    config = layers.MoEConfig(num_experts=E, top_k=K, aux_loss_coef=0.01)
    mesh = _mesh()
    model = MoE(D, F, config, mesh=mesh, rngs=nnx.Rngs(0))
    assert model.w_gate[...].sharding.spec == P("ep", None, None)  # experts placed over the EP axis
    x = jax.device_put(jax.random.normal(jax.random.key(5), (B, S, D)), NamedSharding(mesh, P("ep")))

    @nnx.jit
    def loss_and_grad(model, x):
        def loss(model):
            y, aux, _ = model(x)
            return jnp.mean(y**2) + aux

        return nnx.value_and_grad(loss)(model)

    value, grads = loss_and_grad(model, x)
    params = model.params()

    def ref_loss(p):
        y, aux, _ = _per_rank_reference(p, x, config)
        return jnp.mean(y**2) + aux

    want_value, want_grads = jax.value_and_grad(ref_loss)(params)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for name in params:
        got = grads[name][...]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want_grads[name]), rtol=1e-4, atol=1e-6, err_msg=name)


def train_steps(steps: int, platform: str = "cpu") -> dict:
    """Child (several processes): SGD steps of a one-layer model through the EP layer and through the dense
    reference from the same start; returns both loss curves."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_uccl_ep as ep
    from jax_uccl_ep import layers

    ep.initialize()
    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh = Mesh(np.array(devices), ("ep",))
    r = len(devices)
    config = layers.MoEConfig(num_experts=4 * r, top_k=2, aux_loss_coef=0.01)
    host = layers.init_moe_params(jax.random.key(0), d_model=128, d_ff=64, num_experts=4 * r)
    specs = layers.moe_param_specs("ep")

    def global_array(a, spec):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    params = {k: global_array(v, specs[k]) for k, v in host.items()}
    x = global_array(jax.random.normal(jax.random.key(1), (2 * r, 4, 128)), P("ep"))
    target = global_array(jax.random.normal(jax.random.key(2), (2 * r, 4, 128)), P("ep"))

    def dense(p, x):
        y, aux, _ = _per_rank_reference(p, x, config, r)
        return y, aux

    def expert_parallel(p, x):
        out = layers.moe_ffn(p, x, mesh=mesh, config=config)
        return out.y, out.aux_loss

    curves = {}
    for name, ffn in (("ep", expert_parallel), ("dense", dense)):

        @jax.jit
        def step(p, x, target, ffn=ffn):
            def loss(p):
                y, aux = ffn(p, x)
                return jnp.mean((y - target) ** 2) + aux

            value, grads = jax.value_and_grad(loss)(p)
            return value, jax.tree.map(lambda a, g: a - 0.5 * g, p, grads)

        p, losses = params, []
        for _ in range(steps):
            value, p = step(p, x, target)
            losses.append(float(value))
        curves[name] = losses
    ep.shutdown()
    return curves


def test_training_across_two_processes_follows_the_dense_reference():
    import os

    from mp import launch_ok

    # A peer's deadline of 120 s: on CI's 2 cores a first op once waited past 60 s for its peer (docs/RELIABILITY.md).
    env = {"UCCL_EP_TIMEOUT_S": "120"}
    results = launch_ok(
        os.path.abspath(__file__), "train_steps", 2, args=[5], devices_per_process=2, timeout_s=300, env=env
    )
    for curves in results:
        np.testing.assert_allclose(curves["ep"], curves["dense"], rtol=1e-4)
        assert curves["ep"][-1] < curves["ep"][0]  # it learns
    assert results[0] == results[1]  # every process sees the same global loss


def layer_parity_child(fp8: bool, pair_buffer_factor: float | None = None) -> dict:
    """Child (processes sharing GPUs, no XLA collectives): the layer's output and gradients on each rank against
    the dense reference computed whole in every process. Each rank differentiates its own loss; the EP ops'
    backward passes exchange the cotangents, so expert weights and inputs get the gradient of the total loss."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_uccl_ep as ep
    from jax_uccl_ep import layers

    ep.initialize()
    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh = Mesh(np.array(devices), ("ep",))
    r, b, s, d = len(devices), 2 * len(devices), 8, 256
    # BF16 dispatch: the EP exchange alone, the experts in float32 at full matmul precision (on GPUs the default
    # would be bf16 experts and TF32 matmuls, each more than the 2e-3 asked). FP8 dispatch: the user's default
    # path (bf16 experts on GPUs) at the FP8 wire's tolerance.
    config = layers.MoEConfig(
        num_experts=8 * r,
        top_k=4,
        aux_loss_coef=0.01,
        fp8_dispatch=fp8,
        compute_dtype=None if fp8 else jnp.float32,
        pair_buffer_factor=pair_buffer_factor,
    )
    host = {
        k: np.asarray(v)
        for k, v in layers.init_moe_params(jax.random.key(3), d_model=d, d_ff=128, num_experts=8 * r).items()
    }
    x_host = np.asarray(jax.random.normal(jax.random.key(4), (b, s, d)))
    specs = layers.moe_param_specs("ep")

    def global_array(a, spec):
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

    def local_loss(p, x):
        out = layers.moe_ffn_local(p, x, config, axis_name="ep")
        return jnp.sum(out.y.astype(jnp.float32) ** 2) / (b * s * d) + out.aux_loss / r, out.y

    def body(p, x):
        # y from the same forward pass: a second, independent layer call could run its EP ops in another order
        # than the gradient's on some ranks (XLA:CPU starts independent custom calls in any order).
        (value, y), (gp, gx) = jax.value_and_grad(local_loss, argnums=(0, 1), has_aux=True)(p, x)
        return y, value[None], {k: gp[k] for k in ("w_gate", "w_up", "w_down")}, gx

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, P("ep")),
            out_specs=(P("ep"), P("ep"), {k: P("ep") for k in ("w_gate", "w_up", "w_down")}, P("ep")),
        )
    )
    params = {k: global_array(v, specs[k]) for k, v in host.items()}
    with jax.default_matmul_precision("highest"):
        y, _, gp, gx = f(params, global_array(x_host, P("ep")))

    # The decode layer (low-latency mode, the router weights carried by the dispatch) computes the same function.
    def decode(p, x):
        return layers.moe_ffn_decode(p, x, config, axis_name="ep", max_tokens_per_rank=x.size // d, use_fp8=fp8)

    g = jax.jit(jax.shard_map(decode, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep")))
    with jax.default_matmul_precision("highest"):
        y_decode = g(params, global_array(x_host, P("ep")))

    def dense_loss(p, x):
        y, aux, _ = _per_rank_reference(p, x, config, r)
        return jnp.sum(y.astype(jnp.float32) ** 2) / (b * s * d) + aux, y

    with jax.default_matmul_precision("highest"):
        grads = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1), has_aux=True))
        (_, y_ref), (gp_ref, gx_ref) = grads(host, x_host)
    tol = 0.1 if fp8 else 2e-3
    problems = []

    def compare(name, got, want):
        for shard in got.addressable_shards:
            a, w = np.asarray(shard.data, np.float32), np.asarray(want, np.float32)[shard.index]
            err = np.abs(a - w).max() / max(np.abs(w).max(), 1e-12)
            if not err <= tol:
                problems.append(f"{name} shard {shard.index}: relative error {err:.3g}")

    compare("y", y, y_ref)
    compare("y of the decode layer", y_decode, y_ref)
    compare("dx", gx, gx_ref)
    for k in gp:
        compare(f"d{k}", gp[k], gp_ref[k])
    ep.check_errors()
    ep.shutdown()
    return {"problems": problems}


@pytest.mark.parametrize("fp8,pair_buffer_factor", [(False, None), (True, None), (False, 1.0)])
def test_layer_gradients_across_processes_match_the_reference(fp8, pair_buffer_factor):
    import os

    from mp import launch_ok

    args = [fp8, pair_buffer_factor]
    for result in launch_ok(os.path.abspath(__file__), "layer_parity_child", 2, args=args, devices_per_process=2):
        assert result["problems"] == []


def test_the_load_sized_buffer_is_used_only_where_it_is_smaller_than_every_pair():
    """load_sized_pairs (the layer's choice of path): factor x the mean pairs a rank gets (tokens x top_k), and None
    without a factor, beside a capacity factor, or where that buffer would hold every pair anyway (one rank: each
    rank gets exactly its mean)."""
    cfg = layers.MoEConfig(num_experts=16, top_k=4, pair_buffer_factor=1.5)
    assert layers.load_sized_pairs(cfg, 64, 4) == 384  # 1.5 x 64 x 4, under the 4 x 64 x 4 never-dropping pairs
    assert layers.load_sized_pairs(cfg, 64, 1) is None  # 1.5 x the mean is capped at every pair: no small path
    assert layers.load_sized_pairs(layers.MoEConfig(num_experts=16, top_k=4), 64, 4) is None
    assert layers.load_sized_pairs(layers.MoEConfig(num_experts=16, top_k=4, capacity_factor=1.25), 64, 4) is None


def _reads_aligned_blocks(lhs, dout, sizes, block=64):
    """A stand-in for the Mosaic weight-gradient kernel's reads: each group's rows in blocks of `block` aligned to
    multiples of it, the rows outside the group masked by multiplying lhs by zero (NaN x 0 stays NaN)."""
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    rows = jnp.arange(lhs.shape[0])
    read = (rows >= starts[:, None] // block * block) & (rows < -(ends[:, None] // -block) * block)  # [G, M]
    inside = ((rows >= starts[:, None]) & (rows < ends[:, None])).astype(lhs.dtype)
    x = jnp.where(read[..., None], lhs[None], 0) * inside[..., None]
    dy = jnp.where(read[..., None], dout[None], 0)
    return jnp.einsum("gmk,gmn->gkn", x, dy)


@pytest.mark.parametrize("m", [200, 256])
@pytest.mark.parametrize("total", [0, 37, 64, 150, 190, 200])
def test_the_weight_gradient_reads_no_row_past_the_groups_into_a_sum(total, m):
    """The weight gradient from a kernel that reads whole aligned blocks (as the Mosaic one does) equals each
    group's x^T dy in float64 and is finite, with NaN in every row past the groups; the same kernel on the same
    buffers directly is NaN whenever the groups end inside a block before the buffer does (so the check can fail).
    Sizes include empty groups and a tail shared by several groups. A buffer of whole blocks (256 rows) takes the
    path that zeroes the rows after the groups to the block's end; 200 rows, the one that sums them apart. The
    caller's buffers keep their NaN rows (the zeroing is the function's own)."""
    from jax_uccl_ep import grouped

    k, n, g = 6, 5, 7
    rng = np.random.default_rng(total)
    cuts = np.sort(rng.integers(0, total + 1, g - 1))
    if total > 3:
        cuts[-2:] = [total - 3, total - 1]  # the last rows in three groups, one of one row
    sizes = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
    sizes[1] = 0 if total else sizes[1]
    sizes[-1] = total - sizes[:-1].sum()
    x = rng.standard_normal((m, k)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    x[total:], dy[total:] = np.nan, np.nan
    got = jax.jit(lambda a, b, s: grouped._weight_grad_by_blocks(_reads_aligned_blocks, a, b, s, 64))(
        jnp.asarray(x), jnp.asarray(dy), jnp.asarray(sizes)
    )
    ends = np.cumsum(sizes)
    want = np.stack([x[e - s : e].astype(np.float64).T @ dy[e - s : e] for s, e in zip(sizes, ends)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    x_dev = jnp.asarray(x)
    jax.jit(lambda a, b, s: grouped._weight_grad_by_blocks(_reads_aligned_blocks, a, b, s, 64))(
        x_dev, jnp.asarray(dy), jnp.asarray(sizes)
    )
    assert np.isnan(np.asarray(x_dev)[total:]).all()
    direct = np.asarray(_reads_aligned_blocks(jnp.asarray(x), jnp.asarray(dy), jnp.asarray(sizes)))
    assert np.isnan(direct).any() == (total % 64 != 0 and total < m)


def _swiglu_reference(gate_up, weights, dh):
    """NumPy float64: h = silu(gate) * up * weight per row, and its gradients from dh."""
    f = gate_up.shape[1] // 2
    g, u = gate_up[:, :f].astype(np.float64), gate_up[:, f:].astype(np.float64)
    w = weights.astype(np.float64)[:, None]
    sig = 1.0 / (1.0 + np.exp(-g))
    h = g * sig * u * w
    dh = dh.astype(np.float64)
    d_gate = dh * w * u * sig * (1.0 + g * (1.0 - sig))
    d_up = dh * w * g * sig
    d_w = np.sum(dh * g * sig * u, axis=1)
    return h, np.concatenate([d_gate, d_up], axis=1), d_w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_rows", [0, 7, 19, 25])
def test_the_weighted_swiglu_computes_the_groups_rows_only(dtype, num_rows):
    """The layer's step between its matmuls (FFI swiglu, swiglu_grad) against NumPy for the first num_rows rows
    (clamped to the buffer's 19), forward and both gradients; rows past them are left unwritten (NaN under the
    suite's poison mode), so the op's cost follows the groups rather than the buffer."""
    rng = np.random.default_rng(num_rows)
    m, f = 19, 12
    gate_up = rng.standard_normal((m, 2 * f)).astype(np.float32) * 2
    weights = rng.uniform(0.1, 1.0, m).astype(np.float32)
    dh = rng.standard_normal((m, f)).astype(np.float32)
    gate_up_t = jnp.asarray(gate_up).astype(dtype)
    exact = np.asarray(gate_up_t.astype(jnp.float32))  # the op's inputs as it sees them
    dh_t = jnp.asarray(dh).astype(dtype)

    @jax.jit
    def step(a, w, dh):  # the op runs inside jit, as in the layer
        h, vjp = jax.vjp(lambda a, w: layers._weighted_swiglu(a, w, jnp.int32(num_rows)), a, w)
        return (h, *vjp(dh))

    h, d_gate_up, d_weights = step(gate_up_t, jnp.asarray(weights), dh_t)
    want_h, want_dg, want_dw = _swiglu_reference(exact, weights, np.asarray(dh_t.astype(jnp.float32)))
    n = min(num_rows, m)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(h.astype(jnp.float32))[:n], want_h[:n], rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(d_gate_up.astype(jnp.float32))[:n], want_dg[:n], rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(d_weights)[:n], want_dw[:n], rtol=1e-5, atol=1e-4)
    from jax_uccl_ep import _uccl_ep_testing

    if n < m and _uccl_ep_testing.test_modes()["poison"]:
        assert np.isnan(np.asarray(h.astype(jnp.float32))[n:]).all()
        assert np.isnan(np.asarray(d_weights)[n:]).all()


def test_the_weighted_swiglu_refuses_mismatched_shapes():
    """The op checks its buffers against gate_up [rows, 2F], naming what it expected."""
    from jax_uccl_ep._ffi import ep_call

    gate_up, weights, n = jnp.ones((6, 8), jnp.float32), jnp.ones((5,), jnp.float32), jnp.int32(3)

    def step(gate_up, weights, n):
        (h,) = ep_call("swiglu", (jax.ShapeDtypeStruct((6, 4), jnp.float32),), gate_up, weights, n, ordered=False)
        return h

    with pytest.raises(Exception, match="swiglu: expected gate_up"):
        jax.block_until_ready(jax.jit(step)(gate_up, weights, n))


def test_buffers_sized_by_the_layers_shapes_run_its_worst_routing_the_first_time():
    """initialize(shapes=lambda platform: moe_job_shapes(...)) sizes the proxy buffer for the layer's ops: with every
    token's slots on the last rank's experts, the training step (forward and gradients) and the decoding layer
    run the first time on it, right against the dense reference; a page a region less makes an op advise more."""
    import dataclasses
    import re

    config = layers.MoEConfig(num_experts=E, top_k=K)
    params, _, mesh = _inputs(11)
    batch, seq = 4 * R, 16  # 64 tokens a rank: messages of many pages, so a page a region is sharp
    x = jnp.abs(jax.random.normal(jax.random.key(13), (batch, seq, D), jnp.float32))  # positive channels: the
    x = jax.device_put(x, NamedSharding(mesh, P("ep")))  # router's positive columns win for every token
    router = -jnp.abs(jax.random.normal(jax.random.key(12), (D, E), jnp.float32))
    router = router.at[:, E - E // R :].set(jnp.abs(router[:, E - E // R :]) + 1.0)
    params = dict(params, router=jax.device_put(router, params["router"].sharding))
    tokens_per_rank, decode_tokens = batch // R * seq, batch // R

    def shapes(platform):
        assert platform == "cpu"
        return layers.moe_job_shapes(
            config,
            tokens_per_rank=tokens_per_rank,
            d_model=D,
            platform=platform,
            decode_tokens_per_rank=decode_tokens,
            decode_fp8=False,
        )

    def loss(p, x):
        return jnp.sum(layers.moe_ffn(p, x, mesh=mesh, config=config).y ** 2)

    def decode(p, t):
        return layers.moe_ffn_decode(p, t[0], config, axis_name="ep", max_tokens_per_rank=decode_tokens, use_fp8=False)

    specs = (layers.moe_param_specs("ep"), P("ep"))
    decode_f = jax.jit(jax.shard_map(lambda p, t: decode(p, t)[None], mesh=mesh, in_specs=specs, out_specs=P("ep")))
    step = jax.jit(jax.value_and_grad(loss))
    first = x[:, :1].reshape(R, decode_tokens, D)  # each rank's decode tokens: the first position of its sequences
    try:
        ep.shutdown()
        with pytest.raises(TypeError, match="shapes must be a JobShapes .* got NoneType"):
            ep.initialize(shapes=lambda platform: None)
        ep.initialize(shapes=shapes)
        sized = ep.config().buffer_bytes
        assert sized == ep.proxy_buffer_bytes(
            tokens_per_rank,
            D,
            num_ranks=R,
            topk=K,
            dtype=jnp.float32,
            combine_dtype=jnp.float32,
            low_latency_max_tokens=decode_tokens,
            num_experts=E,
            low_latency_fp8=False,
            platform="cpu",
        )
        out = jax.jit(lambda p, x: layers.moe_ffn(p, x, mesh=mesh, config=config))(params, x)
        assert int(np.asarray(out.stats.rows_received)[-1]) == R * tokens_per_rank  # the worst routing, as meant
        value, grads = step(params, x)
        want = lambda p: jnp.sum(layers.moe_ffn_reference(p, x, config).y ** 2)  # noqa: E731
        want_value, want_grads = jax.value_and_grad(want)(params)
        np.testing.assert_allclose(float(value), float(want_value), rtol=1e-4)
        for k in want_grads:
            np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(want_grads[k]), rtol=2e-3, atol=2e-4)
        got = np.asarray(decode_f(params, first)).reshape(-1, D)
        np.testing.assert_allclose(
            got, np.asarray(layers.moe_ffn_reference(params, first, config).y).reshape(-1, D), rtol=2e-5, atol=2e-5
        )
        ep.shutdown()
        smaller = sized - 2 * R * 4096
        ep.initialize(config=dataclasses.replace(ep.config(), buffer_bytes=smaller))
        with pytest.raises(Exception, match=r"raise UCCL_EP_BUFFER_BYTES to at least \d+") as info:
            jax.block_until_ready(step(params, x))
        assert int(re.search(r"at least (\d+)", str(info.value)).group(1)) == sized, str(info.value)
    finally:
        ep.shutdown()
        ep.initialize()


def test_the_training_step_on_a_dp_by_ep_mesh_of_8_cpu_devices_never_stops():
    """XLA:CPU's all-reduces (the layer's statistics, the dp reductions of its gradients) beside its EP ops, on a
    (dp 2, ep 4) mesh of 8 CPU devices, each run a fresh process, through moe_ffn and through moe_ffn_local inside
    the script's own shard_map: before the layer ordered them after its EP ops, about half the moe_ffn runs and 1
    in 10 of the moe_ffn_local ones stopped until XLA aborted them after 40 s."""
    from stress.collectives_beside_ep_ops import run_once

    outcomes = [run_once(timeout_s=120.0, local=local) for local in (False, True) for _ in range(3)]
    assert all(ok for ok, _ in outcomes), outcomes
