"""Stress: the layer's training step (forward and gradients of layers.moe_ffn, or of moe_ffn_local inside the
script's own shard_map) on 8 CPU devices of one process, a (dp 2, ep 4) mesh, each run a fresh process. XLA's
all-reduces (the statistics, the dp reduction of the weights' gradients) do not depend on the EP ops through data,
and both hold a thread of XLA:CPU's shared pool while they wait for the other devices: before the layer ordered
them after its EP ops on CPU devices, about half the moe_ffn runs (1 in 10 of the moe_ffn_local ones) stopped in
an all-reduce that some devices never reached, until XLA aborted the process (docs/RELIABILITY.md, "XLA
collectives beside EP ops"). Prints each run's outcome and the count that stopped.
Not collected by pytest (tests/test_moe_layer.py runs a few).

    python tests/stress/collectives_beside_ep_ops.py [runs] [timeout_s] [local]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

RUN = """
import sys
sys.path.insert(0, {tests!r})
import conftest  # noqa: F401  (CPU devices as the suite sets them up)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_uccl_ep as ep
from jax_uccl_ep import layers

experts, tokens, d_model = 32, 60, 320
config = layers.MoEConfig(num_experts=experts, top_k=1, compute_dtype="bfloat16")
mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "ep"))
spec = P(("dp", "ep"))
ep.initialize()
kp, kx, kr = jax.random.split(jax.random.key(1), 3)
params = layers.init_moe_params(kp, d_model=d_model, d_ff=32, num_experts=experts)
router = -jnp.abs(jax.random.normal(kr, (d_model, experts)))  # every token to the last EP rank's experts
params["router"] = router.at[:, -experts // 4 :].set(jnp.abs(router[:, -experts // 4 :]) + 1.0)
specs = layers.moe_param_specs("ep")
params = {{k: jax.device_put(v.astype(jnp.bfloat16), NamedSharding(mesh, specs[k])) for k, v in params.items()}}
x = jnp.abs(jax.random.normal(kx, (8 * tokens, d_model))).astype(jnp.bfloat16)
x = jax.device_put(x, NamedSharding(mesh, spec))

if {local!r}:  # the layer inside the user's own shard_map, the loss reduced there
    def body(p, x):
        y = layers.moe_ffn_local(p, x, config, axis_name="ep").y
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32)), ("dp", "ep"))

    loss = jax.shard_map(body, mesh=mesh, in_specs=(specs, spec), out_specs=P())
else:
    def loss(p, x):
        y = layers.moe_ffn(p, x, mesh=mesh, config=config, token_spec=spec).y
        return jnp.sum(y.astype(jnp.float32))

value, grads = jax.jit(jax.value_and_grad(loss))(params, x)
jax.block_until_ready(grads)
print("step done", float(value), flush=True)
"""


def run_once(timeout_s: float, local: bool = False) -> tuple[bool, str]:
    """One training step in a fresh process (`local`: moe_ffn_local in the script's own shard_map, else moe_ffn):
    (whether it ended with its result, what it said if not)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    script = RUN.format(tests=os.path.dirname(HERE), local=local)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return False, f"no end within {timeout_s:.0f} s"
    if done.returncode == 0 and "step done" in done.stdout:
        return True, "done"
    said = [line for line in done.stderr.splitlines() if "Termination timeout" in line or "Error" in line]
    return False, f"exit {done.returncode}: {(said or done.stderr.splitlines() or [''])[-1][:300]}"


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    timeout_s = float(sys.argv[2]) if len(sys.argv) > 2 else 180.0
    local = len(sys.argv) > 3 and sys.argv[3] == "local"
    stopped = 0
    for run in range(runs):
        start = time.monotonic()
        ok, outcome = run_once(timeout_s, local)
        stopped += not ok
        print(f"run {run}: {outcome} ({time.monotonic() - start:.1f} s)", flush=True)
    print(f"{stopped} of {runs} runs stopped")


if __name__ == "__main__":
    main()
