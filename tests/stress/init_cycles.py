"""Stress: 2 processes x 2 CPU devices, each cycle initialize(), one small round trip, shutdown(); stops at the
first failure and prints it. Over shm with 3 proxy threads and the reorder mode (the settings of
tests/test_normal.py::test_across_processes[shm-1-3]) on a 2-core machine it shows the stall in
docs/RELIABILITY.md wherever the ranks run in Linux sessions (scheduler autogroups) of their own; the launcher keeps
them in its session. Not collected by pytest.

    python tests/stress/init_cycles.py [cycles] [timeout_s]
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)


def cycles(n: int) -> dict:
    """Child: `n` initialize / round trip / shutdown cycles; stops at the first failure."""
    import cases
    import jax
    import jax.numpy as jnp

    import jax_uccl_ep as ep

    for c in range(n):
        ep.initialize()
        mesh = cases.mesh_of(jax.devices())
        start = time.monotonic()
        try:
            problems = cases.check_case(mesh, 17 + c, 21, 256, 4, 4 * mesh.devices.size, jnp.float32)
        except Exception as exc:  # noqa: BLE001 - what this script reports
            ep.shutdown()
            return {"cycles": c + 1, "error": str(exc)[:3000], "seconds": time.monotonic() - start}
        ep.shutdown()
        if problems:
            return {"cycles": c + 1, "error": f"wrong results: {problems}"[:3000]}
    return {"cycles": n, "error": None}


def main() -> int:
    sys.path.insert(0, TESTS)
    from mp import launch

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 150
    timeout_s = sys.argv[2] if len(sys.argv) > 2 else "20"
    env = {
        "UCCL_EP_FI_PROVIDER": "shm",
        "UCCL_EP_REORDER": "1",
        "UCCL_EP_POISON": "1",
        "UCCL_EP_NUM_PROXY_THREADS": "3",
        "UCCL_EP_MAX_WRITE_BYTES": "4096",
        "UCCL_EP_TIMEOUT_S": timeout_s,
        "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), TESTS, os.environ.get("PYTHONPATH", "")]),
    }
    results = launch(
        os.path.abspath(__file__), "cycles", 2, args=[n], devices_per_process=2, env=env, timeout_s=60 + 10 * n
    )
    failed = False
    for r in results:
        print(f"process {r.rank}: exit {r.returncode}, {json.dumps(r.result)}")
        warnings = [line for line in r.stderr.splitlines() if line.startswith("uccl_ep")]
        if warnings:
            print("  " + "\n  ".join(warnings[-8:]))
        failed |= not r.ok or bool(r.result and r.result["error"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
