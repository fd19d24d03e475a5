"""The parallelize function of the MLA models: TorchTitan's DeepSeek-V3 one, with titan_ext's context parallel.

`--parallelism.context_parallel_degree N` keeps meaning what it means in TorchTitan: the mesh,
the FSDP axis that folds in `cp`, and the trainer's sharding of inputs, labels and positions are
all TorchTitan's. Only the attention differs: instead of TorchTitan's CP wrapper around the inner
attention (per-head K/V gathered, no DSA), every MLA/DSA layer gets a `SequenceShards` and
gathers latents (`context_parallel`).
"""

from __future__ import annotations

from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

from .context_parallel import SequenceShards
from .mla import MLAttention


class _AttentionCPTakenOver:
    """`parallel_dims` as `parallelize_deepseekv3` must see them once titan_ext handles CP's
    attention: `cp_enabled` False, so it leaves the inner attention alone; every mesh (the FSDP
    one includes `cp`), degree and other property is the real object's."""

    cp_enabled = False

    def __init__(self, dims):
        self._dims = dims

    def __getattr__(self, name):
        return getattr(self._dims, name)


def parallelize_mla(model, *, parallel_dims, parallelism, **kwargs):
    if parallel_dims.cp_enabled:
        shards = SequenceShards(parallel_dims.get_mesh("cp"), parallelism.context_parallel_load_balancer)
        for name, layer in model.layers.items():
            if not isinstance(layer.attention, MLAttention):
                raise ValueError(f"layer {name}: context parallel needs titan_ext's MLA attention, "
                                 f"got {type(layer.attention).__name__}")
            layer.attention.cp = shards
        parallel_dims = _AttentionCPTakenOver(parallel_dims)
    return parallelize_deepseekv3(model, parallel_dims=parallel_dims, parallelism=parallelism, **kwargs)
