"""GPU (NVLink) normal mode against the same reference checks as the CPU tests. Skipped without NVIDIA GPUs.

Both process modes: one process driving every GPU (JAX's default) and one process per GPU.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from mp import count_gpus, describe, launch

HERE = os.path.abspath(__file__)


NUM_GPUS = count_gpus()
pytestmark = pytest.mark.skipif(NUM_GPUS < 2, reason="needs at least 2 NVIDIA GPUs")


def gpu_suite(part: str, error_checks: str = "1", gradients: str = "1") -> dict:
    """Child: the checks of one mode ("normal" or "low_latency") on a mesh of all GPUs of the job; with
    error_checks "0", only the reference checks (the NVLink runtime's kernel-found errors are left out); with
    gradients "0", no gradient check (its loss sums with an XLA collective, which NCCL refuses on a shared GPU)."""
    import cases
    import jax
    import jax.numpy as jnp
    import numpy as np
    import reference as ref

    import jax_uccl_ep as ep
    from jax_uccl_ep import _plan

    ep.initialize()
    mesh = cases.mesh_of(sorted(jax.devices(), key=lambda d: d.id))
    r = mesh.devices.size
    plan = ep.two_level()
    two_level = None if plan is None else [plan.num_nodes, plan.per_node, plan.nvlink, plan.across_gpu_initiated]
    # Kernel-found errors are raised where they happened: the process that drives rank 0 (both cases below).
    owns_rank0 = any(d.id == mesh.devices.flat[0].id for d in jax.local_devices())
    problems = {}
    if part == "low_latency":
        _low_latency_checks(mesh, problems)
        ep.check_errors()
        if error_checks == "1":
            _low_latency_error_checks(mesh, problems, owns_rank0)
        ep.shutdown()
        return {"problems": problems, "ranks": r, "two_level": two_level}
    shapes = [
        # tokens, hidden, topk, experts, dtype, empty rank
        (1, 128, 1, r, jnp.float32, None),
        (37, 256, 4, 4 * r, jnp.float32, None),
        (64, 512, 4, 8 * r, jnp.bfloat16, r - 1),
        (300, 7168, 8, 128 * r, jnp.bfloat16, None),
    ]
    for i, (t, h, k, e, dtype, empty) in enumerate(shapes):
        problems[f"case{i}"] = cases.check_case(mesh, 100 + i, t, h, k, e, dtype, empty_rank=empty)
        print(f"case{i}: {problems[f'case{i}']}", flush=True)
    problems["layout"] = cases.check_layout(mesh, 31, 50, 4, 8 * r)
    problems["fp8"] = cases.check_fp8(mesh, 7, 41, 256, 3, 4 * r)
    print(f"fp8: {problems['fp8']}", flush=True)
    if gradients == "1":
        problems["gradients"] = cases.check_gradients(mesh, 9, 24, 128, 3, 4 * r)
        print(f"gradients: {problems['gradients']}", flush=True)
    problems["drop"] = cases.check_drop(mesh, 12, 40, 256, 3, 4 * r, capacity=20)
    print(f"drop: {problems['drop']}", flush=True)
    problems["expert_layout"] = cases.check_expert_layout(mesh, 13, 40, 256, 4, 4 * r, jnp.bfloat16, alignment=8)
    # A few rows naming an expert twice: the NVLink writer's warps with such a row count their slots the general
    # way, the others by popcount, their slots interleaved in each expert's group.
    problems["expert_layout_repeats"] = cases.check_expert_layout(
        mesh, 16, 300, 256, 4, 4 * r, jnp.bfloat16, alignment=2, repeats=0.03
    )
    problems["expert_layout_drop"] = cases.check_expert_layout(mesh, 14, 30, 128, 3, 4 * r, jnp.float32, capacity=25)
    problems["expert_layout_fp8"] = cases.check_expert_layout(mesh, 15, 19, 256, 3, 4 * r, jnp.float32, fp8_pair=True)
    # Scale rows of 16 bytes: with bulk copies the receive writes these FP8 pairs too (8-byte ones: token rows).
    problems["expert_layout_fp8_wide"] = cases.check_expert_layout(
        mesh, 17, 23, 512, 3, 4 * r, jnp.float32, fp8_pair=True, alignment=4
    )
    # Several units of 512 received rows, every warp of a unit, and rows larger than a stage (float32 x 4608: a row
    # in segments): the paths of the NVLink writer the small cases leave out.
    problems["expert_layout_units"] = cases.check_expert_layout(
        mesh, 18, 600, 4608, 8, 16 * r, jnp.float32, alignment=4
    )
    # Top-12 (two chunks of the writer's 8-slot loads, the second partial) of bfloat16 rows of 2 KiB (8 a job).
    problems["expert_layout_topk12"] = cases.check_expert_layout(mesh, 19, 100, 1024, 12, 16 * r, jnp.bfloat16)
    if gradients == "1":
        problems["expert_gradients"] = cases.check_expert_gradients(mesh, 16, 12, 128, 3, 4 * r)
    print(f"expert layout: {[problems[k] for k in problems if k.startswith('expert')]}", flush=True)
    ep.check_errors()  # nothing pending so far (dropping on purpose is no error)
    # Which writer laid the pairs out: the receive (the *_pairs ops; on a GPU path where _plan.gpu_writes_pairs
    # allows) or XLA after token rows; gpu_writes_pairs: dispatch's own decision for the first expert-layout case
    # above (40 bf16 rows of 256 a rank, top-4 of 4 local experts, alignment 8, the never-dropping buffer).
    from jax_uccl_ep import _pairs, normal

    first_case = jax.ShapeDtypeStruct((40, 256), jnp.bfloat16)
    result = {
        "problems": problems,
        "ranks": r,
        "two_level": two_level,
        "receive_writes_pairs": _plan.receive_writes_pairs(),
        "gpu_writes_pairs": not _plan.receive_writes_pairs()
        and normal._receive_writes_pairs(
            first_case, False, 4, 4, 8, _pairs.never_dropping_pairs(r * 40, 4, 4, 8), r * 40
        ),
    }
    if error_checks == "0":
        ep.shutdown()
        return result

    # Capacity exceeded (overflow="error"): the kernel cannot fail its own call, and ops never raise it (that would
    # strand the peers); every member of the group that overflowed counts every member's rows, so check_errors()
    # names rank 0 in every process of that group: all of them, or under two-level routing those on rank 0's node.
    from jax_uccl_ep import _runtime

    node = ep.topology().node_of_rank
    in_group = plan is None or any(node[q] == node[0] for q in _runtime.local_ranks())
    x, _, idx, w = cases.random_case(5, r, 16, 128, 2, 2 * r, jnp.float32)
    idx[:] = -1
    idx[:, :, 0] = 0
    try:
        cases.roundtrip(mesh, x, idx, w, 2 * r, capacity=3)
        ep.check_errors()
        problems["capacity"] = ["no error for capacity 3"] if in_group else []
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        ok = in_group and f"rank 0 received {16 * r} tokens but capacity is 3" in msg
        problems["capacity"] = [] if ok else [msg[:300]]
    # The runtime keeps working afterwards.
    problems["after_capacity"] = cases.check_case(mesh, 77, 20, 256, 2, 2 * r, jnp.float32)

    # A bad expert index is reported by the same mechanism.
    idx2 = ref.random_routing(np.random.default_rng(3), r, 8, 2, 2 * r)
    idx2[0, 1, 0] = 99
    try:
        cases.roundtrip(mesh, x[:, :8], idx2, w[:, :8], 2 * r)
        ep.check_errors()
        problems["bad_index"] = ["no error for expert 99"] if owns_rank0 else []
    except Exception as exc:  # noqa: BLE001
        problems["bad_index"] = [] if owns_rank0 and "= 99 outside" in str(exc) else [str(exc)[:300]]
    # The layout (local, no peers) skips and reports a bad index the same way.
    try:
        jax.jit(
            jax.shard_map(
                lambda i: ep.get_dispatch_layout(i[0], num_experts=2 * r, axis_name="ep")[0][None],
                mesh=mesh,
                in_specs=cases.P("ep"),
                out_specs=cases.P("ep"),
            )
        )(cases.shard(mesh, idx2)).block_until_ready()
        ep.check_errors()
        problems["layout_bad_index"] = ["no error for expert 99 in the layout"] if owns_rank0 else []
    except Exception as exc:  # noqa: BLE001
        ok = owns_rank0 and "= 99 outside" in str(exc)
        problems["layout_bad_index"] = [] if ok else [str(exc)[:300]]
    ep.shutdown()
    return result  # `problems` in it has every check's findings


def _low_latency_checks(mesh, problems: dict) -> None:
    """Low-latency mode against the reference; padding rows are not written on GPUs."""
    import cases
    import jax.numpy as jnp

    r = mesh.devices.size
    ll_cases = [
        # tokens, N, hidden, topk, experts, options
        (5, 8, 128, 2, 4 * r, dict(use_fp8=False)),
        (13, 20, 512, 4, 16 * r, dict(round_scale=True)),
        (9, 9, 512, 2, 8 * r, dict(use_ue8m0=True)),
        (128, 128, 7168, 8, 128 * r, {}),
    ]
    for i, (t, n, h, k, e, kw) in enumerate(ll_cases):
        problems[f"ll{i}"] = cases.check_low_latency(mesh, 300 + i, t, n, h, k, e, zero_padding=False, **kw)
        print(f"ll{i}: {problems[f'll{i}']}", flush=True)
    problems["ll_split"] = cases.check_low_latency(mesh, 310, 40, 48, 1024, 4, 8 * r, split=True, zero_padding=False)
    print(f"ll_split: {problems['ll_split']}", flush=True)
    # The router weights carried by the dispatch: combine sums each token's rows on the experts' ranks.
    problems["ll_carried"] = cases.check_low_latency(
        mesh, 311, 128, 128, 7168, 8, 128 * r, zero_padding=False, carry_weights=True
    )
    problems["ll_carried_split"] = cases.check_low_latency(
        mesh, 312, 40, 48, 1024, 4, 8 * r, split=True, zero_padding=False, carry_weights=True, use_fp8=False
    )
    print(f"ll_carried: {problems['ll_carried']} {problems['ll_carried_split']}", flush=True)
    # The cast in the send kernel against per_token_cast_to_fp8: several tokens a block, an odd number of 128-channel
    # blocks, float32 input with power-of-two scales.
    problems["ll_cast"] = cases.check_low_latency_fp8_cast(mesh, 320, 200, 384, 8, 16 * r, nonfinite=True)
    problems["ll_cast_f32"] = cases.check_low_latency_fp8_cast(
        mesh, 321, 33, 7168, 4, 8 * r, dtype=jnp.float32, round_scale=True
    )
    print(f"ll_cast: {problems['ll_cast']} {problems['ll_cast_f32']}", flush=True)


def _low_latency_error_checks(mesh, problems: dict, owns_rank0: bool) -> None:
    """A token naming an expert in two slots: where it fits, a row a slot; where an expert gets more rows from a rank
    than it holds (max_tokens_per_rank), the sending rank's check_errors() names the expert and a repeating token
    (the host paths refuse the call on every rank), and the runtime keeps working."""
    import cases
    import reference as ref

    import jax_uccl_ep as ep

    r, n, e = mesh.devices.size, 6, 4 * mesh.devices.size
    rng = np.random.default_rng(330)
    x = rng.standard_normal((r, n, 128)).astype(np.float32)
    w = rng.random((r, n, 2)).astype(np.float32)
    idx = ref.random_routing(rng, r, n, 2, e)
    idx[0, 3, :] = 1
    out, count = cases.low_latency_round_trip(mesh, x, idx, w, e)
    ok = np.allclose(out, cases.low_latency_weighted_sum(x, idx, w), 1e-5, 1e-6)
    problems["ll_repeat_fits"] = [] if ok else ["sums"]
    if count[0, 1] != (idx == 1).sum():
        problems["ll_repeat_fits"].append(f"expert 1 got {count[0, 1]} rows, {(idx == 1).sum()} slots name it")
    past = idx.copy()
    past[past == 2] = -1
    past[0, :4, :] = 2  # rank 0 sends expert 2 8 rows; it holds 6 from a rank
    want = "expert 2 8 rows, more than max_tokens_per_rank=6 (a row per top-k slot; token 0 names it"
    try:
        cases.low_latency_round_trip(mesh, x, past, w, e)
        ep.check_errors()
        problems["ll_rows_past_n"] = ["no error for 8 rows of expert 2"] if owns_rank0 else []
    except Exception as exc:  # noqa: BLE001
        problems["ll_rows_past_n"] = [] if want in str(exc) else [str(exc)[:300]]
    ep.check_errors()
    x2, idx2, w2 = x[:, ::-1].copy(), ref.random_routing(rng, r, n, 2, e), rng.random((r, n, 2)).astype(np.float32)
    out2, _ = cases.low_latency_round_trip(mesh, x2, idx2, w2, e)
    ok = np.allclose(out2, cases.low_latency_weighted_sum(x2, idx2, w2), 1e-5, 1e-6)
    problems["ll_after_rows_past_n"] = [] if ok else ["sums after the error"]
    # A bad index given to combine alone (the dispatch had the good routing), in a later slot of a rank the token's
    # first slot names: with the weights carried that slot is no row's, and must still be named.
    good = ref.random_routing(rng, r, n, 2, e)
    good[0, 2] = [0, 1]  # both on rank 0
    bad = good.copy()
    bad[0, 2, 1] = 10 * e
    try:
        cases.low_latency_round_trip(mesh, x, good, w, e, combine_idx=bad, carry_weights=True)
        ep.check_errors()
        problems["ll_combine_bad_index"] = ["no error for a bad index given to combine"] if owns_rank0 else []
    except Exception as exc:  # noqa: BLE001
        named = re.search(rf"topk_idx\[2, 1\] = {10 * e} (is )?outside", str(exc))
        problems["ll_combine_bad_index"] = [] if named else [str(exc)[:300]]
    ep.check_errors()
    # Shapes whose combine kernels need more shared memory a block than the GPU gives (the carried weights' first
    # slots grow with ranks x max_tokens_per_rank) while the dispatch's fit: refused on every rank before anything
    # moves, and the next call right. Host-run paths have no such limit: there the results must be right.
    from jax_uccl_ep import _plan

    plan = _plan.current()
    gpu_kernels = plan.platform == "gpu" and (plan.nvlink or plan.gpu_initiated_low_latency)
    n_big = 80_000 // r
    xb = rng.standard_normal((r, n_big, 32)).astype(np.float32)
    ib = ref.random_routing(rng, r, n_big, 1, 2 * r)
    wb = rng.random((r, n_big, 1)).astype(np.float32)
    try:
        outb, _ = cases.low_latency_round_trip(mesh, xb, ib, wb, 2 * r, carry_weights=True)
        ep.check_errors()
        ok = np.allclose(outb, cases.low_latency_weighted_sum(xb, ib, wb), 1e-5, 1e-6)
        problems["ll_shared_memory"] = ["not refused"] if gpu_kernels else [] if ok else ["sums on a host path"]
    except Exception as exc:  # noqa: BLE001
        named = "low_latency_combine: these shapes need" in str(exc) and "ranks x max_tokens_per_rank" in str(exc)
        problems["ll_shared_memory"] = [] if named and gpu_kernels else [str(exc)[:300]]
    ep.check_errors()
    x2, idx2, w2 = x[:, ::-1].copy(), ref.random_routing(rng, r, n, 2, e), rng.random((r, n, 2)).astype(np.float32)
    out2, _ = cases.low_latency_round_trip(mesh, x2, idx2, w2, e, carry_weights=True)
    ok = np.allclose(out2, cases.low_latency_weighted_sum(x2, idx2, w2), 1e-5, 1e-6)
    problems["ll_after_refusals"] = [] if ok else ["sums after the refusals"]
    checks = ("ll_repeat_fits", "ll_rows_past_n", "ll_after_rows_past_n", "ll_combine_bad_index")
    checks += ("ll_shared_memory", "ll_after_refusals")
    print(f"ll errors: {[problems[k] for k in checks]}", flush=True)


def gpu_missing_peer(mode: str = "low_latency") -> dict:
    """Child: rank 1 never joins a dispatch (low-latency or normal mode); rank 0's kernel
    gives up after UCCL_EP_TIMEOUT_S and check_errors() names the missing rank."""
    import time

    import cases
    import jax
    import numpy as np
    from jax._src import distributed

    import jax_uccl_ep as ep

    ep.initialize()
    mesh = cases.mesh_of(sorted(jax.devices(), key=lambda d: d.id))
    client = distributed.global_state.client
    result = {"process": jax.process_index()}
    if jax.process_index() == 0:
        r = mesh.devices.size
        x = cases.shard(mesh, np.ones((r, 4, 128), np.float32))
        idx = cases.shard(mesh, np.zeros((r, 4, 1), np.int32) + r)  # every token to an expert of rank 1
        if mode == "low_latency":

            def body(x, i):
                return ep.low_latency_dispatch(
                    x[0], i[0], num_experts=2 * r, max_tokens_per_rank=4, axis_name="ep", use_fp8=False
                )[1][None]
        else:

            def body(x, i):
                return ep.dispatch(x[0], i[0], num_experts=2 * r, axis_name="ep").num_tokens[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=cases.P("ep"), out_specs=cases.P("ep")))
        start = time.monotonic()
        try:
            # Only this process runs the program (its own device's part): rank 1's part never starts.
            jax.block_until_ready(f(x, idx))
            ep.check_errors()
            result["error"] = None
        except Exception as exc:  # noqa: BLE001
            result["error"] = str(exc)
        result["seconds"] = time.monotonic() - start
        client.key_value_set("gpu_missing_peer/done", "1")
    else:
        client.blocking_key_value_get("gpu_missing_peer/done", 120_000)
    ep.shutdown()
    return result


def _check_missing_peer(results):
    """gpu_missing_peer's results: rank 0's dispatch gave up within a minute with an error naming rank 1."""
    assert all(x.ok for x in results), describe(results)
    first = next(x.result for x in results if x.result["process"] == 0)
    assert first["error"] and "did not arrive" in first["error"] and "from rank 1" in first["error"], first
    assert first["seconds"] < 60, first


def _check(results, num_ranks):
    assert all(x.ok for x in results), describe(results)
    for x in results:
        assert x.result["ranks"] == num_ranks
        assert {k: v for k, v in x.result["problems"].items() if v} == {}


# Waits on peers end after UCCL_EP_TIMEOUT_S (low-latency kernels); the launch limit bounds the rest.
SUITE_ENV = {"UCCL_EP_NVL_BUFFER_BYTES": str(256 << 20), "UCCL_EP_TIMEOUT_S": "30"}


@pytest.mark.parametrize("part", ["normal", "low_latency"])
def test_one_process_drives_all_gpus(part):
    """Every reference check over all GPUs from one process; there dispatch pulls, and the expert layout's cases that
    fit the NVLink pair writer (a pair buffer of every top-k slot, 16-byte rows and scale rows) have the receive write
    the pair buffer, the others token rows then XLA's layout."""
    results = launch(HERE, "gpu_suite", 1, args=[part], platform="gpu", timeout_s=150, env=SUITE_ENV)
    _check(results, NUM_GPUS)
    if part == "normal":
        assert results[0].result["gpu_writes_pairs"], results[0].result


@pytest.mark.parametrize("part", ["normal", "low_latency"])
def test_one_process_per_gpu(part):
    per_rank = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(NUM_GPUS)]
    results = launch(
        HERE, "gpu_suite", NUM_GPUS, args=[part], platform="gpu", per_rank_env=per_rank, timeout_s=150, env=SUITE_ENV
    )
    _check(results, NUM_GPUS)
    if part == "normal":  # the sent receive writes the pairs
        assert all(x.result["gpu_writes_pairs"] for x in results), describe(results)


SENT = {"UCCL_EP_NVL_PULL_DISPATCH": "0", "UCCL_EP_NVL_PULL_COMBINE": "0"}
NORMAL_VARIANTS = {
    "sent": SENT,
    "sent, 6 SMs": dict(SENT, UCCL_EP_NUM_SMS="6"),
    "6 SMs, SM stores": {"UCCL_EP_NUM_SMS": "6", "UCCL_EP_NVL_BULK": "0"},
    "pulled combine only": {"UCCL_EP_NVL_PULL_DISPATCH": "0"},
    "pulled dispatch only": {"UCCL_EP_NVL_PULL_COMBINE": "0"},
    "pulled, 6 SMs": {"UCCL_EP_NUM_SMS": "6"},
    "token rows, then XLA's pair layout": {"UCCL_EP_NVL_DISPATCH_PAIRS": "0"},
}


@pytest.mark.parametrize("variant", list(NORMAL_VARIANTS))
def test_normal_mode_variants(variant):
    """Normal mode's references beside the default (both ops pulled where one process drives every GPU, the full
    budget: test_one_process_drives_all_gpus): the sent ops (every member sending into the receivers' buffers), at
    the full budget and at 6 SMs (a message in 3 chunks, a send block each, and 3 receive blocks, each working
    through several (chunk, source) pieces); the SM-store kernels (always sent); each op pulled alone, between the
    other op's sent messages (message numbers, meta counts and acknowledgements must stay in step; the suite's FP8
    case with 8-byte scale rows is sent in every variant); both pulled at 6 SMs; and the expert layout from token
    rows and XLA's pair layout where the receive would write the pairs (as it does in every variant with bulk
    copies, the sent receive too)."""
    env = dict(SUITE_ENV, **NORMAL_VARIANTS[variant])
    results = launch(HERE, "gpu_suite", 1, args=["normal"], platform="gpu", timeout_s=150, env=env)
    _check(results, NUM_GPUS)
    # The receive writes the pairs wherever rows move by bulk copies, pulled or sent, unless turned off.
    writes = env.get("UCCL_EP_NVL_DISPATCH_PAIRS") != "0" and env.get("UCCL_EP_NVL_BULK") != "0"
    assert results[0].result["gpu_writes_pairs"] == writes, results[0].result


@pytest.mark.parametrize("reorder", ["0", "1"])
@pytest.mark.parametrize("part", ["normal", "low_latency"])
def test_gpus_as_separate_nodes_over_the_proxy(part, reorder):
    """UCCL_EP_GPUS_PER_NODE=1: every GPU its own node, so ops run on the proxy runtime (tcp) against the same
    references, with the proxies' reorder mode (writes posted out of order and late) off and on, GPU-initiated (the
    kernels push the proxies' commands). Normal mode's input errors (capacity, bad expert index) are left for
    check_errors(), as over NVLink."""
    per_rank = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(NUM_GPUS)]
    env = dict(SUITE_ENV, UCCL_EP_GPUS_PER_NODE="1", UCCL_EP_REORDER=reorder, UCCL_EP_BUFFER_BYTES=str(256 << 20))
    results = launch(
        HERE,
        "gpu_suite",
        NUM_GPUS,
        args=[part, "1" if part == "normal" else "0"],
        platform="gpu",
        per_rank_env=per_rank,
        timeout_s=150,
        env=env,
    )
    _check(results, NUM_GPUS)


@pytest.mark.parametrize("part", ["normal", "low_latency"])
def test_over_the_proxy_staged_through_the_host(part):
    """UCCL_EP_GPU_INITIATED=0: ops across nodes copy to the host and run the CPU implementation there (the path
    before GPU-initiated ops; still the one for jobs larger than those take: 8 ranks in normal mode, 32 in
    low-latency mode), against the same references."""
    per_rank = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(NUM_GPUS)]
    env = dict(
        SUITE_ENV,
        UCCL_EP_GPUS_PER_NODE="1",
        UCCL_EP_REORDER="1",
        UCCL_EP_GPU_INITIATED="0",
        UCCL_EP_BUFFER_BYTES=str(256 << 20),
    )
    results = launch(
        HERE, "gpu_suite", NUM_GPUS, args=[part, "0"], platform="gpu", per_rank_env=per_rank, timeout_s=150, env=env
    )
    _check(results, NUM_GPUS)


@pytest.mark.parametrize("reorder", ["0", "1"])
def test_two_level_routing_over_nvlink_and_the_proxies(reorder):
    """Two nodes of G GPUs on this machine (two processes per GPU, UCCL_EP_GPUS_PER_NODE=G): normal mode routes in
    two levels, across the nodes GPU-initiated through the proxies (tcp), within each node over NVLink between its
    GPUs; the reference checks in two-level row order and the kernel-found errors, with the proxies' reorder mode
    off and on. Results go through the key-value store (NCCL refuses two ranks on one GPU)."""
    g = min(NUM_GPUS, 4)
    per_rank = [
        {"CUDA_VISIBLE_DEVICES": str(i % g), "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "UCCL_EP_TEST_KV_GATHER": "1"}
        for i in range(2 * g)
    ]
    env = dict(SUITE_ENV, UCCL_EP_GPUS_PER_NODE=str(g), UCCL_EP_REORDER=reorder, UCCL_EP_BUFFER_BYTES=str(256 << 20))
    results = launch(
        HERE,
        "gpu_suite",
        2 * g,
        args=["normal", "1", "0"],
        platform="gpu",
        per_rank_env=per_rank,
        timeout_s=300,
        env=env,
    )
    _check(results, 2 * g)
    assert all(x.result["two_level"] == [2, g, True, True] for x in results), describe(results)


def gpu_ep_within_nodes() -> dict:
    """Child (GPUs on two nodes of two, UCCL_EP_GPUS_PER_NODE=2): a (dp=2, ep=2) mesh whose EP groups are the nodes.
    Their ops run over the node's NVLink runtime: rows and combine against the reference, and the proxies post
    nothing meanwhile."""
    import cases
    import jax
    import reference as ref
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_uccl_ep as ep
    from jax_uccl_ep import _runtime, _uccl_ep_testing

    ep.initialize()
    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh = Mesh(np.array(devices).reshape(2, 2), ("dp", "ep"))
    r, t, h, k, e = 4, 24, 256, 2, 8
    rng = np.random.default_rng(51)
    idx = np.concatenate([ref.random_routing(rng, 2, t, k, e) for _ in range(2)])
    x = rng.standard_normal((r, t, h)).astype(np.float32)
    spec = P(("dp", "ep"))

    def body(x, i):
        res = ep.dispatch(x[0], i[0], num_experts=e, axis_name="ep")
        return res.x[None], res.num_tokens[None], ep.combine(res.x * 2, res.handle)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    args = [jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i, a=a: a[i]) for a in (x, idx)]
    jax.block_until_ready(f(*args))
    posted = lambda: sum(_uccl_ep_testing.stats(q)["bytes_posted"] for q in _runtime.local_ranks())  # noqa: E731
    before = posted()
    recv, n, combined = (cases.gather(a) for a in f(*args))
    problems = []
    if posted() != before:
        problems.append(f"the proxies posted {posted() - before} bytes for ops within nodes")
    for group in (0, 1):
        members = [2 * group, 2 * group + 1]
        expected = ref.dispatch(x[members], idx[members], None, e)
        for j, want in enumerate(expected):
            m = want["num_tokens"]
            if n[members[j]] != m or not np.array_equal(recv[members[j], :m], want["x"]):
                problems.append(f"rank {members[j]}: received rows differ")
        want_c = ref.combine([2 * w["x"] for w in expected], expected, t)
        if not np.allclose(combined[members], want_c, rtol=1e-6, atol=1e-5):
            problems.append(f"group {group}: combine differs")
    ep.check_errors()
    ep.shutdown()
    return {"problems": problems}


def gpu_proxy_bad_index() -> dict:
    """Child (each GPU its own node: GPU-initiated low-latency ops): expert 99 in rank 0's routing. The op itself
    does not fail (its peers stay in step), check_errors() names the slot in rank 0's process only, and a reference
    check right after passes."""
    import cases
    import jax
    import reference as ref

    import jax_uccl_ep as ep
    from jax_uccl_ep import _ffi

    ep.initialize()
    mesh = cases.mesh_of(sorted(jax.devices(), key=lambda d: d.id))
    r = mesh.devices.size
    rank = _ffi.global_ranks()[jax.local_devices()[0].id]
    idx = ref.random_routing(np.random.default_rng(3), r, 8, 2, 4 * r).astype(np.int32)
    idx[0, 1, 0] = 99
    x = np.random.default_rng(4).standard_normal((r, 8, 128)).astype(np.float32)

    def body(x, i):
        return ep.low_latency_dispatch(
            x[0], i[0], num_experts=4 * r, max_tokens_per_rank=8, axis_name="ep", use_fp8=False
        )[1][None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=cases.P("ep"), out_specs=cases.P("ep")))
    error = None
    try:
        jax.block_until_ready(f(cases.shard(mesh, x), cases.shard(mesh, idx)))
        ep.check_errors()
    except Exception as exc:  # noqa: BLE001
        error = str(exc)
    after = cases.check_low_latency(mesh, 330, 9, 9, 256, 2, 4 * r, zero_padding=False, use_fp8=False)
    ep.check_errors()
    ep.shutdown()
    return {"rank": rank, "error": error, "after": after}


def test_bad_expert_index_over_the_proxy_is_named_by_check_errors():
    per_rank = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(NUM_GPUS)]
    env = dict(SUITE_ENV, UCCL_EP_GPUS_PER_NODE="1", UCCL_EP_BUFFER_BYTES=str(64 << 20))
    results = launch(
        HERE, "gpu_proxy_bad_index", NUM_GPUS, platform="gpu", per_rank_env=per_rank, timeout_s=150, env=env
    )
    assert all(x.ok for x in results), describe(results)
    for x in results:
        res = x.result
        assert res["after"] == [], res
        if res["rank"] == 0:
            assert res["error"] and "= 99 outside" in res["error"] and "rank 0" in res["error"], res
        else:
            assert res["error"] is None, res


@pytest.mark.parametrize("part", ["normal", "low_latency"])
def test_one_process_drives_gpus_on_separate_nodes(part):
    """UCCL_EP_GPUS_PER_NODE=1 with one process for all GPUs (a multi-host job with a process per host): the staged
    ops of one GPU wait for their peers without holding up the process's other GPUs."""
    env = dict(SUITE_ENV, UCCL_EP_GPUS_PER_NODE="1", UCCL_EP_BUFFER_BYTES=str(256 << 20))
    results = launch(
        HERE, "gpu_suite", 1, args=[part, "1" if part == "normal" else "0"], platform="gpu", timeout_s=150, env=env
    )
    _check(results, NUM_GPUS)


def gpu_proxy_put(nbytes: int) -> dict:
    """Child: every GPU its own node (proxy runtime); each sends its pair partner one message from a kernel (payload
    written by the GPU into the proxy's buffer, write and fence pushed into the proxy's ring, a device quiet, the
    partner's message awaited and checked on the GPU), twice, then 64 messages of 8 writes in a row; then a staged
    round trip still matches the reference
    (the host's protocol state stayed in step with what the kernels did)."""
    import cases
    import jax
    import jax.numpy as jnp

    import jax_uccl_ep as ep
    from jax_uccl_ep import _ffi, _uccl_ep_testing

    ep.initialize()
    mesh = cases.mesh_of(sorted(jax.devices(), key=lambda d: d.id))
    rank = _ffi.global_ranks()[jax.local_devices()[0].id]
    puts = [_uccl_ep_testing.proxy_gpu_put(rank, rank ^ 1, nbytes, 0) for _ in range(2)]
    # A stream: 64 messages of 8 writes each, back to back in the ring (the last one's payload is checked).
    puts.append(_uccl_ep_testing.proxy_gpu_put(rank, rank ^ 1, nbytes, 0, messages=64, writes=8))
    words = _uccl_ep_testing.published_words(rank)
    problems = {"after": cases.check_case(mesh, 7, 16, 256, 2, 4 * mesh.devices.size, jnp.float32)}
    ep.shutdown()
    return {"puts": puts, "words": words, "problems": problems, "ranks": mesh.devices.size}


def test_gpu_kernel_sends_through_the_proxy_and_waits_on_its_words():
    per_rank = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(NUM_GPUS - NUM_GPUS % 2)]
    env = dict(SUITE_ENV, UCCL_EP_GPUS_PER_NODE="1", UCCL_EP_BUFFER_BYTES=str(64 << 20))
    results = launch(
        HERE,
        "gpu_proxy_put",
        len(per_rank),
        args=[65536],
        platform="gpu",
        per_rank_env=per_rank,
        timeout_s=120,
        env=env,
    )
    _check(results, len(per_rank))
    for x in results:
        for put in x.result["puts"]:
            assert put["timed_out"] == 0 and put["mismatched_words"] == 0, put
            assert 0 < put["push_us"] <= put["quiet_us"] <= put["arrival_us"], put
        words = x.result["words"]
        assert words["retired"][0] == words["pushed"][0], words  # every command the kernels pushed completed
        print(f"rank {x.rank}: {x.result['puts']}")


@pytest.mark.parametrize("mode", ["low_latency", "normal", "low_latency over the proxy", "normal over the proxy"])
def test_missing_peer_is_named_within_the_deadline(mode):
    """Over NVLink, and GPU-initiated over the proxy (each GPU its own node): rank 0's receive kernel gives up on
    rank 1's message and the error names rank 1."""
    per_rank = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(2)]
    env = {"UCCL_EP_TIMEOUT_S": "5", "UCCL_EP_NVL_BUFFER_BYTES": str(64 << 20)}
    if mode.endswith("over the proxy"):
        env.update(UCCL_EP_GPUS_PER_NODE="1", UCCL_EP_BUFFER_BYTES=str(32 << 20))
    results = launch(
        HERE,
        "gpu_missing_peer",
        2,
        args=[mode.split()[0]],
        platform="gpu",
        per_rank_env=per_rank,
        timeout_s=200,
        env=env,
    )
    _check_missing_peer(results)


def gpu_soak(steps: int) -> dict:
    """Child: `steps` rounds of normal and low-latency round trips in one jitted loop, fresh random routing each
    round (some slots masked), checked on the GPUs against experts that scale by a factor of their own and random
    router weights."""
    import cases
    import jax
    import jax.numpy as jnp

    import jax_uccl_ep as ep

    ep.initialize()
    mesh = cases.mesh_of(sorted(jax.devices(), key=lambda d: d.id))
    r = mesh.devices.size
    t, h, k, e = 256, 512, 4, 8 * r

    def body(x):
        rank = jax.lax.axis_index("ep")

        def step(i, worst):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(7), i), rank)
            idx = jnp.argsort(jax.random.uniform(key, (t, e)), axis=-1)[:, :k].astype(jnp.int32)
            idx = jnp.where(jax.random.uniform(jax.random.fold_in(key, 1), (t, k)) < 0.1, -1, idx)
            xi = x[0] * (1.0 + (i % 7).astype(jnp.float32))
            valid = idx >= 0
            w = jax.random.uniform(jax.random.fold_in(key, 2), (t, k), minval=0.5, maxval=1.5)
            # Experts that tell each other apart: expert g multiplies by its own factor, so a row that reached the
            # wrong expert, or a weight that went with the wrong slot, changes the sum.
            factor = 1.0 + (jnp.arange(e) % 5).astype(jnp.float32) * 0.25
            want = xi * jnp.sum(jnp.where(valid, w * factor[jnp.maximum(idx, 0)], 0.0), -1, keepdims=True)
            # Normal mode: each received row times the weighted factors of its local slots, summed back.
            res = ep.dispatch(xi, idx, w, num_experts=e, axis_name="ep")
            mine = res.topk_idx >= 0
            expert = jnp.where(mine, res.topk_idx + rank * (e // r), 0)
            coef = jnp.sum(jnp.where(mine, res.topk_weights * factor[expert], 0.0), -1)
            out = ep.combine(res.x * coef[:, None], res.handle)
            err_normal = jnp.max(jnp.abs(out - want))
            # Low-latency mode: each local expert's rows times its factor, combined with the router weights.
            recv, count, handle = ep.low_latency_dispatch(
                xi, idx, num_experts=e, max_tokens_per_rank=t, axis_name="ep", use_fp8=False
            )
            local = jax.lax.dynamic_slice_in_dim(factor, rank * (e // r), e // r)
            out_ll = ep.low_latency_combine(recv * local[:, None, None], idx, w, handle)
            err_ll = jnp.max(jnp.abs(out_ll - want))
            # Nothing lost or duplicated: rows received everywhere = valid slots sent everywhere.
            lost = jnp.abs(jax.lax.psum(count.sum(), "ep") - jax.lax.psum(valid.sum(), "ep")).astype(jnp.float32)
            return jnp.maximum(worst, jnp.stack([err_normal, err_ll, lost]))

        worst = jnp.zeros(3, jnp.float32) + 0 * x[0, 0, :3]  # varies over "ep", as the loop's result does
        return jax.lax.fori_loop(0, steps, step, worst)[None]

    x = cases.shard(mesh, np.random.default_rng(0).standard_normal((r, t, h)).astype(np.float32))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=cases.P("ep"), out_specs=cases.P("ep")))
    import time

    start = time.monotonic()
    worst = cases.gather(f(x)).max(0)
    seconds = time.monotonic() - start
    ep.check_errors()
    ep.shutdown()
    return {"normal": float(worst[0]), "low_latency": float(worst[1]), "lost": float(worst[2]), "seconds": seconds}


@pytest.mark.parametrize("link", ["nvlink", "over the proxy"])
def test_soak_round_trips_stay_exact(link):
    """Over NVLink, and GPU-initiated over the proxy (each GPU its own node; fewer rounds: every op there waits
    for its kernels and the messages cross tcp): normal and low-latency ops interleaved stay in step."""
    env = dict(SUITE_ENV, **({"UCCL_EP_GPUS_PER_NODE": "1"} if link == "over the proxy" else {}))
    results = launch(
        HERE, "gpu_soak", 1, args=[2000 if link == "nvlink" else 400], platform="gpu", timeout_s=300, env=env
    )
    assert all(x.ok for x in results), describe(results)
    res = results[0].result
    print(res)
    # x * (1..7) times at most 4 slots of weight <= 1.5 and factor <= 2, in float32: a few ulps of ~5 * 7 * 12.
    assert res["normal"] < 2e-3 and res["low_latency"] < 2e-3 and res["lost"] == 0, res


@pytest.mark.parametrize("variant", ["UCCL_EP_LL_FUSED=0"])
def test_low_latency_variants(variant):
    """The non-default low-latency path (send and receive as two launches) against the same reference."""
    name, value = variant.split("=")
    results = launch(
        HERE, "gpu_suite", 1, args=["low_latency"], platform="gpu", timeout_s=150, env=dict(SUITE_ENV, **{name: value})
    )
    _check(results, NUM_GPUS)


def gpu_loopback_over_nvlink() -> list:
    """Child: the loopback bench's ranks spread over two GPUs (rank r on GPU r % 2), at 24 SMs with bulk copies,
    sent: BF16 and FP8, two ranks and four, the stamped call with the sides apart and without."""
    from jax_uccl_ep import Config, _runtime, _uccl_ep_testing

    _runtime.configure_native(Config(num_sms=24, nvl_bulk=True, nvl_pull_dispatch=False, nvl_pull_combine=False))
    out = []
    for ranks, fp8, apart in [(2, False, False), (2, True, True), (4, False, True), (4, True, False)]:
        r = dict(
            _uccl_ep_testing.nvl_loopback_bench(0, 1500, 7168, 8, 64, fp8, 2, 31 + len(out), ranks, False, apart, 2)
        )
        out.append(dict(r, ranks=ranks, fp8=fp8, apart=apart))
    return out


def test_the_loopback_runs_its_ranks_over_nvlink():
    """bench/loopback.py --gpus 2: every row, scale row, expert count and (BF16) sum arrives with the ranks on two
    GPUs; with the sides apart the receive side starts once the send side is done, and the spans are stamped by
    both GPUs' kernels, each also on its own clock."""
    results = launch(
        HERE,
        "gpu_loopback_over_nvlink",
        1,
        platform="gpu",
        timeout_s=300,
        env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    )
    assert all(x.ok for x in results), describe(results)
    for r in results[0].result:
        print(r["ranks"], r["fp8"], r["apart"], r["dispatch_us"], r["spans_us"])
        assert r["mismatched_rows"] == 0 and r["mismatched_expert_counts"] == 0, r
        assert r["mismatched_combine_rows"] == 0, r
        assert 0 < r["remote_rows"] < r["received_rows"], r
        send_start, send_len = r["spans_us"]["dispatch:dispatch_send"]
        receive_start, receive_len = r["spans_us"]["dispatch:dispatch_receive"]
        assert send_len > 0 and receive_len > 0, r
        # Each GPU stamps its own %globaltimer, and two GPUs' timers need not agree: on a 4-GPU H200 host they
        # stood ~3.3 ms apart (an 80 us send side stamped as 3349 us), on 2 H100s ~120 us (206 us for an 84 us
        # call). With the sides apart the send side is a part of the call: a side longer than the whole call
        # measured on the host says the stamps do not share a clock, and the order cannot be read from them.
        # A rank's receive side waits for the other ranks' rows, not its own: the first one to start comes after
        # every send side of some other GPU has ended, so after the earliest send start plus the shortest GPU's send
        # length (a duration, read on that GPU's own clock). Its own GPU's sends may still run.
        one_clock = send_len <= 1.25 * r["dispatch_us"]
        if r["apart"] and one_clock:
            shortest_send = min(own["dispatch:dispatch_send"][1] for own in r["gpu_spans_us"])
            assert receive_start >= send_start + shortest_send - 5.0, (shortest_send, r)
        elif r["apart"]:
            print(f"ranks {r['ranks']}: the GPUs' timers disagree (send span {send_len:.0f} us); order not checked")
        # Each GPU's own spans read one clock: its send side within the call, and its receive blocks wait for the
        # routing, scan it, then copy (the earliest of each phase in that order).
        assert len(r["gpu_spans_us"]) == 2, r
        for own in r["gpu_spans_us"]:
            routing, scan = own["dispatch:routing"], own["dispatch:scan"]
            receive, send = own["dispatch:dispatch_receive"], own["dispatch:dispatch_send"]
            assert 0 < send[1] <= 2 * r["dispatch_us"] + 20, (own, r["dispatch_us"])
            assert routing[0] <= scan[0] + 0.5 and scan[0] <= receive[0] + 0.5, own


def test_the_copy_bench_pushes_and_pulls_between_two_gpus():
    """bench/copies.py --gpus 2: GPU 0 and GPU 1 each push into the other's memory, or pull out of it, at once; the
    bench checks every block's span against the source GPU's pattern (a copy read from or written to the wrong GPU
    raises), and NVLink carries more than 50 GB/s each way with 12 SMs."""
    from test_proxy_gpu import HERE as PROXY_GPU

    results = launch(PROXY_GPU, "gpu_copies", 1, args=[2], platform="gpu", timeout_s=180)
    assert all(x.ok for x in results), describe(results)
    r = results[0].result
    assert all(v > 50 for v in r["figures"].values()), r
