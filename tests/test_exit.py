"""How a job ends under the launcher (CPU processes): no stall at exit while EP ops are still in flight, an op error
nobody read still printed on its rank with a failing exit status, a peer that never reaches shutdown named within
the deadline, every rank's ending summarised when all fail, no library chatter on a clean run, and the children in
process groups of their own within the launcher's session."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from mp import run_launcher

# A script as the README writes them: EP ops whose results are never awaited, then the interpreter exits.
UNAWAITED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    import jax_uccl_ep as ep
    from jax.sharding import Mesh, PartitionSpec as P

    ep.initialize()
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    R, T, H, K, E = mesh.size, 64, 256, 2, 4 * mesh.size
    BAD = int(__import__("os").environ.get("BAD_INDEX", "0"))

    def moe(x, idx, w):
        r = ep.dispatch(x, idx, w, num_experts=E, axis_name="ep")
        return ep.combine(r.x * 2, r.handle)

    f = jax.jit(jax.shard_map(moe, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    key = jax.random.key(0)
    idx = jax.random.randint(key, (R * T, K), 0, E, dtype=jnp.int32)
    if BAD:
        idx = idx.at[3, 1].set(E + 7)
    for _ in range(3):
        print(f(jax.random.normal(key, (R * T, H)), idx, jax.random.uniform(key, (R * T, K))).shape)
    """
)


def _script(text: str) -> str:
    path = os.path.join(tempfile.mkdtemp(), "job.py")
    with open(path, "w") as f:
        f.write(text)
    return path


def _launch(args: list[str], env: dict | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """The launcher on CPU processes, from outside the repository, with a 20 s peer deadline unless `env` says."""
    env = {**os.environ, "UCCL_EP_TIMEOUT_S": "20", **(env or {})}
    return run_launcher(["--platform", "cpu", *args], cwd=tempfile.mkdtemp(), timeout=timeout, env=env)


def test_exit_while_ops_are_in_flight_never_stalls():
    """Each rank leaves with its ops' results unread; shutdown waits for them and for the peers, so no rank
    is left waiting for rows: such a stall lasts UCCL_EP_TIMEOUT_S (120 s here) on top of the run's ~5 s. Many runs:
    the race was 1 in 5. The bound is the stall's own length, not a run's usual time: a run slowed for another
    reason (the shm provider refusing writes while a peer's proxy threads get no CPU, docs/RELIABILITY.md, printed
    as "has refused ... still retrying") passes, and a stall at exit does not."""
    script = _script(UNAWAITED)
    # The libraries' timestamped log lines (the coordination service's barriers and shutdown) come along, so that a
    # slow run says which wait took its time.
    # 120 s: on CI's 2 cores a run's first op once waited past 60 s for its peer (docs/RELIABILITY.md).
    logs = {"UCCL_EP_TIMEOUT_S": "120", "TF_CPP_MIN_LOG_LEVEL": "0"}
    deadline_s = float(logs["UCCL_EP_TIMEOUT_S"])
    for run in range(6):
        start = time.monotonic()
        # The launcher's own limit past the deadline, so that a stall ends in the bound below, with its logs.
        done = _launch(["--verbose", "-n", "2", "--devices-per-process", "2", script], env=logs, timeout=2 * deadline_s)
        seconds = time.monotonic() - start
        if done.returncode != 0 or seconds >= deadline_s:
            # Whole, where pytest shows it (captured output): an assertion's message is cut to a few lines, which
            # left a crash at exit on CI with only the end of its stack.
            print(f"--- run {run}: exit status {done.returncode} after {seconds:.1f} s; stderr:\n{done.stderr}")
        assert done.returncode == 0, (run, done.stderr[-2000:])
        assert done.stdout.count("(256, 256)") == 6, (run, done.stdout)
        assert seconds < deadline_s, f"run {run} took {seconds:.1f} s: a rank waited at exit\n{done.stderr[-6000:]}"
        assert "jax_uccl_ep (" not in done.stderr, done.stderr  # nothing to report


def test_an_unread_op_error_is_printed_on_its_rank_and_fails_the_job():
    done = _launch(["-n", "2", _script(UNAWAITED)], env={"BAD_INDEX": "1"})
    assert done.returncode == 1, done.stderr[-3000:]
    # The rank that found it, with the index local to it, and the peer that heard of it.
    assert re.search(
        r"\[rank 0\] jax_uccl_ep \(process 0 of 2\): an EP op failed .*rank 0: topk_idx\[3, 1\] = 15 is outside "
        r"\[-1, num_experts=8\) \(row 3 of that rank's own tokens\)",
        done.stderr,
    ), done.stderr[-3000:]
    assert re.search(r"\[rank 1\] jax_uccl_ep \(process 1 of 2\): an EP op failed .*rank 0 reported", done.stderr)
    assert "2 of 2 rank(s) failed: rank 0 exit 1, rank 1 exit 1" in done.stderr, done.stderr[-2000:]


def test_without_the_launcher_the_error_is_printed_and_the_status_kept():
    """In one process (4 CPU devices) the unread error is printed at exit; UCCL_EP_EXIT_ON_UNREAD_ERRORS is off
    outside the launcher, so the status stays the script's."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4", BAD_INDEX="1")
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, _script(UNAWAITED)], capture_output=True, text=True, timeout=120, env=env, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "an EP op failed and no check_errors() ran after it" in done.stderr, done.stderr[-2000:]
    assert "topk_idx[3, 1] = 23 is outside [-1, num_experts=16)" in done.stderr, done.stderr[-2000:]


def test_ctrl_c_and_an_abort_end_the_process_as_they_would_without_the_library():
    """Loading and starting libfabric installs its providers' signal handlers (Debian's links libinfinipath, whose
    handlers call exit() inside the signal): Ctrl-C stopped raising KeyboardInterrupt, and an abort, which XLA's
    stuck-collective check raises, could hang the process in its exit handlers. After import, initialize() and ops,
    SIGINT raises KeyboardInterrupt and os.abort() ends the process by SIGABRT, as in a process without the
    library."""
    ending = textwrap.dedent(
        """
        import signal, time
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(10)
            print("no KeyboardInterrupt", flush=True)
        except KeyboardInterrupt:
            print("KeyboardInterrupt", flush=True)
        os.abort()
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2")
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, _script(UNAWAITED + "import os\n" + ending)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd="/",
    )
    assert done.stdout.count("(128, 256)") == 3, (done.stdout, done.stderr[-2000:])
    assert "\nKeyboardInterrupt\n" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-2000:])


def test_a_peer_that_never_reaches_shutdown_is_named_in_time():
    """Rank 1 hangs after its ops instead of exiting; rank 0's shutdown gives up within the deadline, says so,
    and fails (the launcher then stops rank 1)."""
    script = _script(
        UNAWAITED
        + textwrap.dedent(
            """
            import os, time
            jax.effects_barrier()
            if jax.process_index() == 1:
                time.sleep(120)
            """
        )
    )
    start = time.monotonic()
    done = _launch(["-n", "2", "--grace-period", "1", script], env={"UCCL_EP_TIMEOUT_S": "5"})
    seconds = time.monotonic() - start
    assert done.returncode != 0, done.stderr[-2000:]
    assert "did not all reach shutdown within 5 s" in done.stderr, done.stderr[-3000:]
    assert seconds < 40.0, seconds


def test_every_rank_failing_at_once_gets_a_summary():
    done = _launch(["-n", "3", _script("import sys\nsys.exit(3)\n")])
    assert done.returncode == 3
    assert "3 of 3 rank(s) failed: rank 0 exit 3, rank 1 exit 3, rank 2 exit 3" in done.stderr, done.stderr


def test_the_launcher_explains_a_missing_script_and_its_help():
    done = _launch(["-n", "2"])
    assert done.returncode == 2 and "no script to run" in done.stderr, done.stderr
    assert "required: script" not in done.stderr
    help_text = _launch(["--help"]).stdout
    for needed in ("(default 5)", "JAX_COORDINATOR_ADDRESS", "UCCL_EP_EXIT_ON_UNREAD_ERRORS", "examples:"):
        assert needed in help_text, needed


@pytest.mark.parametrize("verbose", [False, True])
def test_a_clean_run_prints_only_the_script(verbose):
    """Gloo's connection lines (XLA's CPU collectives: the psum below) stay out unless --verbose."""
    script = _script(
        textwrap.dedent(
            """
            import jax, numpy as np
            import jax_uccl_ep as ep
            from jax.sharding import Mesh, PartitionSpec as P

            ep.initialize()
            mesh = Mesh(np.array(jax.devices()), ("ep",))
            f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "ep"), mesh=mesh, in_specs=P("ep"), out_specs=P()))
            print(int(f(np.ones(mesh.size))[0]))
            """
        )
    )
    done = _launch(["-n", "2", "--devices-per-process", "2"] + (["--verbose"] if verbose else []) + [script])
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert "[rank 0] 4" in lines and "[rank 1] 4" in lines, lines
    assert any("Gloo" in line for line in lines) == verbose, lines
    if not verbose:
        assert all(line.startswith("[rank ") for line in lines), lines  # nothing from the launcher either


@pytest.mark.parametrize("verbose", [False, True])
def test_the_cancelled_coordination_watch_stays_out_unless_verbose(verbose):
    """The block every process's jax.distributed client logs on GPUs when a job ends as it should (as it came from
    4 H100s), between lines that must stay; a block after it that is not the watch's stays whole."""
    import io
    import threading

    from jax_uccl_ep.launch import _pump

    watch = [
        "W1126 16:16:13.407758   25852 pjrt_client.cc:1605] WatchTasksAsync failed for task 0: CANCELLED: CANCELLED",
        "Additional GRPC error information from remote target coordination_service while calling "
        "/xla.coordination.CoordinationService/WatchTasks:",
        ":CANCELLED:CANCELLED [type.googleapis.com/tensorflow.DerivedStatus='']",
        "=== Source Location Trace: === ",
        "external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89",
        "",
    ]
    kept = ["step 20/20 loss 2.36", "E1126 a real error", "=== Source Location Trace: === ", "summary: done"]
    text = "\n".join([kept[0]] + watch + kept[1:]) + "\n"
    out = io.StringIO()
    _pump(io.BytesIO(text.encode()), out, "[rank 0] ", threading.Lock(), verbose=verbose)
    lines = [line[len("[rank 0] ") :] for line in out.getvalue().splitlines()]
    assert lines == ([kept[0]] + watch + kept[1:] if verbose else kept), lines


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 starts each child in a session of its own")
def test_the_children_share_the_launchers_session_in_groups_of_their_own():
    """Each child leads its own process group (Ctrl-C and the launcher's kills reach it alone) in the launcher's
    session: a session of its own would be a scheduler autogroup of its own, which on 2 cores starved one rank's
    proxies for seconds while a peer spun in libfabric shm's lock (docs/RELIABILITY.md)."""
    from jax_uccl_ep import launch

    probe = "import os; print(os.getpid(), os.getpgid(0), os.getsid(0))"
    children = launch.start([sys.executable, "-c", probe], 2)
    seen = []
    for child in children:
        out, _ = child.proc.communicate(timeout=60)
        child.poll()
        seen.append(tuple(int(v) for v in out.split()))
    assert [c.returncode for c in children] == [0, 0], seen
    for pid, group, session in seen:
        assert group == pid, seen  # a group of its own
        assert session == os.getsid(0), seen  # the launcher's session
    assert seen[0][1] != seen[1][1] != os.getpgid(0), seen
