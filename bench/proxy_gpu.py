"""GPU -> proxy command path: commands per second from GPU warps through the host rings, and the round trip.

Each of `--rings` warps owns a command ring in pinned, mapped host memory (proxy/ring.hpp) and pushes numbered
no-op commands with the device producer (kernels/nvl/ring_producer.cuh); one host thread per ring pops them as a
proxy thread would and checks each arrives once, in order. No transport: this is the ring path alone. The
round trip is a ping-pong through one ring: the warp pushes one command and waits until the host thread has seen
it (GPU clock). The one-way latency, push until the proxy thread sees the command, is timed on the host's clock
alone (GPU and host share no clock): a host thread keeps writing its clock into mapped memory, the warp reads it
and pushes a command carrying it at once, and the proxy thread subtracts it from its clock when it pops the
command. That is the push-to-proxy time plus the read's way back to the GPU: an upper bound; less a whole GPU read
of host memory (timed on the GPU) it is a lower bound.
Goal (issue 4): 20 M commands/s per GPU, under 2 us push to proxy.

With --transport, two processes (one GPU each, each GPU its own node: the proxy runtime over the network
provider) stream messages at each other from a kernel: a warp pushes each message's writes and its fence into
channel 0's ring and waits until the proxy has retired them all; commands/s through the transport is commands
over that time, for many small writes and for a few large ones.

    python bench/proxy_gpu.py [--rings 1,2,4,8] [--commands 2000000] [--capacity 4096] [--ping 20000]
    python bench/proxy_gpu.py --transport
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# (messages, writes per message, payload bytes per message) streamed with --transport.
TRANSPORT_CASES = [(256, 31, 31 * 64), (256, 31, 31 * 4096), (32, 8, 8 << 20)]


def transport_child(cases: list) -> dict:
    """Child (one GPU, its own node): a warm-up message, then each case's stream to the other rank."""
    import jax

    import jax_uccl_ep as ep
    from jax_uccl_ep import _ffi, _uccl_ep_testing

    ep.initialize()
    rank = _ffi.global_ranks()[jax.local_devices()[0].id]
    _uccl_ep_testing.proxy_gpu_put(rank, rank ^ 1, 4096, 0)  # connection warm-up
    results = [
        dict(
            _uccl_ep_testing.proxy_gpu_put(rank, rank ^ 1, nbytes, 0, messages=m, writes=w),
            messages=m,
            writes=w,
            bytes=nbytes,
        )
        for m, w, nbytes in cases
    ]
    provider = _uccl_ep_testing.provider(rank)
    ep.shutdown()
    return {"rank": rank, "provider": provider, "results": results}


def transport(args, common) -> int:
    env = {"UCCL_EP_GPUS_PER_NODE": "1", "UCCL_EP_BUFFER_BYTES": str(128 << 20)}
    outs = common.spawn(__file__, "transport_child", 2, args=[TRANSPORT_CASES], env=env, gpus=True, timeout_s=300)
    header = common.run_header("2 GPUs as separate nodes")
    rows = []
    for out in sorted(outs, key=lambda o: o["rank"]):
        for res in out["results"]:
            bad = res["timed_out"] or res["mismatched_words"]
            rows.append(
                [
                    out["rank"],
                    res["messages"],
                    res["writes"],
                    res["bytes"] // res["writes"],
                    res["commands"],
                    f"{res['commands'] / res['quiet_us']:.3f}",
                    f"{res['push_us']:.1f}",
                    f"{res['quiet_us']:.1f}",
                    f"{res['messages'] * res['bytes'] / res['quiet_us'] / 1e3:.2f}",
                    "FAILED" if bad else "ok",
                ]
            )
    print(f"# {header}")
    common.print_table(
        [
            "rank",
            "messages",
            "writes/msg",
            "bytes/write",
            "commands",
            "M cmd/s retired",
            "pushed us",
            "retired us",
            "GB/s",
            "check",
        ],
        rows,
        title=f"GPU -> proxy -> {outs[0]['provider']} -> peer, channel 0, both ranks at once",
    )
    if args.out:
        common.write_json(args.out, {"header": header, "results": outs})
    return 0 if not any(r[-1] != "ok" for r in rows) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rings", default="1,2,4,8", help="rings (producer warps and host threads) to try")
    ap.add_argument("--commands", type=int, default=2_000_000, help="commands per run, split over the rings")
    ap.add_argument("--capacity", type=int, default=4096, help="slots per ring (a power of two)")
    ap.add_argument("--ping", type=int, default=20_000, help="ping-pong rounds for the round trip")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--transport", action="store_true", help="through the proxies and the network provider")
    args = ap.parse_args(argv)

    import common

    from jax_uccl_ep import _uccl_ep_testing

    if args.transport:
        if not hasattr(_uccl_ep_testing, "nvl_ring_bench"):
            print("jax_uccl_ep was built without CUDA: nothing to measure")
            return 1
        return transport(args, common)

    if not hasattr(_uccl_ep_testing, "nvl_ring_bench"):
        print("jax_uccl_ep was built without CUDA: nothing to measure")
        return 1
    header = common.run_header(f"GPU {args.device}")
    rows, results = [], []
    for i, rings in enumerate(int(r) for r in args.rings.split(",")):
        per_ring = max(1, args.commands // rings)
        try:
            res = dict(
                _uccl_ep_testing.nvl_ring_bench(
                    args.device, rings, per_ring, args.capacity, args.ping if i == 0 else 0
                ),
                rings=rings,
            )
        except RuntimeError as exc:
            print(f"proxy_gpu: {exc}")
            return 1
        results.append(res)
        rows.append(
            [
                rings,
                res["commands"],
                f"{res['commands'] / res['seconds'] / 1e6:.1f}",
                f"{res['commands'] / res['push_seconds'] / 1e6:.1f}",
                res["out_of_order"],
                f"{res['round_trip_median_ns'] / 1e3:.2f} / {res['round_trip_p99_ns'] / 1e3:.2f}" if i == 0 else "",
            ]
        )
    print(f"# {header}")
    common.print_table(
        ["rings", "commands", "M cmd/s drained", "M cmd/s pushed", "out of order", "round trip us (median / p99)"],
        rows,
        title=f"GPU -> host command rings, capacity {args.capacity}, no transport",
    )
    one_way = results[0]
    if one_way.get("one_way_upper_median_ns"):
        upper, read = one_way["one_way_upper_median_ns"], one_way["host_read_round_trip_ns"]
        common.print_table(
            ["push -> proxy sees it, us", "median", "p99", "GPU read of host memory, us", "warp in push, us"],
            [
                [
                    "upper bound (host clock)",
                    f"{upper / 1e3:.2f}",
                    f"{one_way['one_way_upper_p99_ns'] / 1e3:.2f}",
                    f"{read / 1e3:.2f}",
                    f"{one_way['push_ns'] / 1e3:.2f}",
                ],
                ["lower bound (upper - read)", f"{max(0.0, upper - read) / 1e3:.2f}", "", "", ""],
            ],
            title=f"one way, {args.ping} rounds, one command each, idle ring and proxy",
        )
    if args.out:
        common.write_json(args.out, {"header": header, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
