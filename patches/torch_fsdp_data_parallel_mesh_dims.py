"""torchtitan 0.3.0 imports `torch.distributed.fsdp.DataParallelMeshDims`, a name torch 2.11 lacks.

On the H200 machines (torch 2.11 + CUDA 13) `import torchtitan.models.deepseek_v3`
dies with ImportError, because `torchtitan/distributed/full_dtensor.py` and
`torchtitan/models/deepseek_v3/mtp.py` import the name at module level. It only
describes which mesh dimensions FSDP shards/replicates on for full-DTensor
(`spmd_types`) parameters, a path our 2.11 use (single-GPU benchmarks, FSDP2 with
plain parameters) never takes; torch 2.13 defines it. The stand-in has the same
fields and validation, so code that builds one still works; torch 2.11's
`fully_shard` has no `dp_mesh_dims` argument and would refuse it if passed.

Must be applied before torchtitan is imported, so this module never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed.fsdp as fsdp

from . import Patch


@dataclass
class DataParallelMeshDims:
    """Stand-in for torch >= 2.13's `torch.distributed.fsdp.DataParallelMeshDims`."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @staticmethod
    def _names(v) -> tuple[str, ...]:
        return () if v is None else ((v,) if isinstance(v, str) else tuple(v))

    @property
    def shard_names(self) -> tuple[str, ...]:
        return self._names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return self._names(self.replicate)


DataParallelMeshDims.__module__ = __name__


def _needed() -> bool:
    return not hasattr(fsdp, "DataParallelMeshDims")


def _probe() -> str | None:
    return None if hasattr(fsdp, "fully_shard") else "torch.distributed.fsdp has no fully_shard: not FSDP2's module"


def _apply() -> None:
    fsdp.DataParallelMeshDims = DataParallelMeshDims
    if hasattr(fsdp, "__all__") and "DataParallelMeshDims" not in fsdp.__all__:
        fsdp.__all__.append("DataParallelMeshDims")


PATCH = Patch(
    name="torch_fsdp_data_parallel_mesh_dims",
    target="torch.distributed.fsdp:DataParallelMeshDims",
    versions="torch>=2.11,<2.14",
    upstream="torchtitan 0.3.0 on torch 2.11 (name added to torch.distributed.fsdp in torch 2.13)",
    symptom="ImportError: cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'",
    probe=_probe,
    needed=_needed,
    apply=_apply,
)
PATCHES = (PATCH,)
