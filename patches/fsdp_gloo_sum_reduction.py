"""FSDP2 gradient reduction on gloo: force SUM instead of PREMUL_SUM.

torchtitan 0.3.0 divides gradients itself (by the global token count) and sets
FSDP's gradient divide factor to 1.0, which FSDP2 turns into a PREMUL_SUM
reduce-scatter. Gloo (torch 2.13) has no PREMUL_SUM: every CPU FSDP run dies at
the first backward with "Cannot use ReduceOp.PREMUL_SUM with Gloo". With a factor
of 1.0, SUM is the same reduction, so on gloo we ask FSDP for SUM.
"""

import torch.distributed as dist

from . import Patch, probe_target

_MARK = "_moerl_gloo_sum"


def _needed() -> bool:
    import torchtitan.distributed.fsdp as fsdp

    return not getattr(fsdp.disable_fsdp_gradient_division, _MARK, False)


def _probe() -> str | None:
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        return "FSDPModule has no set_force_sum_reduction_for_comms"
    return probe_target("torchtitan.distributed.fsdp:disable_fsdp_gradient_division", ["model"])()


def _apply() -> None:
    import torchtitan.distributed.fsdp as fsdp
    from torch.distributed.fsdp import FSDPModule

    upstream = fsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model) -> None:
        upstream(model)
        if dist.is_initialized() and dist.get_backend() == "gloo":
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)

    setattr(disable_fsdp_gradient_division, _MARK, True)
    fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def gloo_premul_sum_error() -> str:
    """The error gloo raises for the reduction FSDP2 issues (empty if gloo supports it).

    tests/unit/test_patches.py asserts this is non-empty: once gloo supports
    PREMUL_SUM, the patch is dead and should be removed.
    """
    import torch

    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.PREMUL_SUM(1.0)
    try:
        pg.reduce_scatter([torch.zeros(1)], [[torch.ones(1)]], opts).wait()
    except RuntimeError as e:
        return str(e)
    return ""


PATCH = Patch(
    name="fsdp_gloo_sum_reduction",
    target="torchtitan.distributed.fsdp:disable_fsdp_gradient_division",
    versions="torchtitan>=0.3,<0.4",
    upstream="torchtitan 0.3.0 FSDP2 (gradient_divide_factor=1.0) on torch 2.13 gloo",
    symptom="RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo",
    probe=_probe,
    needed=_needed,
    apply=_apply,
)
PATCHES = (PATCH,)
