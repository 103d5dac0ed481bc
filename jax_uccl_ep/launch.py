"""Start a multi-process JAX job on this host: ``python -m jax_uccl_ep.launch -n N script.py [args...]``.

Each of the N children runs ``python script.py args...`` with the environment that ``jax_uccl_ep.initialize()``
(and ``jax.distributed.initialize()``) read:

* ``JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>``, ``JAX_NUM_PROCESSES=N``, ``JAX_PROCESS_ID=i``;
* without GPUs (or with ``--platform cpu``): ``JAX_PLATFORMS=cpu`` and ``JAX_NUM_CPU_DEVICES=K``
  (``--devices-per-process K``, default 1);
* with GPUs: ``--gpus-per-process 1`` (the default) gives child i the i-th visible GPU through
  ``CUDA_VISIBLE_DEVICES``; ``--gpus-per-process all`` runs one process (N must be 1) that sees every GPU;
* ``FI_TCP_IFACE=lo`` unless already set (libfabric's tcp provider stays on loopback), ``PYTHONUNBUFFERED=1``.

Every output line of child i is printed as ``[rank i] line`` (stdout to stdout, stderr to stderr). Ctrl-C and
SIGTERM (and SIGHUP) are forwarded to every child's process group; the children then get ``--grace-period``
seconds plus a few more to exit before SIGKILL (a second Ctrl-C kills at once), and the launcher exits with
128 + the signal number. When a child fails, the others get ``--grace-period`` seconds to finish (or to report
their own error), then SIGTERM, then SIGKILL; the launcher exits with the first failing child's code (128 + signal
for a child killed by a signal). Each child runs in its own process group (in the launcher's session), and the
launcher kills the whole group when the child ends, so no process outlives the job; on Linux a child also dies if
the launcher itself is killed.

The launcher starts no JAX backend (that would take the GPUs' memory): GPUs are found with ``nvidia-smi -L`` or
``/dev/nvidia<N>``.

The same launcher from Python, which the tests and the benches use too: :func:`start` starts the N children with
the environment above (less the platform choice, which the caller makes), each in its own process group and dying
with the thread that started it; :func:`run` also waits for them, kills them all at a timeout and returns each
one's exit status and output. ``main()`` is the command line on top of :func:`start`.
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

_POLL_S = 0.05
_KILL_AFTER_TERM_S = 3.0
_JOIN_PIPES_S = 2.0  # a process outside the child's group may hold its pipes open: stop reading after this


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for the jax.distributed coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def detect_gpus() -> list[str]:
    """Identifiers of the NVIDIA GPUs this process may use, as CUDA_VISIBLE_DEVICES would name them.

    Honors an existing ``CUDA_VISIBLE_DEVICES``; otherwise counts ``nvidia-smi -L`` lines, falling back to the
    ``/dev/nvidia<N>`` device files. Returns an empty list on a machine without GPUs.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    count = 0
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=20).stdout
            count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            count = 0
    if count == 0 and os.path.isdir("/dev"):
        count = sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name))
    return [str(i) for i in range(count)]


def child_env(
    rank: int,
    num_processes: int,
    port: int,
    env: Mapping[str, str | None] | None = None,
    rank_env: Mapping[str, str | None] | None = None,
) -> dict[str, str]:
    """The environment child `rank` of `num_processes` gets: this process's, the jax.distributed coordinator at
    ``127.0.0.1:port`` (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``),
    ``PYTHONUNBUFFERED=1``, ``FI_TCP_IFACE=lo`` unless set, then `env` and `rank_env` on top (a value of None
    removes the variable)."""
    out = dict(os.environ)
    out.update(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(num_processes),
        JAX_PROCESS_ID=str(rank),
        PYTHONUNBUFFERED="1",
    )
    out.setdefault("FI_TCP_IFACE", "lo")  # every peer is on this host: libfabric's tcp provider stays on loopback
    for extra in (env, rank_env):
        for key, value in (extra or {}).items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = value
    return out


def _exit_code(returncode: int) -> int:
    """A shell-style exit status: a child killed by signal S (returncode -S) becomes 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


# Runs first in every child on Linux, then execs the command: asks the kernel to SIGKILL the child when the thread
# that started it ends. In the child, not in a preexec_fn: that makes subprocess fork() this process, which JAX
# warns can deadlock once its threads run (the tests launch from a process that uses JAX).
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # the launcher ended before that took effect
    os.kill(os.getpid(), signal.SIGKILL)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _dying_with_parent(command: Sequence[str]) -> list[str]:
    """`command`, run so that it dies with this process (Linux; elsewhere only the process groups are killed, on
    every normal exit of the launcher)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


class Child:
    """One started process: `rank`, `proc` (a Popen whose stdout and stderr are byte pipes), and `returncode` once
    it has exited (negative: killed by that signal)."""

    def __init__(self, rank: int, proc: subprocess.Popen) -> None:
        self.rank = rank
        self.proc = proc
        self.returncode: int | None = None

    def signal_group(self, sig: int) -> None:
        """Sends `sig` to the child's whole process group (it and anything it started)."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def poll(self) -> int | None:
        """The child's return code once it has exited (None while it runs); kills what it left in its group."""
        if self.returncode is not None:
            return self.returncode
        try:
            # Look without reaping, so the group id cannot be reused before its leftovers are killed.
            running = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:  # reaped already: it has exited
            running = False
        if running:
            return None
        self.signal_group(signal.SIGKILL)
        self.returncode = self.proc.wait()
        return self.returncode

    def kill(self) -> int:
        """Kills the child's process group (if it still runs) and returns its return code."""
        if self.returncode is None:
            self.signal_group(signal.SIGKILL)
            self.returncode = self.proc.wait()
        return self.returncode


def start(
    command: Sequence[str],
    num_processes: int,
    *,
    env: Mapping[str, str | None] | None = None,
    per_rank_env: Sequence[Mapping[str, str | None]] | None = None,
    cwd: str | None = None,
    port: int | None = None,
) -> list[Child]:
    """Starts `command` `num_processes` times, as the ranks of one jax.distributed job on this host.

    Child i's environment is :func:`child_env` (coordinator on `port`, a free one by default; `env`, then
    ``per_rank_env[i]`` on top). stdin is /dev/null; stdout and stderr are pipes the caller must read. Each child
    leads its own process group, in this process's session (signals to this process do not reach it), and on Linux
    gets SIGKILL when the thread that called start() ends: call it from a thread that outlives the children. If
    starting one fails, the ones already started are killed.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be at least 1, not {num_processes}")
    if per_rank_env is not None and len(per_rank_env) != num_processes:
        raise ValueError(f"per_rank_env has {len(per_rank_env)} entries for {num_processes} processes")
    port = free_port() if port is None else port
    children: list[Child] = []
    try:
        for rank in range(num_processes):
            proc = subprocess.Popen(
                _dying_with_parent(command),
                env=child_env(rank, num_processes, port, env, per_rank_env[rank] if per_rank_env else None),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                # Own process group (Ctrl-C reaches it only through the launcher) but the launcher's session: a
                # session of its own would put each rank in its own scheduler autogroup (Linux), and on a host
                # with fewer cores than proxy threads that starved one rank's proxies for seconds while another
                # rank's spun on its shm locks (docs/RELIABILITY.md, tests/stress/init_cycles.py).
                **({"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}),
            )
            children.append(Child(rank, proc))
    except BaseException:
        for child in children:
            child.kill()
        raise
    return children


@dataclass
class ChildResult:
    """How one child of :func:`run` ended."""

    rank: int
    returncode: int | None  # None: still running at the timeout, then killed
    stdout: str
    stderr: str
    seconds: float  # from the start of run() until it exited or was killed


def run(
    command: Sequence[str],
    num_processes: int,
    *,
    env: Mapping[str, str | None] | None = None,
    per_rank_env: Sequence[Mapping[str, str | None]] | None = None,
    cwd: str | None = None,
    timeout_s: float | None = None,
) -> list[ChildResult]:
    """Runs `command` in `num_processes` children (see :func:`start`) until all have exited; returns one
    :class:`ChildResult` per rank, in rank order.

    A child that fails does not stop the others. At `timeout_s` (None: no limit) every child still running is
    killed with its process group. Nothing the children started outlives the call, also when it raises.
    """
    began = time.monotonic()
    children = start(command, num_processes, env=env, per_rank_env=per_rank_env, cwd=cwd)
    captured: list[tuple[list[bytes], list[bytes]]] = []
    readers = []
    for child in children:
        out: list[bytes] = []
        err: list[bytes] = []
        captured.append((out, err))
        for stream, chunks in ((child.proc.stdout, out), (child.proc.stderr, err)):
            t = threading.Thread(target=_collect, args=(stream, chunks), daemon=True)
            t.start()
            readers.append(t)
    ended: list[float | None] = [None] * num_processes
    timed_out: set[int] = set()
    deadline = None if timeout_s is None else began + timeout_s
    try:
        while True:
            now = time.monotonic()
            for child in children:
                if ended[child.rank] is None and child.poll() is not None:
                    ended[child.rank] = now - began
            running = [c for c in children if c.returncode is None]
            if not running:
                break
            if deadline is not None and now >= deadline:
                for child in running:
                    child.kill()
                    timed_out.add(child.rank)
                    ended[child.rank] = time.monotonic() - began
                break
            time.sleep(_POLL_S)
    finally:
        for child in children:  # after an exception (Ctrl-C, say): kill whatever still runs
            child.kill()
        for t in readers:
            t.join(timeout=_JOIN_PIPES_S)
    seconds = [e if e is not None else time.monotonic() - began for e in ended]
    return [
        ChildResult(
            rank=child.rank,
            returncode=None if child.rank in timed_out else child.returncode,
            stdout=_decode(captured[child.rank][0]),
            stderr=_decode(captured[child.rank][1]),
            seconds=seconds[child.rank],
        )
        for child in children
    ]


def _collect(stream: io.BufferedIOBase, chunks: list[bytes]) -> None:
    """Reads `stream` to its end into `chunks` (so a child never blocks on a full pipe)."""
    with stream:
        chunks.extend(iter(functools.partial(stream.read1, 1 << 16), b""))


def _decode(chunks: list[bytes]) -> str:
    return b"".join(list(chunks)).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------------------------
# The command line
# ------------------------------------------------------------------------------------------------------------


# Lines the libraries print on every successful run, which a user reads as trouble: Gloo's (XLA's CPU
# collectives) report of each connection it made, which two of its threads may print into one another. --verbose
# shows them.
_INFORMATIONAL = re.compile(
    r"\[Gloo\] Rank \d+|\d+ is connected to \d+ peer ranks|Expected number of connected peer ranks is : \d+"
)


# On GPUs, each process's jax.distributed client logs its coordination watch being cancelled when the job shuts
# down as it should: a warning line, then a block of gRPC detail (these lines, at most, and a blank one).
_WATCH_CANCELLED = re.compile(r"WatchTasksAsync failed for task \d+: CANCELLED")
_WATCH_CANCELLED_DETAIL = re.compile(
    r"^\s*$|CoordinationService/WatchTasks|^:CANCELLED:CANCELLED|=== Source Location Trace: ===|rpc/grpc_util\.h:\d+"
)


def _pump(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock, verbose: bool = True) -> None:
    """Copies `stream` to `out` line by line, each line prefixed; without `verbose`, the informational lines
    above and the cancelled watch's block are left out."""
    detail_lines = 0  # lines of a cancelled watch's block still to leave out
    with stream:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if not verbose:
                if _INFORMATIONAL.search(line):
                    continue
                if _WATCH_CANCELLED.search(line):
                    detail_lines = 6
                    continue
                if detail_lines and _WATCH_CANCELLED_DETAIL.search(line):
                    detail_lines -= 1
                    continue
                detail_lines = 0
            with lock:
                out.write(f"{prefix}{line}\n")
                out.flush()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the launcher's flags; everything from the script path on belongs to the script."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_uccl_ep.launch",
        description="Run a JAX script in N local processes wired together with jax.distributed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""\
every child gets:
  JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>, JAX_NUM_PROCESSES=N, JAX_PROCESS_ID=<rank>
  PYTHONUNBUFFERED=1, FI_TCP_IFACE=lo (unless set), UCCL_EP_EXIT_ON_UNREAD_ERRORS=1 (unless set)
  CPU runs: JAX_PLATFORMS=cpu, JAX_NUM_CPU_DEVICES=<--devices-per-process>
  GPU runs: CUDA_VISIBLE_DEVICES=<its GPU> (--gpus-per-process 1)
jax_uccl_ep.initialize() (and jax.distributed.initialize()) read them. Output lines are prefixed [rank i]; the
exit status is the first failing rank's (128 + N for signal N), 0 if every rank succeeded.

examples:
  python -m jax_uccl_ep.launch -n 4 examples/train_moe.py --steps 50
  python -m jax_uccl_ep.launch -n 2 --devices-per-process 2 my_script.py    # 2 processes x 2 CPU devices
  python -m jax_uccl_ep.launch -n 1 --gpus-per-process all my_script.py     # one process, every GPU
""",
    )
    parser.add_argument("-n", "--num-processes", type=int, required=True, help="processes to start")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="K",
        help="CPU devices per process (JAX_NUM_CPU_DEVICES; default 1); CPU runs only",
    )
    parser.add_argument(
        "--gpus-per-process",
        choices=["1", "all"],
        default="1",
        help="one GPU per process (CUDA_VISIBLE_DEVICES), or every GPU in one process (-n 1); default 1",
    )
    parser.add_argument(
        "--platform",
        choices=["auto", "cpu", "gpu"],
        default="auto",
        help="auto (the default): GPUs when present, otherwise CPU processes",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds the other processes get to finish after one fails (and after Ctrl-C), before SIGTERM and "
        "then SIGKILL (default 5)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="also print the libraries' informational lines (Gloo's connections)"
    )
    parser.add_argument("script", nargs="?", help="Python script to run in every process")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script (optional)")
    args = parser.parse_args(argv)
    if args.script is None:
        parser.error("no script to run: python -m jax_uccl_ep.launch -n N script.py [script arguments]")
    if args.num_processes < 1:
        parser.error("-n must be at least 1")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        parser.error("--devices-per-process must be at least 1")
    if args.grace_period < 0:
        parser.error("--grace-period must be >= 0")
    return args


def _choose_platform(args: argparse.Namespace) -> tuple[bool, list[str]]:
    """(use GPUs?, visible GPU ids); raises SystemExit with a message on an impossible request."""
    gpus = [] if args.platform == "cpu" else detect_gpus()
    if args.platform == "gpu" and not gpus:
        raise SystemExit("jax_uccl_ep.launch: --platform gpu but no GPU was found (nvidia-smi -L, /dev/nvidia*)")
    use_gpu = bool(gpus)
    if use_gpu:
        if args.devices_per_process is not None:
            raise SystemExit("jax_uccl_ep.launch: --devices-per-process is for CPU runs; add --platform cpu")
        if args.gpus_per_process == "all" and args.num_processes != 1:
            raise SystemExit("jax_uccl_ep.launch: --gpus-per-process all runs one process; use -n 1")
        if args.gpus_per_process == "1" and args.num_processes > len(gpus):
            raise SystemExit(
                f"jax_uccl_ep.launch: -n {args.num_processes} with one GPU per process, "
                f"but only {len(gpus)} GPU(s) are visible"
            )
    return use_gpu, gpus


def _platform_env(
    args: argparse.Namespace, use_gpu: bool, gpus: list[str]
) -> tuple[dict[str, str], list[dict[str, str]] | None]:
    """(environment of every child, environment per rank) for the platform chosen."""
    # A failed EP op whose result a script never read still fails the job (jax_uccl_ep's shutdown at exit).
    common = {"UCCL_EP_EXIT_ON_UNREAD_ERRORS": os.environ.get("UCCL_EP_EXIT_ON_UNREAD_ERRORS", "1")}
    if not use_gpu:
        common.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(args.devices_per_process or 1))
        return common, None
    if args.gpus_per_process == "1":
        return common, [{"CUDA_VISIBLE_DEVICES": gpus[rank]} for rank in range(args.num_processes)]
    return common, None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the job; returns 0 if every child succeeded, else the first failing child's exit status."""
    args = parse_args(argv)
    use_gpu, gpus = _choose_platform(args)
    env, per_rank_env = _platform_env(args, use_gpu, gpus)
    lock = threading.Lock()
    children: list[Child] = []
    pumps: list[threading.Thread] = []
    received: list[int] = []  # signals forwarded so far

    def signal_all(sig: int) -> None:
        for child in children:
            if child.returncode is None:
                child.signal_group(sig)

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        # A second Ctrl-C means "now": kill instead of asking.
        signal_all(signal.SIGKILL if len(received) > 1 else signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        children.extend(
            start(
                [sys.executable, args.script, *args.script_args], args.num_processes, env=env, per_rank_env=per_rank_env
            )
        )
        if received:  # a signal that came while they were starting has not reached them
            signal_all(signal.SIGKILL if len(received) > 1 else received[0])
        for child in children:
            prefix = f"[rank {child.rank}] "
            for stream, out in ((child.proc.stdout, sys.stdout), (child.proc.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, out, prefix, lock, args.verbose), daemon=True)
                t.start()
                pumps.append(t)
        return _supervise(children, args.grace_period, received)
    finally:
        for child in children:  # only after an exception or an early return: kill whatever still runs
            child.kill()
        for t in pumps:
            t.join(timeout=_JOIN_PIPES_S)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(children: list[Child], grace_period: float, received: list[int]) -> int:
    """Waits for the children; on the first failure (or a forwarded signal) ends the rest. Returns the exit code."""
    first_failure: Child | None = None
    failure_code = 0  # its exit code
    stop_at: float | None = None  # when the survivors get SIGTERM
    kill_at: float | None = None  # when they get SIGKILL
    while True:
        running = []
        for child in children:
            code = child.poll()
            if code is None:
                running.append(child)
            elif code != 0 and first_failure is None:
                first_failure, failure_code = child, code
        if not running:
            break
        now = time.monotonic()
        if received and kill_at is None:
            kill_at = now + grace_period + _KILL_AFTER_TERM_S  # the signal went out already
        if first_failure is not None and stop_at is None and not received:
            stop_at = now + grace_period
            with_survivors = ", ".join(str(c.rank) for c in running)
            print(
                f"jax_uccl_ep.launch: rank {first_failure.rank} exited with status "
                f"{_exit_code(failure_code)}; stopping rank(s) {with_survivors} "
                f"in {grace_period:g} s",
                file=sys.stderr,
                flush=True,
            )
        if stop_at is not None and now >= stop_at:
            for child in running:
                child.signal_group(signal.SIGTERM)
            stop_at = float("inf")
            kill_at = now + _KILL_AFTER_TERM_S
        if kill_at is not None and now >= kill_at:
            for child in running:
                child.signal_group(signal.SIGKILL)
            kill_at = float("inf")
        time.sleep(_POLL_S)
    failed = [c for c in children if c.returncode != 0]
    if failed:  # every rank's ending, so a job whose ranks all failed at once still says what happened
        endings = ", ".join(f"rank {c.rank} {_ending(c.returncode)}" for c in children)
        print(
            f"jax_uccl_ep.launch: {len(failed)} of {len(children)} rank(s) failed: {endings}",
            file=sys.stderr,
            flush=True,
        )
    if received:  # interrupted: report the signal, as a shell does
        return 128 + received[0]
    if first_failure is not None:
        return _exit_code(failure_code) or 1
    return 0


def _ending(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:  # a signal Python has no name for (real-time signals)
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


if __name__ == "__main__":
    sys.exit(main())
