"""dispatch(layout="expert") on CPU devices against the NumPy reference: pair rows, order, offsets, weights,
capacity, FP8 pairs, combine and gradients, in one process and across processes; both ways of writing the pairs:
the receive's own (the *_pairs ops, CPU devices) and the XLA layout after token rows (the GPU paths'), against the
reference and against each other."""

from __future__ import annotations

import os
import zlib

import cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from mp import launch_ok

import jax_uccl_ep as ep

HERE = os.path.abspath(__file__)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    ep.initialize()


def _mesh(num_ranks: int) -> Mesh:
    return cases.mesh_of(jax.devices()[:num_ranks])


@pytest.fixture(params=["receive", "xla", "nvlink"])
def writer(request):
    """Who writes the pair buffer and sums it back: the receive both (CPU devices' default); XLA both, after token
    rows (the GPU paths'); the receive writes and XLA sums (the NVLink path's with bulk copies)."""
    if request.param == "xla":
        with cases.pairs_laid_out_in_xla():
            yield request.param
    elif request.param == "nvlink":
        with cases.pairs_written_then_summed_before_combine():
            yield request.param
    else:
        yield request.param


CASES = [
    # ranks, tokens, hidden, topk, experts, dtype, alignment, capacity (pairs; None: never drops)
    (1, 9, 128, 2, 4, jnp.float32, 1, None),
    (2, 37, 128, 3, 4, jnp.float32, 4, None),  # more slots than local experts
    (4, 23, 256, 4, 16, jnp.float32, 1, None),
    (4, 16, 384, 8, 32, jnp.bfloat16, 8, None),
    (4, 20, 128, 4, 16, jnp.float32, 4, 40),  # drops: rows past the ones whose aligned pairs fit
    (2, 30, 128, 2, 8, jnp.bfloat16, 1, 7),
]


@pytest.mark.parametrize("num_ranks,num_tokens,hidden,topk,num_experts,dtype,alignment,capacity", CASES)
def test_pairs_match_reference(num_ranks, num_tokens, hidden, topk, num_experts, dtype, alignment, capacity, writer):
    seed = zlib.crc32(repr((num_ranks, num_tokens, hidden, topk, alignment, capacity)).encode())
    problems = cases.check_expert_layout(
        _mesh(num_ranks), seed, num_tokens, hidden, topk, num_experts, dtype, alignment=alignment, capacity=capacity
    )
    assert problems == []


def test_a_small_capacity_drops_what_the_reference_drops():
    """The capacity case above must really drop, or it proves nothing about the drop rule."""
    rng = np.random.default_rng(zlib.crc32(b"drops"))
    idx = ref.random_routing(rng, 4, 20, 4, 16)
    x = rng.standard_normal((4, 20, 8))
    expected = ref.dispatch_by_expert(x, idx, None, 16, 4, 40)
    assert any(e["num_dropped"] > 0 for e in expected)
    assert all(e["num_tokens"] > 0 for e in expected)


def test_a_row_naming_one_expert_twice_gets_two_pairs(writer):
    """Routing is the caller's: a row that names an expert in two slots sends it two pair rows, in k order (the
    NVLink writer counts such warps apart from its popcount)."""
    assert cases.check_expert_layout(_mesh(4), 6, 40, 128, 4, 8, jnp.float32, alignment=2, repeats=0.35) == []


def test_fp8_pairs_travel_with_their_scales(writer):
    assert cases.check_expert_layout(_mesh(4), 5, 19, 256, 3, 8, jnp.float32, alignment=2, fp8_pair=True) == []


def test_gradients_match_dense_reference(writer):
    assert cases.check_expert_gradients(_mesh(4), 7, 12, 128, 3, 8) == []


def test_gradients_through_the_fp8_wire(writer):
    assert cases.check_expert_gradients(_mesh(4), 8, 12, 128, 3, 8, use_fp8=True) == []


def test_offsets_are_aligned_and_groups_do_not_overlap():
    r, t, k, e, a = 4, 31, 4, 16, 16
    rng = np.random.default_rng(3)
    idx = ref.random_routing(rng, r, t, k, e)
    x = rng.standard_normal((r, t, 128)).astype(np.float32)

    def body(x, idx):
        res = ep.dispatch(x[0], idx[0], num_experts=e, axis_name="ep", layout="expert", expert_alignment=a)
        return res.expert_offsets[None], res.num_tokens_per_expert[None], jnp.asarray(res.x.shape[0])[None]

    f = jax.jit(jax.shard_map(body, mesh=_mesh(r), in_specs=P("ep"), out_specs=P("ep")))
    offsets, counts, rows = (np.asarray(o) for o in f(cases.shard(_mesh(r), x), cases.shard(_mesh(r), idx)))
    assert np.all(rows == r * t * min(k, e // r) + (a - 1) * (e // r))  # the never-dropping default M
    assert np.all(offsets % a == 0)
    assert np.all(np.diff(offsets, axis=1) >= counts[:, :-1])
    assert np.all(offsets[:, -1] + counts[:, -1] <= rows[:, None])


def test_overflow_error_is_raised_naming_the_rank(writer):
    r, t, k, e = 4, 24, 4, 16
    rng = np.random.default_rng(4)
    idx = ref.random_routing(rng, r, t, k, e)
    idx[:, :, 0] = 2  # every token to expert 2 as well: rank 0 gets far more pairs than the others
    x = rng.standard_normal((r, t, 128)).astype(np.float32)
    need = [int(ex["num_tokens_per_expert"].sum()) for ex in ref.dispatch_by_expert(x, idx, None, e, 1, 10**6)]
    assert need[0] > 50 and need[0] == max(need)

    def body(x, idx):
        res = ep.dispatch(x[0], idx[0], num_experts=e, axis_name="ep", layout="expert", capacity=50)
        return ep.combine(res.x, res.handle)[None]

    f = jax.jit(jax.shard_map(body, mesh=_mesh(r), in_specs=P("ep"), out_specs=P("ep")))
    with pytest.raises(
        Exception, match=rf"rank 0 (of the EP axis )?received pairs that need {need[0]} rows .* capacity is 50"
    ):
        jax.block_until_ready(f(cases.shard(_mesh(r), x), cases.shard(_mesh(r), idx)))
    # The runtime stays usable: a fitting capacity runs.
    assert cases.check_expert_layout(_mesh(4), 9, 10, 128, 2, 8, jnp.float32) == []


def test_overflow_names_the_rank_by_its_place_on_the_axis(writer):
    """A mesh whose axis lists the devices in reverse: both writers name the neediest rank by its index on the EP
    axis (the one a user's mesh gives), not by the runtime's numbering."""
    r, t, k, e = 4, 16, 2, 8
    idx = np.full((r, t, k), -1, np.int32)
    idx[:, :, 0] = 1  # every token to expert 1: axis position 0's rank needs every pair
    x = np.random.default_rng(6).standard_normal((r, t, 128)).astype(np.float32)
    mesh = cases.mesh_of(list(reversed(jax.devices()[:r])))

    def body(x, idx):
        res = ep.dispatch(x[0], idx[0], num_experts=e, axis_name="ep", layout="expert", capacity=20)
        return ep.combine(res.x, res.handle)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    with pytest.raises(Exception, match=rf"rank 0 of the EP axis received pairs that need {r * t} rows"):
        jax.block_until_ready(f(cases.shard(mesh, x), cases.shard(mesh, idx)))


def test_the_default_capacity_overflowing_on_a_repeated_expert_says_why(writer):
    """The default capacity holds every pair where each token names an expert once; a router that names one expert in
    two slots can pass it, and the error says that the default assumes so, rather than that it never drops."""
    r, t, k, e = 2, 8, 2, 2
    idx = np.zeros((r, t, k), np.int32)  # every token names expert 0 in both slots: rank 0 needs r * t * k rows
    x = np.random.default_rng(7).standard_normal((r, t, 16)).astype(np.float32)
    mesh = cases.mesh_of(jax.devices()[:r])

    def body(x, idx):
        res = ep.dispatch(x[0], idx[0], num_experts=e, axis_name="ep", layout="expert")
        return ep.combine(res.x, res.handle)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    message = rf"need {r * t * k} rows .* capacity is {r * t}; .* names an expert at most once"
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(f(cases.shard(mesh, x), cases.shard(mesh, idx)))


def test_the_capacity_check_runs_only_where_pairs_can_overflow():
    """The XLA layout's check under overflow="error" costs two pmax and, on GPUs, a wait for the stream: a capacity
    that holds every slot of every row leaves it out; a smaller one keeps it. (The receive checks in its own op.)"""

    def program(capacity):
        def body(x, idx):
            res = ep.dispatch(x[0], idx[0], num_experts=8, axis_name="ep", layout="expert", capacity=capacity)
            return ep.combine(res.x, res.handle)[None]

        f = jax.shard_map(body, mesh=_mesh(2), in_specs=P("ep"), out_specs=P("ep"))
        return str(jax.make_jaxpr(f)(jnp.ones((2, 4, 128), jnp.float32), jnp.zeros((2, 4, 3), jnp.int32)))

    with cases.pairs_laid_out_in_xla():
        assert "pair_capacity" not in program(None)  # 2 ranks x 4 tokens x min(3, 4) slots: every slot fits
        assert "pair_capacity" in program(20)
    assert "dispatch_pairs" in program(20) and "pair_capacity" not in program(20)


def test_the_nvlink_writer_takes_the_pairs_it_can_hold_and_leaves_the_rest_to_xla():
    """Where dispatch pulls over NVLink, dispatch_pairs writes the pair buffer and combine sums it first (no
    combine_pairs op), for buffers that hold every top-k slot with rows and scale rows of 16-byte multiples; a
    smaller buffer, 8-byte scale rows or more than 256 local experts go through token rows and XLA's layout."""

    def program(capacity=None, hidden=128, use_fp8=False, experts=8, topk=3):
        def body(x, idx):
            res = ep.dispatch(
                x[0], idx[0], num_experts=experts, axis_name="ep", layout="expert", capacity=capacity, use_fp8=use_fp8
            )
            return ep.combine(res.x.astype(jnp.float32), res.handle)[None]

        f = jax.shard_map(body, mesh=_mesh(2), in_specs=P("ep"), out_specs=P("ep"))
        return str(jax.make_jaxpr(f)(jnp.ones((2, 4, hidden), jnp.float32), jnp.zeros((2, 4, topk), jnp.int32)))

    with cases.pairs_written_then_summed_before_combine():
        for written in (program(), program(hidden=512, use_fp8=True)):
            assert "op='dispatch_pairs'" in written and "combine_pairs" not in written and "expand_pairs" not in written
        for kw in (dict(capacity=20), dict(hidden=256, use_fp8=True), dict(experts=1024, topk=2)):
            laid_out = program(**kw)
            assert "op='dispatch_pairs'" not in laid_out and "op='dispatch'" in laid_out, kw


AGREE = [
    # ranks, tokens, hidden, topk, experts, dtype, alignment, capacity, use_fp8
    (4, 21, 128, 4, 16, jnp.float32, 1, None, False),
    (2, 33, 256, 3, 4, jnp.bfloat16, 8, None, False),  # more slots than local experts, aligned
    (4, 20, 128, 4, 16, jnp.float32, 4, 40, False),  # drops
    (4, 15, 256, 2, 8, jnp.float32, 2, None, True),  # FP8 on the wire
    (4, 17, 128, 3, 8, jnp.float16, 2, None, False),  # float16 pair sums travel as float32 both ways
]


@pytest.mark.parametrize("num_ranks,num_tokens,hidden,topk,num_experts,dtype,alignment,capacity,use_fp8", AGREE)
def test_the_receive_writes_what_the_xla_layout_writes(
    num_ranks, num_tokens, hidden, topk, num_experts, dtype, alignment, capacity, use_fp8
):
    seed = zlib.crc32(repr(("agree", num_ranks, num_tokens, alignment, capacity, use_fp8)).encode())
    problems = cases.check_pair_writers_agree(
        _mesh(num_ranks),
        seed,
        num_tokens,
        hidden,
        topk,
        num_experts,
        dtype,
        alignment=alignment,
        capacity=capacity,
        use_fp8=use_fp8,
    )
    assert problems == []


def test_zero_padding_off_leaves_the_rows_outside_the_groups_and_nothing_else_changes(writer):
    """zero_padding=False: the groups' rows, offsets, counts and weights, combine's sums, the gradient of x and the
    cotangent combine gives the pair rows inside the groups are those of the zeroed buffer; the rows outside the
    groups are left as the op found them (with the suite's poisoned outputs: NaN in every one), whether the receive
    writes the pairs or the FFI's expand_pairs after token rows; so is combine's cotangent there after token rows
    (the receive's own combine writes zeros, which the contract allows)."""
    from jax_uccl_ep import _uccl_ep_testing

    num_ranks, num_tokens, hidden, topk, num_experts, alignment = 4, 19, 128, 3, 16, 4
    x, _, idx, w = cases.random_case(41, num_ranks, num_tokens, hidden, topk, num_experts, jnp.bfloat16)
    cot = jnp.asarray(np.random.default_rng(42).standard_normal((num_ranks, num_tokens, hidden)), jnp.float32)

    def run(zero_padding):
        def body(x, idx, w, cot):
            def loss(x):
                res = ep.dispatch(
                    x[0],
                    idx[0],
                    w[0],
                    num_experts=num_experts,
                    axis_name="ep",
                    layout="expert",
                    expert_alignment=alignment,
                    zero_padding=zero_padding,
                )
                y = ep.combine(res.x * 3, res.handle).astype(jnp.float32)
                return jnp.sum(y * cot[0]), (res, y)

            (_, (res, y)), dx = jax.value_and_grad(loss, has_aux=True)(x)
            d_pairs = jax.grad(lambda p: jnp.sum(ep.combine(p, res.handle).astype(jnp.float32) * cot[0]))(res.x)
            out = (res.x, res.weights, res.expert_offsets, res.num_tokens_per_expert, y, dx[0], d_pairs)
            return tuple(a[None] for a in out)

        spec = P("ep")
        f = jax.shard_map(body, mesh=_mesh(num_ranks), in_specs=(spec,) * 4, out_specs=(spec,) * 7)
        return [np.asarray(a.astype(jnp.float32)) for a in jax.jit(f)(x, jnp.asarray(idx, jnp.int32), w, cot)]

    zeroed, left = run(True), run(False)
    for name, a, b in zip(["weights", "offsets", "counts", "combine", "dx"], zeroed[1:6], left[1:6]):
        np.testing.assert_array_equal(a, b, err_msg=name)
    poisoned = _uccl_ep_testing.test_modes()["poison"]
    for r in range(num_ranks):
        inside = np.zeros(zeroed[0].shape[1], bool)
        for start, count in zip(zeroed[2][r], zeroed[3][r]):
            inside[int(start) : int(start + count)] = True
        assert inside.any() and not inside.all()
        for i in (0, 6):  # the pair rows, combine's cotangent of them
            np.testing.assert_array_equal(zeroed[i][r][inside], left[i][r][inside])
            assert not zeroed[i][r][~inside].any()
        outside = left[0][r][~inside]
        assert np.isnan(outside).all() if poisoned else not outside.any()
        cotangent_outside = left[6][r][~inside]
        if poisoned and writer != "receive":  # the cotangent goes to token rows, then the FFI's expand_pairs
            assert np.isnan(cotangent_outside).all()
        else:
            assert not cotangent_outside.any()


@pytest.mark.parametrize("row_shape,dtype", [((128,), jnp.bfloat16), ((3, 5), jnp.float32), ((7,), jnp.uint8)])
@pytest.mark.parametrize("zero_padding", [True, False])
def test_expand_copies_each_slot_its_row(row_shape, dtype, zero_padding):
    """The pair rows from token rows: every slot whose pair_row names a row holds that row bit for bit; the others
    hold zeros, or (without zero_padding) whatever the output held (the suite poisons it: NaN, 0xFF). Rows of 7
    bytes and of 60 take the copy's narrow path on GPUs."""
    from jax_uccl_ep import _pairs, _uccl_ep_testing

    rng = np.random.default_rng(len(row_shape) * 10 + zero_padding)
    c, m = 23, 61
    rows = rng.standard_normal((c, *row_shape)) * 50
    rows = jnp.asarray(rows.astype(np.uint8) if dtype == jnp.uint8 else rows, dtype)
    pair_row = rng.integers(0, c + 3, m).astype(np.int32)  # some name no row: C and past (the layout puts C)
    pair_row[:5] = c
    got = np.asarray(jax.jit(lambda r, p: _pairs.expand(r, p, None, zero_padding))(rows, jnp.asarray(pair_row)))
    named = (pair_row >= 0) & (pair_row < c)
    want = np.asarray(rows)[np.clip(pair_row, 0, c - 1)]
    np.testing.assert_array_equal(got[named], want[named])
    if zero_padding:
        assert not got[~named].any()
    elif _uccl_ep_testing.test_modes()["poison"]:
        outside = got[~named].view(np.uint8)
        assert (outside == 0xFF).all()


@pytest.mark.parametrize("shape,dtype", [((9, 5), jnp.float32), ((9, 4, 2), jnp.float32), ((9, 4), jnp.int32)])
def test_expand_refuses_pair_rows_unlike_the_rows(shape, dtype):
    """The copy op checks its output against its rows: one row per slot, the rows' row shape and dtype (a wrong
    width would copy past a row), naming what it expected."""
    from jax_uccl_ep._ffi import ep_call

    rows, pair_row = jnp.ones((3, 4), jnp.float32), jnp.zeros((9,), jnp.int32)

    def copy(rows, pair_row):
        (out,) = ep_call(
            "expand_pairs", (jax.ShapeDtypeStruct(shape, dtype),), rows, pair_row, ordered=False, zero_padding=1
        )
        return out

    with pytest.raises(Exception, match="expand_pairs: the pair rows must be"):
        jax.block_until_ready(jax.jit(copy)(rows, pair_row))


@pytest.mark.parametrize("rows,slots,hidden,topk,pairs_dtype,rows_dtype", cases.SUM_PAIRS_CASES)
def test_sum_pairs_adds_each_rows_slots_in_float32(rows, slots, hidden, topk, pairs_dtype, rows_dtype):
    """Combine's first step where the pairs were laid out after token rows (reduce_pairs by the FFI's sum_pairs) and
    XLA's gather and sum, against NumPy."""
    seed = zlib.crc32(repr(("sum", rows, hidden, topk)).encode())
    assert cases.sum_pairs_problems(seed, rows, slots, hidden, topk, pairs_dtype, rows_dtype) == []


@pytest.mark.parametrize("rows_shape", [(5, 9), (4, 8, 1)])
def test_sum_pairs_refuses_rows_unlike_the_pairs(rows_shape):
    """The sum op checks its output against its operands (a row for each of pair_of's, the pairs' width), naming
    what it expected."""
    from jax_uccl_ep._ffi import ep_call

    pairs, pair_of = jnp.ones((6, 8), jnp.float32), jnp.zeros((4, 2), jnp.int32)

    def total(pairs, pair_of):
        (out,) = ep_call("sum_pairs", (jax.ShapeDtypeStruct(rows_shape, jnp.float32),), pairs, pair_of, ordered=False)
        return out

    with pytest.raises(Exception, match=r"sum_pairs: expected pairs \[M, H\], pair_of \[C, K\]"):
        jax.block_until_ready(jax.jit(total)(pairs, pair_of))


def test_combine_refuses_rows_of_another_shape():
    def body(x, idx):
        res = ep.dispatch(x[0], idx[0], num_experts=8, axis_name="ep", layout="expert")
        return ep.combine(res.x[:-1], res.handle)[None]

    f = jax.shard_map(body, mesh=_mesh(2), in_specs=P("ep"), out_specs=P("ep"))
    x = jnp.ones((2, 4, 128), jnp.float32)
    idx = jnp.zeros((2, 4, 2), jnp.int32).at[..., 1].set(5)
    with pytest.raises(ValueError, match="pair rows"):
        jax.eval_shape(f, x, idx)


def multi_process_pairs(seed: int) -> dict:
    """Child: R = all devices of all processes; the expert layout and its gradients against the reference."""
    import cases
    import jax
    import jax.numpy as jnp

    import jax_uccl_ep as ep

    ep.initialize()
    mesh = cases.mesh_of(jax.devices())
    num_ranks = mesh.devices.size
    problems = cases.check_expert_layout(mesh, seed, 21, 256, 4, 4 * num_ranks, jnp.bfloat16, alignment=4)
    problems += cases.check_expert_layout(mesh, seed + 1, 17, 128, 3, 2 * num_ranks, jnp.float32, capacity=30)
    problems += cases.check_expert_gradients(mesh, seed + 2, 9, 128, 3, 2 * num_ranks)
    problems += cases.check_pair_writers_agree(mesh, seed + 3, 13, 128, 3, 2 * num_ranks, jnp.float32, alignment=2)
    ep.shutdown()
    return {"errors": problems, "ranks": num_ranks}


def test_across_processes():
    results = launch_ok(HERE, "multi_process_pairs", 2, args=[23], devices_per_process=2)
    for r in results:
        assert r["ranks"] == 4
        assert r["errors"] == []
