"""The proxy runtime alone: commands/s through a ring, commands/s through a device's rings with the transport,
and write bandwidth per libfabric provider and message size between 2 processes.

1. ring: `_uccl_ep_testing.ring_commands_per_second` (one producer, one consumer thread, 32-byte commands, no
   transport).
2. transport commands: 2 processes, UCCL_EP_NUM_PROXY_THREADS=--channels rings per device, tiny writes
   (UCCL_EP_MAX_WRITE_BYTES=--cmd-write-bytes), so each message of --cmd-message-bytes is many commands. Both
   ranks post rounds of --cmd-window messages on every channel to each other and wait for the peer's; the rate is
   the delta of stats()['commands'] (commands the device's proxies popped and posted) over the wall time.
3. write bandwidth: per provider and message size, the two ranks exchange one message each way, then a 0-byte
   ack each way (as tests/test_transport.py does). time/iter is one such round trip; GB/s is bytes received per
   rank per round trip / time (one direction; both directions carry the same at once).

CPU figures are informational: 2 cores are shared by both processes, their proxy threads and the Python driver.

    python bench/proxy.py                   # defaults: well under 2 minutes on a 2-core machine
    python bench/proxy.py --sizes 4K,1M,8M --providers shm --cmd-seconds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HEADERS = ["measure", "provider", "size", "time/iter", "rate", "note"]


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * scale)


def size_name(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------------------------------------------
# Children (2 processes)
# ------------------------------------------------------------------------------------------------------------


def _start(env: dict) -> tuple:
    import jax_uccl_ep as ep
    from jax_uccl_ep import _uccl_ep_testing as testing

    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    ep.initialize()
    me = ep._runtime.local_ranks()[0]
    return ep, testing, me


def _exchange(testing, me: int, peer: int, nbytes: int, channel: int = 0) -> None:
    """One message each way, then a 0-byte ack each way."""
    testing.post_message(me, channel, peer, testing.send_offset(me, peer), testing.recv_offset(me, me), nbytes)
    testing.wait_message(me, channel, peer)
    testing.post_message(me, channel, peer, 0, 0, 0)
    testing.wait_message(me, channel, peer)


def commands_child(cfg: dict) -> dict:
    """Many small writes through every ring of the device; returns commands/s of this device's proxies."""
    ep, testing, me = _start(
        {
            "UCCL_EP_FI_PROVIDER": cfg["provider"],
            "UCCL_EP_NUM_PROXY_THREADS": cfg["channels"],
            "UCCL_EP_MAX_WRITE_BYTES": cfg["write_bytes"],
            "UCCL_EP_BUFFER_BYTES": max(16 << 20, 4 * cfg["message_bytes"] + (1 << 20)),
            "UCCL_EP_REORDER": "0",
        }
    )
    peer = 1 - me
    channels = testing.num_channels(me)
    size, window = cfg["message_bytes"], cfg["window"]
    send, recv = testing.send_offset(me, peer), testing.recv_offset(me, me)
    _exchange(testing, me, peer, size)  # warm up and line the ranks up
    testing.quiet(me)
    c0, t0 = testing.stats(me)["commands"], time.perf_counter()
    rounds = 0
    # Both ranks run the same number of rounds (decided by rank 0's clock would need a message; a fixed count
    # measured from a first timed round keeps them equal without one).
    while True:
        for _ in range(window):
            for c in range(channels):
                testing.post_message(me, c, peer, send, recv, size)
        for _ in range(window):
            for c in range(channels):
                testing.wait_message(me, c, peer)
        rounds += 1
        if rounds == 1:
            per_round = time.perf_counter() - t0
            total_rounds = max(2, int(cfg["seconds"] / max(per_round, 1e-6)))
            total_rounds = min(total_rounds, cfg["max_rounds"])
            # Agree on the larger count: exchange it through the buffer's scratch space is overkill; use the
            # jax.distributed key-value store instead.
            total_rounds = _agree_max(f"proxy_bench/rounds/{cfg['tag']}", me, total_rounds)
        if rounds >= total_rounds:
            break
    testing.quiet(me)
    seconds = time.perf_counter() - t0
    commands = testing.stats(me)["commands"] - c0
    stats = testing.stats(me)
    ep.shutdown()
    return {
        "commands": commands,
        "seconds": seconds,
        "rate": commands / seconds,
        "channels": channels,
        "rounds": rounds,
        "provider": cfg["provider"],
        "stats": stats,
    }


def _agree_max(key: str, me: int, value: int) -> int:
    from jax._src import distributed

    client = distributed.global_state.client
    client.key_value_set(f"{key}/{me}", str(value))
    return max(int(client.blocking_key_value_get(f"{key}/{r}", 60_000)) for r in (0, 1))


def bandwidth_child(cfg: dict) -> dict:
    """Ping-pong exchanges per message size over one provider; returns seconds per exchange per size."""
    sizes = cfg["sizes"]
    env = {
        "UCCL_EP_FI_PROVIDER": cfg["provider"],
        "UCCL_EP_NUM_PROXY_THREADS": cfg["channels"],
        "UCCL_EP_BUFFER_BYTES": 4 * max(sizes) + (1 << 20) + 4 * 4096,
        "UCCL_EP_REORDER": "0",
        "UCCL_EP_MAX_WRITE_BYTES": cfg["write_bytes"],
    }
    ep, testing, me = _start(env)
    peer = 1 - me
    provider = testing.provider(me)
    out = []
    for size in sizes:
        iters = int(min(cfg["max_iters"], max(cfg["min_iters"], cfg["bytes_per_repeat"] // size)))
        iters = _agree_max(f"proxy_bench/iters/{cfg['tag']}/{size}", me, iters)
        for _ in range(max(2, iters // 10)):
            _exchange(testing, me, peer, size)
        times = []
        for _ in range(cfg["repeats"]):
            t0 = time.perf_counter()
            for _ in range(iters):
                _exchange(testing, me, peer, size)
            times.append((time.perf_counter() - t0) / iters)
        out.append(
            {
                "size": size,
                "iters": iters,
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
            }
        )
    ep.shutdown()
    return {"provider": provider, "results": out}


def child(cfg: dict) -> dict:
    """Runs every transport measurement in one pair of processes (one jax.distributed start)."""
    out = {}
    if cfg["commands"]:
        out["commands"] = commands_child(cfg["commands"])
    out["bandwidth"] = []
    for provider in cfg["providers"]:
        bw = dict(cfg["bandwidth"], provider=provider, tag=f"bw/{provider}")
        try:
            out["bandwidth"].append(bandwidth_child(bw))
        except Exception as e:  # one provider missing must not lose the others
            import jax_uccl_ep as ep

            ep.shutdown()
            out["bandwidth"].append({"provider": provider, "error": common.short_error(e, 300)})
    return out


# ------------------------------------------------------------------------------------------------------------
# Parent
# ------------------------------------------------------------------------------------------------------------


def ring_rows(capacities: list[int], count: int, repeats: int) -> tuple[list[list[str]], list[dict]]:
    from jax_uccl_ep import _uccl_ep_testing as testing

    rows, record = [], []
    for cap in capacities:
        rates = []
        for _ in range(repeats):
            r = testing.ring_commands_per_second(cap, count)
            if r["out_of_order"] or r["received"] != count:
                raise RuntimeError(f"ring_commands_per_second({cap}, {count}) lost or reordered commands: {r}")
            rates.append(r["commands_per_second"])
        rate = statistics.median(rates)
        rows.append(
            [
                "ring: commands/s",
                "-",
                f"{cap} slots",
                common.fmt_time(1 / rate),
                f"{rate / 1e6:.2f} M cmd/s",
                f"{count} 32-byte commands, 1 producer + 1 consumer, median of {repeats}",
            ]
        )
        record.append({"capacity": cap, "count": count, "rates": rates})
    return rows, record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ring-capacities", default="1024,4096")
    ap.add_argument("--ring-count", type=int, default=2_000_000, help="commands per ring measurement")
    ap.add_argument("--ring-repeats", type=int, default=3)
    ap.add_argument("--channels", type=int, default=2, help="proxy threads (rings) per device for the command test")
    ap.add_argument("--cmd-provider", default="shm")
    ap.add_argument("--cmd-write-bytes", type=int, default=64, help="UCCL_EP_MAX_WRITE_BYTES for the command test")
    ap.add_argument("--cmd-message-bytes", default="64K", help="bytes per message (message = writes + a fence)")
    ap.add_argument("--cmd-window", type=int, default=8, help="messages per channel posted before waiting")
    ap.add_argument("--cmd-seconds", type=float, default=4.0)
    ap.add_argument("--providers", default="shm,tcp;ofi_rxm", help="comma-separated libfabric providers")
    ap.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,8M")
    ap.add_argument("--write-bytes", type=int, default=1 << 20, help="UCCL_EP_MAX_WRITE_BYTES for the bandwidth test")
    ap.add_argument("--bw-channels", type=int, default=1)
    ap.add_argument("--bytes-per-repeat", default="32M", help="bytes per timed repeat and size (bounds iterations)")
    ap.add_argument("--min-iters", type=int, default=10)
    ap.add_argument("--max-iters", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: ring, commands, bandwidth")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    header = common.run_header("CPU")
    print(f"# {header['date']}  {header['command']}  (load average {header['load_avg_1m']})", flush=True)
    rows, record = [], {"header": header}
    if "ring" not in skip:
        r, record["ring"] = ring_rows(
            [int(c) for c in args.ring_capacities.split(",")], args.ring_count, args.ring_repeats
        )
        rows += r

    providers = [p for p in args.providers.split(",") if p] if "bandwidth" not in skip else []
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    cfg = {
        "commands": None
        if "commands" in skip
        else {
            "provider": args.cmd_provider,
            "channels": args.channels,
            "write_bytes": args.cmd_write_bytes,
            "message_bytes": parse_size(args.cmd_message_bytes),
            "window": args.cmd_window,
            "seconds": args.cmd_seconds,
            "max_rounds": 1_000_000,
            "tag": "cmd",
        },
        "providers": providers,
        "bandwidth": {
            "sizes": sizes,
            "channels": args.bw_channels,
            "write_bytes": args.write_bytes,
            "bytes_per_repeat": parse_size(args.bytes_per_repeat),
            "min_iters": args.min_iters,
            "max_iters": args.max_iters,
            "repeats": args.repeats,
        },
    }
    if cfg["commands"] or providers:
        t0 = time.perf_counter()
        outs = common.spawn(__file__, "child", 2, args=[cfg], timeout_s=args.timeout)
        print(f"# 2-process part: {time.perf_counter() - t0:.1f} s wall", flush=True)
        record["ranks"] = outs
        if cfg["commands"]:
            cm = [o["commands"] for o in outs]
            rate = statistics.mean(c["rate"] for c in cm)
            c = cfg["commands"]
            writes = -(-c["message_bytes"] // c["write_bytes"])
            rows.append(
                [
                    f"transport: commands/s, {cm[0]['channels']} rings",
                    cm[0]["provider"],
                    f"{c['write_bytes']} B writes",
                    common.fmt_time(1 / rate),
                    f"{rate / 1e6:.3f} M cmd/s",
                    f"per device (mean of 2); {size_name(c['message_bytes'])} "
                    f"messages = {writes} writes + fence; {sum(x['commands'] for x in cm)} cmds in "
                    f"{max(x['seconds'] for x in cm):.1f} s",
                ]
            )
        for i, provider in enumerate(providers):
            per_rank = [o["bandwidth"][i] for o in outs]
            err = next((p["error"] for p in per_rank if "error" in p), None)
            if err:
                rows.append(["write ping-pong", provider, "-", "n/a", "n/a", f"n/a ({err[:80]})"])
                continue
            for j, size in enumerate(sizes):
                t = max(p["results"][j]["median_s"] for p in per_rank)
                iters = per_rank[0]["results"][j]["iters"]
                rows.append(
                    [
                        "write ping-pong",
                        per_rank[0]["provider"],
                        size_name(size),
                        common.fmt_time(t),
                        f"{size / t / 1e9:.3f} GB/s",
                        f"1 msg each way + ack; {iters} iters x {args.repeats}",
                    ]
                )
    if args.json:
        common.write_json(args.json, record)
    print()
    common.print_table(
        HEADERS,
        rows,
        title="proxy runtime and transport (time/iter: per command for rates, per "
        "exchange for ping-pong; GB/s one direction per rank)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
