"""torchtitan 0.3.0 calls `torch.distributed.set_timeout`, a torch 2.14 API.

On torch 2.13 the trainer dies with AttributeError when it shortens the
process-group timeout after the first step. torch 2.13 has the same operation as
the private `distributed_c10d._set_pg_timeout(timeout, group)`.
"""

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import Patch, probe_target


def _needed() -> bool:
    return not hasattr(dist, "set_timeout")


def _apply() -> None:
    def set_timeout(timeout, group=None):
        c10d._set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout


PATCH = Patch(
    name="torch_distributed_set_timeout",
    target="torch.distributed:set_timeout",
    versions="torch>=2.11,<2.14",
    upstream="torchtitan 0.3.0 on torch 2.13 (API added in torch 2.14)",
    symptom="AttributeError: module 'torch.distributed' has no attribute 'set_timeout'",
    probe=probe_target("torch.distributed.distributed_c10d:_set_pg_timeout", ["timeout", "group"]),
    needed=_needed,
    apply=_apply,
)
PATCHES = (PATCH,)
