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
for a child killed by a signal). Each child runs in its own process group (and session), and the
launcher kills the whole group when the child ends, so no process outlives the job; on Linux a child also dies if
the launcher itself is killed.

The launcher never imports jax: GPUs are found with ``nvidia-smi -L`` or ``/dev/nvidia<N>``.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Sequence

_POLL_S = 0.05
_KILL_AFTER_TERM_S = 3.0


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
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
            count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            count = 0
    if count == 0 and os.path.isdir("/dev"):
        count = sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name))
    return [str(i) for i in range(count)]


def _exit_code(returncode: int) -> int:
    """A shell-style exit status: a child killed by signal S (returncode -S) becomes 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: ask Linux to SIGKILL it when the launcher dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # not Linux: the process group is still killed on every normal launcher exit
        pass


@dataclass
class _Child:
    rank: int
    proc: subprocess.Popen
    threads: list[threading.Thread] = field(default_factory=list)
    returncode: int | None = None

    def signal_group(self, sig: int) -> None:
        """Sends `sig` to the child's whole process group (it and anything it started)."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def check_exit(self) -> int | None:
        """The child's return code once it has exited (None while it runs); kills what it left in its group."""
        if self.returncode is not None:
            return self.returncode
        try:
            # Look without reaping, so the group id cannot be reused before its leftovers are killed.
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = True
        if info is None:
            return None
        self.signal_group(signal.SIGKILL)
        self.returncode = self.proc.wait()
        return self.returncode


def _pump(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock) -> None:
    """Copies `stream` to `out` line by line, each line prefixed."""
    with stream:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with lock:
                out.write(f"{prefix}{line}\n")
                out.flush()


def _child_env(args: argparse.Namespace, rank: int, port: int, gpus: list[str], use_gpu: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(args.num_processes),
        JAX_PROCESS_ID=str(rank),
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("FI_TCP_IFACE", "lo")
    if use_gpu:
        if args.gpus_per_process == "1":
            env["CUDA_VISIBLE_DEVICES"] = gpus[rank]
    else:
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = str(args.devices_per_process or 1)
    return env


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the launcher's flags; everything from the script path on belongs to the script."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_uccl_ep.launch",
        description="Run a JAX script in N local processes wired together with jax.distributed.",
    )
    parser.add_argument("-n", "--num-processes", type=int, required=True, help="processes to start")
    parser.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                        help="CPU devices per process (JAX_NUM_CPU_DEVICES; default 1); CPU runs only")
    parser.add_argument("--gpus-per-process", choices=["1", "all"], default="1",
                        help="one GPU per process (CUDA_VISIBLE_DEVICES), or every GPU in one process (-n 1)")
    parser.add_argument("--platform", choices=["auto", "cpu", "gpu"], default="auto",
                        help="auto: GPUs when present, otherwise CPU processes")
    parser.add_argument("--grace-period", type=float, default=5.0, metavar="S",
                        help="seconds the other processes get after one fails, before they are killed")
    parser.add_argument("script", help="Python script to run in every process")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = parser.parse_args(argv)
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
            raise SystemExit(f"jax_uccl_ep.launch: -n {args.num_processes} with one GPU per process, "
                             f"but only {len(gpus)} GPU(s) are visible")
    return use_gpu, gpus


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the job; returns 0 if every child succeeded, else the first failing child's exit status."""
    args = parse_args(argv)
    use_gpu, gpus = _choose_platform(args)
    port = free_port()
    lock = threading.Lock()
    command = [sys.executable, args.script, *args.script_args]

    children: list[_Child] = []
    received: list[int] = []  # signals forwarded so far

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        # A second Ctrl-C means "now": kill instead of asking.
        sig = signal.SIGKILL if len(received) > 1 else signum
        for child in children:
            if child.returncode is None:
                child.signal_group(sig)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for rank in range(args.num_processes):
            proc = subprocess.Popen(
                command,
                env=_child_env(args, rank, port, gpus, use_gpu),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # own process group: Ctrl-C reaches it only through us
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
            children.append(_Child(rank, proc))
        for child in children:
            prefix = f"[rank {child.rank}] "
            for stream, out in ((child.proc.stdout, sys.stdout), (child.proc.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, out, prefix, lock), daemon=True)
                t.start()
                child.threads.append(t)
        return _supervise(children, args.grace_period, received)
    finally:
        for child in children:  # only after an exception or an early return: kill whatever still runs
            if child.check_exit() is None:
                child.signal_group(signal.SIGKILL)
                child.check_exit()
        for child in children:
            for t in child.threads:
                t.join(timeout=2.0)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(children: list[_Child], grace_period: float, received: list[int]) -> int:
    """Waits for the children; on the first failure (or a forwarded signal) ends the rest. Returns the exit code."""
    first_failure: _Child | None = None
    stop_at: float | None = None  # when the survivors get SIGTERM
    kill_at: float | None = None  # when they get SIGKILL
    while True:
        running = []
        for child in children:
            code = child.check_exit()
            if code is None:
                running.append(child)
            elif code != 0 and first_failure is None:
                first_failure = child
        if not running:
            break
        now = time.monotonic()
        if received and kill_at is None:
            kill_at = now + grace_period + _KILL_AFTER_TERM_S  # the signal went out already
        if first_failure is not None and stop_at is None and not received:
            stop_at = now + grace_period
            with_survivors = ", ".join(str(c.rank) for c in running)
            print(f"jax_uccl_ep.launch: rank {first_failure.rank} exited with status "
                  f"{_exit_code(first_failure.returncode)}; stopping rank(s) {with_survivors} "
                  f"in {grace_period:g} s", file=sys.stderr, flush=True)
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
    if received:  # interrupted: report the signal, as a shell does
        return 128 + received[0]
    if first_failure is not None:
        return _exit_code(first_failure.returncode) or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
