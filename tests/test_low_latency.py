"""Low-latency mode on CPU devices against a NumPy reference written from the spec."""

from __future__ import annotations

import cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_uccl_ep as ep


@pytest.fixture(scope="module", autouse=True)
def runtime():
    ep.initialize()
    yield


@pytest.mark.parametrize(
    "num_ranks,num_tokens,n,hidden,topk,num_experts,kw",
    [
        (1, 5, 8, 128, 2, 4, dict(use_fp8=False)),
        (2, 16, 16, 256, 3, 8, dict(use_fp8=True)),
        (4, 13, 20, 512, 4, 16, dict(use_fp8=True, round_scale=True)),
        (4, 9, 9, 512, 2, 8, dict(use_fp8=True, use_ue8m0=True)),
        (4, 11, 12, 128, 3, 8, dict(use_fp8=False)),
    ],
)
def test_dispatch_and_weighted_combine_match_reference(num_ranks, num_tokens, n, hidden, topk, num_experts, kw):
    mesh = Mesh(np.array(jax.devices()[:num_ranks]), ("ep",))
    problems = cases.check_low_latency(
        mesh, num_ranks * 100 + num_tokens, num_tokens, n, hidden, topk, num_experts, **kw
    )
    assert problems == []


@pytest.mark.parametrize(
    "dtype,round_scale,hidden",
    [(jnp.bfloat16, False, 384), (jnp.float32, False, 128), (jnp.bfloat16, True, 384), (jnp.float32, True, 640)],
)
def test_dispatch_casts_to_fp8_as_per_token_cast_to_fp8(dtype, round_scale, hidden):
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    problems = cases.check_low_latency_fp8_cast(
        mesh, 11, 12, hidden, 3, 8, dtype=dtype, round_scale=round_scale, nonfinite=True
    )
    assert problems == [], problems[:4]


def test_split_halves_match_reference():
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    assert cases.check_low_latency(mesh, 5, 10, 12, 256, 3, 8, split=True) == []


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("kw", [dict(use_fp8=False), dict(use_fp8=True)])
def test_weights_carried_by_the_dispatch_are_applied_on_the_experts_ranks(split, kw):
    """The dispatch carries the router weights (each row's in handle.weights); combine, given None, returns the
    same weighted sums: each expert's rank sums a token's rows, the token's rank adds a row per rank."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    problems = cases.check_low_latency(mesh, 41, 11, 12, 256, 4, 8, split=split, carry_weights=True, **kw)
    assert problems == []


def test_weights_carried_by_the_dispatch_sum_repeats_and_several_experts_of_a_rank():
    """Tokens naming two experts of one rank, an expert twice, unused slots, and a token sent nowhere: the sums
    match the token times its slots' weights, in float32 rows and bfloat16 rows."""
    x, idx, w = _ll_inputs(12, topk=4)
    idx[0, 0] = [1, 0, -1, 3]  # rank 0's experts 0 and 1, then rank 1's expert 3
    idx[1, 2] = [5, 5, 4, -1]  # expert 5 twice and 4: all on rank 2
    idx[3, 1] = -1  # sent nowhere
    for dtype in (np.float32, jnp.bfloat16):
        xd = np.asarray(jnp.asarray(x, dtype)).astype(np.float32)
        out, count = cases.low_latency_round_trip(
            Mesh(np.array(jax.devices()[:4]), ("ep",)), x.astype(dtype), idx, w, 8, carry_weights=True
        )
        want = cases.low_latency_weighted_sum(xd, idx, w)
        tol = 1e-5 if dtype == np.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=tol, atol=tol)
        assert count.sum() == (idx >= 0).sum()  # still a row per slot on the experts' side
        assert np.all(np.asarray(out)[3, 1] == 0)


def test_combine_after_a_dispatch_that_carried_the_weights_takes_none():
    """Weights at both ends, or at neither, is refused at trace time naming what to pass."""
    x, idx, w = _ll_inputs(13)
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))

    def call(carry, at_combine):
        def body(x, i, w):
            recv, _, handle = ep.low_latency_dispatch(
                x[0],
                i[0],
                num_experts=8,
                max_tokens_per_rank=6,
                axis_name="ep",
                use_fp8=False,
                topk_weights=w[0] if carry else None,
            )
            return ep.low_latency_combine(recv, i[0], w[0] if at_combine else None, handle)[None]

        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w)

    with pytest.raises(ValueError, match="the dispatch carried the router weights .* pass topk_weights=None"):
        call(True, True)
    with pytest.raises(ValueError, match="topk_weights must be given"):
        call(False, False)
    _ll_still_works()


def test_ue8m0_scales_are_powers_of_two():
    scales = jnp.asarray([[0.25, 1.0, 2.0**-20, 8.0]], jnp.float32)
    packed = ep.pack_ue8m0(scales)
    assert packed.shape == (1, 1) and packed.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ep.unpack_ue8m0(packed)), np.asarray(scales))


def test_too_many_tokens_and_bad_hidden_are_named():
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    x = jnp.ones((2, 8, 128), jnp.bfloat16)
    idx = jnp.zeros((2, 8, 1), jnp.int32)

    def call(n, rows=x, **kw):
        f = jax.shard_map(
            lambda x, i: ep.low_latency_dispatch(
                x[0], i[0], num_experts=2, max_tokens_per_rank=n, axis_name="ep", **kw
            )[1][None],
            mesh=mesh,
            in_specs=P("ep"),
            out_specs=P("ep"),
        )
        return jax.jit(f)(rows, idx)

    with pytest.raises(ValueError, match="max_tokens_per_rank must be an int >= the tokens per rank"):
        call(4)
    with pytest.raises(ValueError, match="use_ue8m0 needs hidden a multiple of 512, got 128: pass use_ue8m0=False"):
        call(8, use_ue8m0=True)
    call(8, use_ue8m0=True, use_fp8=False)  # no scales to pack: nothing to refuse
    with pytest.raises(ValueError, match="use_fp8 needs hidden a multiple of 128, got 64: pass use_fp8=False"):
        call(8, rows=jnp.ones((2, 8, 64), jnp.bfloat16))


def test_combine_with_another_number_of_slots_is_named():
    """Rows go back to slot token * K + k of their source: a combine with another K than its dispatch is refused
    before anything moves, in the fused call and in the split halves."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((2, 8, 128)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 4, (2, 8, 2)), jnp.int32)

    def body(x, i, split):
        recv, _, handle = ep.low_latency_dispatch(
            x[0], i[0], num_experts=4, max_tokens_per_rank=8, axis_name="ep", use_fp8=False
        )
        wider = jnp.concatenate([i[0], i[0][:, :1]], axis=1)  # K = 3
        w = jnp.ones(wider.shape, jnp.float32)
        if split:
            return ep.low_latency_combine_recv(ep.low_latency_combine_send(recv, handle), wider, w)[None]
        return ep.low_latency_combine(recv, wider, w, handle)[None]

    for split in (False, True):
        f = jax.shard_map(lambda x, i, split=split: body(x, i, split), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        with pytest.raises(ValueError, match=r"topk_idx must be the dispatch's, with K = 2 slots per token"):
            jax.jit(f)(x, idx)


def multi_process_low_latency(seed: int) -> dict:
    """Child: low-latency dispatch and combine over every device of 2 processes (R = 4)."""
    import cases
    import jax
    import numpy as np
    import reference as ref

    import jax_uccl_ep as ep

    ep.initialize()
    mesh = cases.mesh_of(jax.devices())
    r = mesh.devices.size
    rng = np.random.default_rng(seed)
    t, n, h, k, e = 10, 12, 256, 3, 4 * r
    idx = ref.random_routing(rng, r, t, k, e)
    x = rng.standard_normal((r, t, h)).astype(np.float32)
    w = rng.random((r, t, k)).astype(np.float32)

    def body(x, idx, w):
        recv, count, handle = ep.low_latency_dispatch(
            x[0], idx[0], num_experts=e, max_tokens_per_rank=n, axis_name="ep", use_fp8=False
        )
        return ep.low_latency_combine(recv * 2, idx[0], w[0], handle)[None], count[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=cases.P("ep"), out_specs=cases.P("ep")))
    out, count = (cases.gather(a) for a in f(*(cases.shard(mesh, a) for a in (x, idx, w))))
    problems = []
    want = 2 * cases.low_latency_weighted_sum(x, idx, w)
    if not np.allclose(out, want, rtol=1e-5, atol=1e-5):
        problems.append(f"combine differs by {np.abs(out - want).max()}")
    per_expert = np.bincount(idx[idx >= 0], minlength=e).reshape(r, e // r)
    if not np.array_equal(count, per_expert):
        problems.append("recv_count differs")
    ep.shutdown()
    return {"problems": problems}


def test_low_latency_across_processes():
    from mp import launch_ok

    for res in launch_ok(
        __file__, "multi_process_low_latency", 2, args=[4], devices_per_process=2, env={"UCCL_EP_REORDER": "1"}
    ):
        assert res["problems"] == []


def test_split_halves_give_identical_results_with_work_between():
    num_ranks, t, n, h, k, e = 4, 12, 16, 256, 3, 16
    rng = np.random.default_rng(12)
    idx = jnp.asarray(ref.random_routing(rng, num_ranks, t, k, e))
    x = jnp.asarray(rng.standard_normal((num_ranks, t, h)), jnp.bfloat16)
    w = jnp.asarray(rng.random((num_ranks, t, k)), jnp.float32)
    other = jnp.asarray(rng.standard_normal((num_ranks, 64, 64)), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:num_ranks]), ("ep",))
    kw = dict(num_experts=e, max_tokens_per_rank=n, axis_name="ep")

    def fused(x, i, w, o):
        recv, count, handle = ep.low_latency_dispatch(x[0], i[0], **kw)
        y = recv[0].astype(jnp.bfloat16)
        return ep.low_latency_combine(y, i[0], w[0], handle)[None], count[None], (o[0] @ o[0])[None]

    def split(x, i, w, o):
        pending = ep.low_latency_dispatch_send(x[0], i[0], **kw)
        busy = o[0] @ o[0]  # work that XLA may run while the tokens travel
        recv, count, handle = ep.low_latency_dispatch_recv(pending)
        pending = ep.low_latency_combine_send(recv[0].astype(jnp.bfloat16), handle)
        busy = busy @ o[0]
        out = ep.low_latency_combine_recv(pending, i[0], w[0])
        return out[None], count[None], (busy @ jnp.linalg.pinv(o[0]))[None]

    def run(body):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        return [np.asarray(a) for a in f(x, idx, w, other)]

    a, b = run(fused), run(split)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert np.abs(a[0]).sum() > 0


def test_another_ep_op_between_the_halves_is_refused():
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 4, 128)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 4, (2, 4, 1)), jnp.int32)

    def body(x, i):
        pending = ep.low_latency_dispatch_send(
            x[0], i[0], num_experts=4, max_tokens_per_rank=4, axis_name="ep", use_fp8=False
        )
        # A normal dispatch between the halves (data dependencies pin it there): not allowed.
        xi = x[0] + jnp.where(pending.token[0] < -1000, 1.0, 0.0)  # not foldable: XLA cannot see the value
        r = ep.dispatch(xi, i[0], num_experts=4, axis_name="ep")
        pending = ep.LowLatencyPending(pending.token + jnp.where(r.num_tokens < 0, 1, 0), pending.static)
        recv, _, _ = ep.low_latency_dispatch_recv(pending)
        return r.x[None], recv[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    with pytest.raises(Exception, match="still waits for its receive half"):
        jax.block_until_ready(f(x, idx))
    # The waiting round's messages were never read: the ranks are out of step until the runtime is reset.
    ep.shutdown()
    ep.initialize()
    g = jax.jit(
        jax.shard_map(
            lambda x, i: ep.combine(
                *(lambda r: (r.x, r.handle))(ep.dispatch(x[0], i[0], num_experts=4, axis_name="ep"))
            )[None],
            mesh=mesh,
            in_specs=P("ep"),
            out_specs=P("ep"),
        )
    )
    np.testing.assert_allclose(np.asarray(g(x, idx)), np.asarray(x))


def test_running_per_expert_counter_adds_up_over_steps():
    num_ranks, t, k, e, steps = 4, 10, 2, 8, 3
    rng = np.random.default_rng(33)
    idx = np.stack([ref.random_routing(rng, num_ranks, t, k, e) for _ in range(steps)], 1)
    x = jnp.asarray(rng.standard_normal((num_ranks, t, 128)), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:num_ranks]), ("ep",))

    def body(x, idx):
        stats = jnp.zeros((e // num_ranks,), jnp.int32)
        for s in range(steps):
            _, _, handle = ep.low_latency_dispatch(
                x[0],
                idx[0, s],
                num_experts=e,
                max_tokens_per_rank=t,
                axis_name="ep",
                use_fp8=False,
                cumulative_local_expert_recv_stats=stats,
            )
            stats = handle.cumulative_local_expert_recv_stats
        return stats[None]

    got = np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x, jnp.asarray(idx)))
    want = np.bincount(idx[idx >= 0], minlength=e).reshape(num_ranks, e // num_ranks)
    np.testing.assert_array_equal(got, want)


def _ll_round_trip(x, idx, w, *, combine_idx=None, num_experts=8, n=None, ranks=4):
    """Dispatch (no FP8), identity experts, combine; combine_idx replaces the routing given to combine."""
    mesh = Mesh(np.array(jax.devices()[:ranks]), ("ep",))
    return cases.low_latency_round_trip(mesh, x, idx, w, num_experts, combine_idx=combine_idx, max_tokens=n)


def _ll_inputs(seed, ranks=4, tokens=6, hidden=128, topk=2, experts=8):
    rng = np.random.default_rng(seed)
    idx = ref.random_routing(rng, ranks, tokens, topk, experts)
    x = rng.standard_normal((ranks, tokens, hidden)).astype(np.float32)
    w = rng.random((ranks, tokens, topk)).astype(np.float32)
    return x, idx, w


def _ll_still_works():
    x, idx, w = _ll_inputs(77)
    out, _ = _ll_round_trip(x, idx, w)
    np.testing.assert_allclose(out, cases.low_latency_weighted_sum(x, idx, w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [8, 1000, -2])
def test_bad_expert_index_raises_on_every_rank_and_runtime_stays_usable(bad):
    x, idx, w = _ll_inputs(3)
    idx[1, 2, 0] = bad
    with pytest.raises(Exception, match=rf"topk_idx\[2, 0\] = {bad} is outside \[-1, num_experts=8\)"):
        _ll_round_trip(x, idx, w)
    _ll_still_works()


@pytest.mark.parametrize("bad", [8, -2])
@pytest.mark.parametrize("carry", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_a_bad_index_given_to_combine_is_named_and_the_runtime_stays_usable(bad, carry, split):
    """Combine takes the routing again: a bad index there (other than the dispatch's) is named, on every rank where
    the op is fused, on its own rank in the receive half (the round is done by then), and the next call works. With
    the weights carried each rank's row comes back at the token's first slot on that rank, so the bad index sits
    in a later slot of the same rank: it must still be named."""
    x, idx, w = _ll_inputs(9)
    idx[1, 4] = [2, 3]  # two experts of rank 1: slot 1 repeats the rank
    other = idx.copy()
    other[1, 4, 1] = bad
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    with pytest.raises(Exception, match=rf"topk_idx\[4, 1\] = {bad} is outside \[-1, num_experts=8\)"):
        cases.low_latency_round_trip(mesh, x, idx, w, 8, combine_idx=other, carry_weights=carry, split_combine=split)
    _ll_still_works()


def test_an_expert_named_in_more_slots_than_it_holds_is_named_on_every_rank_and_the_runtime_stays_usable():
    """A row goes per top-k slot and an expert holds max_tokens_per_rank rows from each rank, so only tokens naming an
    expert twice can pass it: the ranks refuse the call before any row moves, naming the expert and a token that
    repeats it, and the next call works."""
    x, idx, w = _ll_inputs(5)
    idx[2, :, :] = 3  # every token of rank 2 names expert 3 in both slots: 12 rows for 6
    idx[2, 4, 1] = 6
    with pytest.raises(Exception, match=r"rank 2 sends expert 3 11 rows, more than max_tokens_per_rank=6 .*token 0"):
        _ll_round_trip(x, idx, w)
    _ll_still_works()


def test_a_repeated_expert_that_fits_gets_a_row_per_slot():
    """Repeats are legal where they fit: the token comes back with the sum of both slots' weights."""
    x, idx, w = _ll_inputs(6)
    idx[1, 3, :] = 5
    out, count = _ll_round_trip(x, idx, w)
    np.testing.assert_allclose(out, cases.low_latency_weighted_sum(x, idx, w), rtol=1e-5, atol=1e-6)
    assert count[2].sum() == (idx // 2 == 2).sum(), count  # expert 5's rank: a row per slot, both of token 3's


def test_expert_indices_wider_than_int32_are_refused_not_wrapped():
    """Under jax_enable_x64 an int64 index past int32's range is refused by value, not wrapped onto an expert
    (2**32 + 1 would wrap to expert 1)."""
    x, idx, w = _ll_inputs(8)
    wide = idx.astype(np.int64)
    wide[0, 1, 0] = 2**32 + 1
    with jax.enable_x64(True):
        with pytest.raises(Exception, match=r"topk_idx\[1, 0\] = 2147483647 is outside \[-1, num_experts=8\)"):
            _ll_round_trip(x, wide, w)
    _ll_still_works()


def test_nan_weights_stay_in_their_tokens():
    x, idx, w = _ll_inputs(4)
    w[0, 1, :] = np.nan
    idx[0, 1, :] = [0, 5]  # token 1 of rank 0 certainly goes somewhere
    out, _ = _ll_round_trip(x, idx, w)
    assert np.isnan(out[0, 1]).all()
    mask = np.ones(out.shape[:2], bool)
    mask[0, 1] = False
    want = cases.low_latency_weighted_sum(x, idx, w)
    np.testing.assert_allclose(out[mask], want[mask], rtol=1e-5, atol=1e-6)


def test_combine_with_other_routing_than_the_dispatch_is_named():
    x, idx, w = _ll_inputs(5)
    other = idx.copy()
    other[2] = np.roll(other[2], 1, axis=0)
    other[2, 0] = [0, 1]
    other[2, 1] = [0, 1]  # rank 2 now claims more rows from rank 0 than it sent
    with pytest.raises(Exception, match="stale handle"):
        _ll_round_trip(x, idx, w, combine_idx=other)
    # A mismatch found after the exchange leaves the ranks out of step: a reset brings them back.
    ep.shutdown()
    ep.initialize()
    _ll_still_works()
