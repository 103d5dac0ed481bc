"""The GPU -> proxy command path on one GPU: warps push commands into host rings (kernels/nvl/ring_producer.cuh),
host threads pop them as proxy threads do; and the GPU-initiated ops across nodes with two processes sharing that
GPU, each its own node. Skipped without an NVIDIA GPU."""

from __future__ import annotations

import os
import time

import pytest
from mp import describe, detect_gpus, launch
from test_gpu import NUM_GPUS, SUITE_ENV, _check, _check_missing_peer

HERE = os.path.abspath(__file__)
pytestmark = pytest.mark.skipif(NUM_GPUS < 1, reason="needs an NVIDIA GPU")


def _on_one_gpu(file: str, function: str, n: int, *, args=(), timeout_s=240, kv_gather=True, **env):
    """Runs `function` of tests/`file` in `n` processes that all drive the first GPU this process may use, with the
    suite's settings and `env` on top. kv_gather: results gathered through jax.distributed's key-value store (NCCL
    refuses two ranks on one GPU)."""
    shared = {"CUDA_VISIBLE_DEVICES": detect_gpus()[0], "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if kv_gather:
        shared["UCCL_EP_TEST_KV_GATHER"] = "1"
    return launch(
        os.path.join(os.path.dirname(HERE), file),
        function,
        n,
        args=list(args),
        platform="gpu",
        per_rank_env=[shared] * n,
        timeout_s=timeout_s,
        env={**SUITE_ENV, "UCCL_EP_TIMEOUT_S": "60", **env},
    )


def _suite_across_nodes(
    part: str, n: int = 2, per_node: int = 1, *, error_checks: bool = False, timeout_s: int = 200, **env
):
    """tests/test_gpu.py's suite `part` in `n` processes sharing one GPU, `per_node` a node (UCCL_EP_GPUS_PER_NODE;
    more than one: two-level routing), with or without its error checks and without its gradient check (an XLA
    collective, which NCCL refuses on a shared GPU); `env` on top. Checked, and returned for more checks."""
    results = _on_one_gpu(
        "test_gpu.py",
        "gpu_suite",
        n,
        args=[part, "1" if error_checks else "0", "0"],
        timeout_s=timeout_s,
        UCCL_EP_GPUS_PER_NODE=str(per_node),
        UCCL_EP_BUFFER_BYTES=str(256 << 20),
        **env,
    )
    _check(results, n)
    return results


def gpu_sized_proxy_buffer(num_ranks: str) -> dict:
    """Child: GPU-initiated ops across nodes on a proxy buffer of proxy_buffer_bytes(shapes), every slot of every
    rank on the last rank's experts (the largest message there is): normal mode (BF16 with weights) and low latency
    (BF16, the weights carried or not) against the reference; then on a quarter of it, where the first op is refused
    naming a buffer no larger."""
    import re

    import cases
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_uccl_ep as ep

    r = int(num_ranks)  # sized before initialize(), which must come before JAX starts its backend
    t, n, h, k, e = 512, 128, 2048, 2, 8 * r
    sized = ep.proxy_buffer_bytes(
        t,
        h,
        num_ranks=r,
        topk=k,
        ranks_per_node=1,
        low_latency_max_tokens=n,
        num_experts=e,
        low_latency_fp8=False,
        platform="gpu",
    )
    ep.initialize(proxy_buffer_bytes=sized)
    mesh = cases.mesh_of(sorted(jax.devices(), key=lambda d: d.id))
    last = np.tile(np.arange(e - k, e, dtype=np.int32), (r, t, 1))
    problems = {
        "normal": cases.check_case(mesh, 40, t, h, k, e, jnp.bfloat16, routing=last),
        "low_latency": cases.check_low_latency(
            mesh, 41, n, n, h, k, e, zero_padding=False, use_fp8=False, routing=last[:, :n]
        ),
        "low_latency_carried": cases.check_low_latency(
            mesh, 42, n, n, h, k, e, zero_padding=False, carry_weights=True, use_fp8=False, routing=last[:, :n]
        ),
    }
    ep.check_errors()
    ep.shutdown()
    ep.initialize(proxy_buffer_bytes=sized // 4)
    refusal = ""
    try:
        cases.check_case(mesh, 43, t, h, k, e, jnp.bfloat16, routing=last)
    except Exception as exc:  # noqa: BLE001 - any refusal; its text is checked
        refusal = str(exc)
    advised = re.search(r"raise UCCL_EP_BUFFER_BYTES to at least (\d+)", refusal)
    if not advised or int(advised.group(1)) > sized:
        problems["refusal"] = [f"a quarter of {sized} bytes: {refusal or 'ran'}"]
    ep.shutdown()
    return {"problems": problems, "sized": sized, "ranks": r}


def test_a_proxy_buffer_sized_by_the_shapes_holds_the_gpu_initiated_ops():
    """Two processes on one GPU, each its own node: proxy_buffer_bytes(shapes, platform="gpu") holds the
    GPU-initiated ops' largest messages (every slot on one rank's experts), and a quarter of it is refused by
    the first op, naming a size no larger."""
    results = _on_one_gpu("test_proxy_gpu.py", "gpu_sized_proxy_buffer", 2, args=["2"], UCCL_EP_GPUS_PER_NODE="1")
    _check(results, 2)


def gpu_initialize_with_shapes(num_ranks: str, per_node: str, tokens: str) -> dict:
    """Child: initialize(shapes=...) on processes sharing the GPU, per_node a node: the buffers it started are those
    the sizing helpers give for this job (one node: NVLink and low latency; two: the proxy's, and each node's
    NVLink buffer for its nodes' tokens), and the worst routing (every slot on the last rank's experts) runs on them
    against the reference, low latency too where the job is one node (`tokens` 0: low latency alone)."""
    import cases
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_uccl_ep as ep

    r, p, t = int(num_ranks), int(per_node), int(tokens)
    n, h, k, e = 64, 2048, 2, 8 * r
    one_node = p == r
    ll = dict(low_latency_max_tokens=n, low_latency_fp8=False) if one_node else {}
    ep.initialize(shapes=ep.JobShapes(t, h, k, num_experts=e, **ll))
    problems: dict = {}
    if one_node:
        ll_bytes = ep.low_latency_buffer_bytes(n, h, num_ranks=r, num_experts=e, topk=k, fp8=False)
        want = (ep.nvl_buffer_bytes(max(t, 1), h, num_ranks=r, topk=k), ll_bytes)
    else:
        want = (ep.nvl_buffer_bytes(r // p * t, h, num_ranks=p, topk=k), 0)
        proxy = ep.proxy_buffer_bytes(t, h, num_ranks=r, topk=k, num_experts=e, ranks_per_node=p, platform="gpu")
        problems["proxy buffer"] = (
            [] if ep.config().buffer_bytes == proxy else [f"{ep.config().buffer_bytes} != {proxy}"]
        )
    held = ep.buffer_bytes_held()
    problems["buffers held"] = [] if set(held.values()) == {want} else [f"{held} != {want}"]
    mesh = cases.mesh_of(sorted(jax.devices(), key=lambda d: d.id))
    last = np.tile(np.arange(e - k, e, dtype=np.int32), (r, max(t, n), 1))
    if t:
        problems["normal"] = cases.check_case(mesh, 50, t, h, k, e, jnp.bfloat16, routing=last[:, :t])
    if one_node:
        problems["low_latency"] = cases.check_low_latency(
            mesh, 51, n, n, h, k, e, zero_padding=False, use_fp8=False, routing=last[:, :n]
        )
    ep.check_errors()
    ep.shutdown()
    return {"problems": problems, "ranks": r}


@pytest.mark.parametrize("ranks,per_node,tokens", [(2, 2, 256), (2, 2, 0), (4, 2, 256)])
def test_initialize_sizes_the_gpu_buffers_from_the_shapes(ranks, per_node, tokens):
    """initialize(shapes=...) with processes sharing one GPU, as one node (NVLink and low-latency buffers; also a
    job of low-latency ops alone) and as two nodes of two (the proxy's buffer and each node's NVLink buffer under
    two-level routing): each buffer is what the sizing helpers give for this job, and the worst routing runs on
    them against the reference."""
    results = _on_one_gpu(
        "test_proxy_gpu.py",
        "gpu_initialize_with_shapes",
        ranks,
        args=[str(ranks), str(per_node), str(tokens)],
        timeout_s=300,
        UCCL_EP_GPUS_PER_NODE=str(per_node),
        UCCL_EP_NVL_BUFFER_BYTES="",  # the suite's setting would win over the shapes
    )
    _check(results, ranks)


def gpu_ring(commands: int, rounds: int) -> dict:
    """Child: GPU warps push numbered commands into host rings; then the ping-pong and one-way rounds."""
    from jax_uccl_ep import _uccl_ep_testing

    return dict(_uccl_ep_testing.nvl_ring_bench(0, 4, commands, 1024, rounds))


def test_gpu_pushes_every_command_through_the_rings_in_order():
    results = launch(
        HERE, "gpu_ring", 1, args=[300_000, 1000], platform="gpu", timeout_s=120, env={"UCCL_EP_TIMEOUT_S": "30"}
    )
    assert all(x.ok for x in results), describe(results)
    res = results[0].result
    print(res)
    assert res["commands"] == 4 * 300_000 and res["out_of_order"] == 0, res
    assert 0 < res["round_trip_median_ns"] < 1e6, res
    # One way, on the host's clock: the command is seen after the clock value it carries was read (upper > 0),
    # and the lower bound (upper less a GPU read of host memory) is part of a round trip, which it cannot exceed
    # (1 us of slack: the round trip is timed on the GPU's global timer, which may tick in microseconds).
    upper, read = res["one_way_upper_median_ns"], res["host_read_round_trip_ns"]
    assert 0 < upper <= res["one_way_upper_p99_ns"] < 1e6, res
    assert 100 < read < 1e5, res  # a read across PCIe takes more than 100 ns: less means it was not timed
    assert upper - read < res["round_trip_median_ns"] + 1000, res


@pytest.mark.parametrize("reorder", ["0", "1"])
@pytest.mark.parametrize("part", ["normal", "low_latency"])
def test_gpu_initiated_ops_across_nodes_on_one_shared_gpu(part, reorder):
    """Two processes on one GPU, each its own node (UCCL_EP_GPUS_PER_NODE=1): the kernels push the proxies'
    commands and the proxies move the rows over tcp, against the same references as tests/test_gpu.py, with the
    proxies' reorder mode off and on. Results are gathered through jax.distributed's key-value store
    (UCCL_EP_TEST_KV_GATHER): NCCL refuses two ranks on one GPU. The processes' kernels take turns on the GPU, so
    every wait on a peer spans the GPU's time slices: slower, the same protocol."""
    _suite_across_nodes(part, UCCL_EP_REORDER=reorder)


@pytest.mark.parametrize("writer", ["1", "0"])
def test_gpu_initiated_dispatch_writes_the_pairs_across_nodes_on_one_shared_gpu(writer):
    """As above, normal mode: dispatch(layout="expert")'s receive lays the pairs out and copies each row from the
    receive region straight into its slots (the default), or with UCCL_EP_PROXY_DISPATCH_PAIRS=0 returns token rows
    that XLA lays out; the suite's expert-layout cases (units of 512 rows, repeated experts, FP8 pairs, top-12)
    against the NumPy reference, each run asserting which of the two wrote the pairs."""
    results = _suite_across_nodes("normal", UCCL_EP_PROXY_DISPATCH_PAIRS=writer)
    assert all(x.result["gpu_writes_pairs"] == (writer == "1") for x in results), describe(results)


@pytest.mark.parametrize("part", ["normal", "low_latency"])
def test_host_staged_ops_across_nodes_on_one_shared_gpu(part):
    """UCCL_EP_GPU_INITIATED=0 on two processes sharing one GPU, each its own node: each op copies to the host and
    runs the CPU implementation there, normal mode's expert layout written by the receive (the pair ops'
    host-staged handlers) included, against the same references as tests/test_gpu.py (no gradients: their loss
    sums with an XLA collective, which NCCL refuses on a shared GPU)."""
    results = _suite_across_nodes(part, UCCL_EP_GPU_INITIATED="0")
    if part == "normal":
        assert all(x.result["receive_writes_pairs"] for x in results), describe(results)


@pytest.mark.parametrize("part,reorder", [("normal", "0"), ("normal", "1"), ("low_latency", "0")])
def test_two_level_routing_on_one_shared_gpu(part, reorder):
    """Four processes on one GPU as two nodes of two (UCCL_EP_GPUS_PER_NODE=2): normal mode routes in two levels,
    across nodes GPU-initiated through the proxies (tcp), within each node over the node's NVLink runtime (CUDA
    IPC between the processes, here on one GPU); the reference checks in two-level row order, then the kernel-found
    errors (capacity at the node level, a bad expert index at the level across nodes) from check_errors().
    Low-latency mode, flat through the proxies, runs beside the node-level runtime."""
    results = _suite_across_nodes(part, 4, 2, error_checks=True, timeout_s=300, UCCL_EP_REORDER=reorder)
    assert all(x.result["two_level"] == [2, 2, True, True] for x in results), describe(results)


def test_ep_within_nodes_runs_over_the_node_runtime_on_one_shared_gpu():
    """Four processes on one GPU as two nodes of two, EP over each node (a (dp, ep) mesh): the ops take the node's
    NVLink runtime (CUDA IPC here), not the proxies, and match the reference."""
    results = _on_one_gpu(
        "test_gpu.py",
        "gpu_ep_within_nodes",
        4,
        timeout_s=200,
        UCCL_EP_GPUS_PER_NODE="2",
        UCCL_EP_BUFFER_BYTES=str(64 << 20),
    )
    assert all(x.ok for x in results), describe(results)
    assert all(x.result["problems"] == [] for x in results), describe(results)


@pytest.mark.parametrize("part", ["normal", "low_latency"])
def test_nvlink_path_between_two_processes_on_one_gpu(part):
    """Two processes on one GPU as one node: the NVLink runtime's path (CUDA IPC between the processes), each op
    lowered to Path.NVLINK, the layout included (the sent receive writing the pairs), then the kernel-found errors
    from check_errors()."""
    results = _on_one_gpu("test_gpu.py", "gpu_suite", 2, args=[part, "1", "0"], UCCL_EP_NVL_BUFFER_BYTES=str(256 << 20))
    _check(results, 2)
    if part == "normal":
        assert all(x.result["gpu_writes_pairs"] for x in results), describe(results)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_missing_peer_is_named_within_the_deadline_on_one_shared_gpu(mode):
    """Two processes on one GPU as one node, the second never joining a dispatch: the first's kernel (normal mode:
    its receive blocks' wait for the routing, its send blocks' joining, the handovers) gives up after
    UCCL_EP_TIMEOUT_S and the error names rank 1, instead of a hang."""
    results = _on_one_gpu(
        "test_gpu.py",
        "gpu_missing_peer",
        2,
        args=[mode],
        timeout_s=200,
        UCCL_EP_TIMEOUT_S="5",
        UCCL_EP_NVL_BUFFER_BYTES=str(64 << 20),
    )
    _check_missing_peer(results)


@pytest.mark.parametrize("case", ["0", "1", "sized"])
def test_moe_layer_on_one_shared_gpu(case):
    """The package's MoE layer (jax_uccl_ep.layers) on two processes sharing one GPU (the NVLink path): output
    and gradients against the dense reference, BF16 and FP8 dispatch, and BF16 with the load-sized pair buffer."""
    args = [case == "1", 1.0 if case == "sized" else None]
    results = _on_one_gpu("test_moe_layer.py", "layer_parity_child", 2, args=args, kv_gather=False)
    assert all(x.ok for x in results), describe(results)
    assert all(x.result["problems"] == [] for x in results), describe(results)


def gpu_loopback(cases: list, pull: bool = False) -> list:
    """Child: normal mode's NVLink kernels between ranks on GPU 0 (nvl_loopback_bench), per case; with `pull`,
    dispatch and combine pull (the ranks are GPUs of one process)."""
    from jax_uccl_ep import Config, _runtime, _uccl_ep_testing

    out = []
    for budget, send, bulk, tokens, hidden, topk, experts, fp8, ranks, one_way in cases:
        _runtime.configure_native(
            Config(
                num_sms=budget,
                num_send_sms=send,
                nvl_bulk=bulk == "1",
                nvl_pull_dispatch=pull,
                nvl_pull_combine=pull,
            )
        )
        r = dict(
            _uccl_ep_testing.nvl_loopback_bench(0, tokens, hidden, topk, experts, fp8, 3, 11 + len(out), ranks, one_way)
        )
        out.append(
            dict(
                r,
                send_blocks=_uccl_ep_testing.nvl_send_blocks(),
                case=[budget, send, bulk, tokens, hidden, topk, experts, fp8, ranks, one_way],
            )
        )
    return out


def test_normal_mode_kernels_move_every_row_between_two_ranks_on_one_gpu():
    """Both ways of moving rows (bulk copies, SM stores) at several SM budgets and shapes: rows that fit a stage,
    rows cut into segments (hidden 20480 in BF16 is 40 KiB), FP8 rows with scales, token counts that split unevenly
    into chunks and pieces (and fewer tokens than chunks), a chunk per send block down to a budget of 2,
    send/receive splits other than the default (a half with bulk copies, a third with SM stores), 4 and 8 ranks
    sharing the GPU (every member's copy of a token in one combine stage; items with gaps), routing scans of 1, 2, 4
    and 8 tokens per thread, one way (members that send us no rows at all), and small rows that share a send job
    (hidden 2048 and 4096, several ranks). Every row of the last dispatch (with its FP8 scales) is compared with the
    sender's input, every local expert's row count with the routing, and every combined sum with x times the token's
    copies (host-side)."""
    cases = [
        (budget, send, bulk, tokens, hidden, 8, 64, fp8, ranks, one_way)
        for budget, send, tokens, hidden, ranks, one_way in [
            (2, 0, 301, 256, 2, False),
            (24, 0, 7, 256, 2, False),  # 12 chunks of 7 tokens: empty chunks still announce their routing
            (6, 0, 1000, 7168, 2, False),
            (24, 0, 4096, 7168, 2, False),
            (12, 0, 777, 20480, 2, False),
            (24, 16, 2000, 7168, 2, False),
            (24, 3, 2000, 7168, 2, False),
            (24, 0, 2000, 7168, 4, False),
            (16, 0, 4096, 7168, 4, False),  # 8 receive blocks, 4 sources: 4 tokens per thread
            (12, 0, 1000, 7168, 8, False),
            (24, 0, 2000, 7168, 4, True),
            # Small rows, several consecutive tokens a send job (2 to 4 where they fit a stage), token counts that
            # leave a partial last group: 2 KiB FP8 / 4 KiB BF16 rows over 8 members, 4 KiB FP8 / 8 KiB BF16 over 4.
            (12, 0, 1001, 2048, 8, False),
            (24, 0, 2003, 4096, 4, False),
        ]
        for bulk in ("1", "0")
        for fp8 in (False, True)
    ]
    for r in _loopback_results(cases):
        print(r)
        budget, send, bulk = r["case"][:3]
        assert r["bulk"] == (bulk == "1") and r["num_sms"] == budget, r
        assert r["send_blocks"] == (send or max(1, budget // (2 if bulk == "1" else 3))), r
        _assert_every_row_moved(r)


def _loopback_results(cases: list, pull: bool = False) -> list:
    """gpu_loopback's result of each case, in one child process on GPU 0."""
    results = launch(
        HERE,
        "gpu_loopback",
        1,
        args=[cases, pull],
        platform="gpu",
        timeout_s=300,
        env={"UCCL_EP_TIMEOUT_S": "30", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    )
    assert all(x.ok for x in results), describe(results)
    return results[0].result


def _assert_every_row_moved(r: dict) -> None:
    """A loopback case's host-side checks: every row, expert count and combined sum right, rows from other ranks
    among them, and both ops timed (combine does not run with FP8)."""
    assert r["mismatched_rows"] == 0 and r["mismatched_expert_counts"] == 0 and r["mismatched_combine_rows"] == 0, r
    assert r["remote_rows"] > 0 and r["received_rows"] > r["remote_rows"], r
    assert r["dispatch_us"] > 0 and (r["case"][7] or r["combine_us"] > 0), r


def test_pulled_dispatch_and_combine_move_every_row_between_ranks_on_one_gpu():
    """Dispatch and combine by pulls (UCCL_EP_NVL_PULL_DISPATCH=1, UCCL_EP_NVL_PULL_COMBINE=1) between ranks that one
    process drives on GPU 0: each receiver scans the members' routing and loads their rows where they are. The same
    host-side checks as the sent kernels' test (every row and FP8 scale row against the sender's input, every local
    expert's count, every combined sum), over budgets down to 6 SMs, rows in segments, 2 to 8 ranks, members that
    send us nothing, and small rows; and no send side ran (the stamps name none). FP8 scale rows of 8 bytes (hidden
    256) are not 16-byte multiples, so that case keeps the sent dispatch, as every rank decides alike."""
    cases = [
        (budget, 0, "1", tokens, hidden, 8, 64, fp8, ranks, one_way)
        for budget, tokens, hidden, ranks, one_way in [
            (24, 7, 256, 2, False),
            (6, 1000, 7168, 2, False),
            (24, 4096, 7168, 2, False),
            (12, 777, 20480, 2, False),
            (16, 4096, 7168, 4, False),
            (12, 1000, 7168, 8, False),
            (24, 2000, 7168, 4, True),
            (12, 1001, 2048, 8, False),
        ]
        for fp8 in (False, True)
    ]
    for r in _loopback_results(cases, pull=True):
        print(r["case"], r["dispatch_us"], r["combine_us"], sorted(r["spans_us"]))
        hidden, fp8 = r["case"][4], r["case"][7]
        _assert_every_row_moved(r)
        if not (fp8 and hidden // 128 * 4 % 16 != 0):  # else sent, by SM stores (which stamp no sides)
            assert "dispatch:dispatch_send" not in r["spans_us"] and "dispatch:dispatch_receive" in r["spans_us"], r
        assert fp8 or ("combine:combine_send" not in r["spans_us"] and "combine:combine_receive" in r["spans_us"]), r


def gpu_sides_apart() -> list:
    """Child: two ranks on GPU 0 at 24 SMs with bulk copies, sent (a send side to hold apart), BF16 and FP8, the spans'
    call with and without the sides apart. 4096 tokens: the send spans (FP8 ~60 us) outlast the receive side's scan by
    tens of microseconds."""
    from jax_uccl_ep import Config, _runtime, _uccl_ep_testing

    _runtime.configure_native(Config(num_sms=24, nvl_bulk=True, nvl_pull_dispatch=False, nvl_pull_combine=False))
    return [
        dict(
            _uccl_ep_testing.nvl_loopback_bench(0, 4096, 7168, 8, 64, fp8, 2, 21, 2, False, apart), fp8=fp8, apart=apart
        )
        for fp8 in (False, True)
        for apart in (False, True)
    ]


def test_the_loopback_holds_the_receive_side_until_every_row_has_landed():
    """--sides-apart: dispatch's receive side starts copying only once the send side is done (its span starts at
    the send span's end, less the last announcement's few microseconds), where without it it starts well before
    the send side ends; the rows still all arrive."""
    results = launch(
        HERE, "gpu_sides_apart", 1, platform="gpu", timeout_s=300, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    )
    assert all(x.ok for x in results), describe(results)
    for r in results[0].result:
        send_start, send_len = r["spans_us"]["dispatch:dispatch_send"]
        receive_start, _ = r["spans_us"]["dispatch:dispatch_receive"]
        print(r["fp8"], r["apart"], send_start, send_len, receive_start)
        assert r["mismatched_rows"] == 0 and r["mismatched_expert_counts"] == 0, r
        if r["apart"]:
            assert receive_start >= send_start + send_len - 5.0, r
        else:
            assert receive_start < send_start + send_len - 10.0, r


def gpu_budget_past_the_gpu() -> dict:
    """Child: a normal-mode op with an SM budget larger than the GPU, then one with a budget that fits."""
    from jax_uccl_ep import Config, _runtime, _uccl_ep_testing

    _runtime.configure_native(Config(num_sms=4096))
    try:
        _uccl_ep_testing.nvl_loopback_bench(0, 300, 256, 4, 16, False, 1, 3)
        error = ""
    except ValueError as e:
        error = str(e)
    _runtime.configure_native(Config(num_sms=6))
    r = dict(_uccl_ep_testing.nvl_loopback_bench(0, 300, 256, 4, 16, False, 1, 3))
    return {"error": error, "mismatched_rows": r["mismatched_rows"], "received_rows": r["received_rows"]}


def gpu_blocks_never_all_resident(pull: bool) -> dict:
    """Child: one rank on GPU 0 with the budget check lifted and a budget of 400 blocks, dispatch sent or pulled: the
    scan's units of 96000 tokens (188 of 512 tokens, more than an H100's or H200's 132 SMs hold at once; a sent op's
    go to its 200 receive blocks, a pulled op's to blocks 0-187) reach blocks that cannot get an SM while the others
    wait for their handover."""
    from jax_uccl_ep import Config, _runtime, _uccl_ep_testing

    _runtime.configure_native(Config(num_sms=400, timeout_s=2, nvl_pull_dispatch=pull, nvl_pull_combine=pull))
    _uccl_ep_testing.nvl_allow_budget_past_the_gpu(True)
    start = time.monotonic()
    try:
        _uccl_ep_testing.nvl_loopback_bench(0, 96000, 128, 2, 16, False, 1, 5, 1)
        error = ""
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    finally:
        _uccl_ep_testing.nvl_allow_budget_past_the_gpu(False)
    return {"error": error, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("pull", [False, True], ids=["sent", "pulled"])
def test_an_op_whose_blocks_cannot_all_run_at_once_names_the_budget(pull):
    """An NVLink op's receive blocks hand the routing scan to each other, so the blocks holding scan units must all
    run at once. Where they cannot (here a budget past the GPU's SMs, let through by a testing hook; in use, other
    work holding SMs or a share of the GPU), the blocks that run give up after UCCL_EP_TIMEOUT_S and the error says
    why and what to lower, instead of a hang; sent and pulled alike."""
    results = launch(HERE, "gpu_blocks_never_all_resident", 1, args=[pull], platform="gpu", timeout_s=180)
    assert all(x.ok for x in results), describe(results)
    r = results[0].result
    assert r["error"].startswith("TimeoutError") and "never all ran at once" in r["error"], r
    assert "UCCL_EP_NUM_SMS" in r["error"] and r["seconds"] < 120, r


def test_an_sm_budget_past_the_gpu_is_refused_with_what_to_set():
    """An op's send and receive blocks run at once, one per SM: a budget past the GPU's SMs is refused before
    anything is sent, naming the setting and the most it may be; a budget that fits then works."""
    results = launch(HERE, "gpu_budget_past_the_gpu", 1, platform="gpu", timeout_s=120)
    assert all(x.ok for x in results), describe(results)
    r = results[0].result
    assert "UCCL_EP_NUM_SMS=4096" in r["error"] and "set UCCL_EP_NUM_SMS <=" in r["error"], r
    assert r["received_rows"] > 0 and r["mismatched_rows"] == 0, r


def gpu_copies(gpus: int) -> dict:
    """Child: the copy bench (bench/copies.py) in each direction, bulk copies and SM loads/stores, 16 MiB per GPU,
    with a stage size that leaves each block's span a partial stage short; then what it refuses before launching
    anything: a direction it does not know, and spans that bulk copies cannot address (not multiples of 16 bytes)."""
    from jax_uccl_ep import _uccl_ep_testing

    per_block = 16 * 2**20 // 12 // 16 * 16  # 336 bytes past the last whole stage of 7168
    figures = {
        (direction, warps): _uccl_ep_testing.nvl_copy_bench(0, 12, per_block, 7168, 3, 4, warps, direction, gpus)
        for direction in ("local", "push", "pull")
        for warps in (False, True)
    }
    errors = []
    for bad in [(2**20, "sideways"), (2**20 + 8, "local")]:
        try:
            _uccl_ep_testing.nvl_copy_bench(0, 4, bad[0], 7168, 3, 4, False, bad[1], 1)
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    return {"figures": {f"{d}:{w}": v for (d, w), v in figures.items()}, "errors": errors}


def test_the_copy_bench_moves_the_bytes_it_times():
    """bench/copies.py's kernel on one GPU: each direction and way of copying moves its source's bytes (the bench
    checks the head and tail of every block's span against the source's pattern and raises otherwise) at a rate
    an H100/H200 gives (more than 50 GB/s with 12 SMs); a direction it does not know, or a span bulk copies cannot
    address, is refused by name before anything runs (a misaligned bulk copy would break the process's CUDA
    context)."""
    results = launch(HERE, "gpu_copies", 1, args=[1], platform="gpu", timeout_s=180)
    assert all(x.ok for x in results), describe(results)
    r = results[0].result
    assert all(v > 50 for v in r["figures"].values()), r
    assert "local, push or pull, not sideways" in r["errors"][0], r
    assert "bytes_per_block (1048584)" in r["errors"][1] and "multiples of 16" in r["errors"][1], r
