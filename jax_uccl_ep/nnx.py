"""The MoE layer as a Flax NNX module (``pip install flax``; jax_uccl_ep itself does not need it).

    moe = jax_uccl_ep.nnx.MoE(d_model, d_ff, MoEConfig(num_experts=64, top_k=6), mesh=mesh, rngs=nnx.Rngs(0))
    y, aux_loss, stats = moe(x)  # x [batch, seq, d_model], batch split over the mesh's "ep" axis

Its expert weights are created sharded over the EP axis and carry that partitioning as metadata, so
``nnx.get_partition_spec`` and sharded checkpointing see it.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .layers import MoEConfig, MoEOutput, init_moe_params, moe_ffn, moe_param_specs

__all__ = ["MoE"]

_WEIGHTS = ("router", "w_gate", "w_up", "w_down")
_FLAX_VERSION = tuple(int(p) for p in flax.__version__.split(".")[:2] if p.isdigit())


def _param(value: jax.Array, names: tuple, mesh: Mesh) -> nnx.Param:
    """A parameter placed by `names` on `mesh`, with the names as its partitioning metadata."""
    placed = jax.device_put(value, NamedSharding(mesh, P(*names)))
    if _FLAX_VERSION >= (0, 12):  # out_sharding: the partitioning flax reads (nnx.get_partition_spec)
        return nnx.Param(placed, out_sharding=names, mesh=mesh)
    return nnx.Param(placed, sharding=names)  # older flax's metadata key


class MoE(nnx.Module):
    """An expert-parallel MoE feed-forward block (router, SwiGLU experts, dispatch and combine over `axis_name`).

    Args:
      d_model: channels of the activations; d_ff: hidden channels of each expert.
      config: experts, top-k, router scores, aux loss, capacity (``jax_uccl_ep.layers.MoEConfig``).
      mesh: the device mesh; `axis_name` (default "ep") is its EP axis, whose size must divide num_experts.
      rngs: NNX random streams (its ``params`` stream initialises the weights).
      param_dtype: dtype of the weights (the computation runs in the dtype of x).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        config: MoEConfig,
        *,
        mesh: Mesh,
        rngs: nnx.Rngs,
        axis_name: str = "ep",
        param_dtype: Any = jnp.float32,
    ):
        self.config = config
        self.mesh = mesh
        self.axis_name = axis_name
        values = init_moe_params(
            rngs.params(), d_model=d_model, d_ff=d_ff, num_experts=config.num_experts, dtype=param_dtype
        )
        specs = moe_param_specs(axis_name)
        for name in _WEIGHTS:
            names = tuple(specs[name]) + (None,) * (values[name].ndim - len(tuple(specs[name])))
            setattr(self, name, _param(values[name], names, mesh))

    def params(self) -> dict[str, jax.Array]:
        """The weights as the functional layer takes them."""
        return {name: getattr(self, name)[...] for name in _WEIGHTS}

    def __call__(self, x: jax.Array) -> MoEOutput:
        """``x [batch, ..., d_model]`` -> MoEOutput(y like x, aux_loss, stats)."""
        params = {k: v.astype(x.dtype) for k, v in self.params().items()}
        return moe_ffn(params, x, mesh=self.mesh, config=self.config, axis_name=self.axis_name)
