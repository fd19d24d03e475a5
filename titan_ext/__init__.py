"""titan_ext: the TorchTitan extension of moerl (`torchtitan train --extension titan_ext`).

Registers the Kimi-K2, GLM-5 and Qwen3-MoE model specs through the hooks in `hookspecs`. Importing
it changes nothing upstream: `activate()` applies the runtime patches this TorchTitan/torch
combination needs (`patches/`), and every entry into the trainer calls it before TorchTitan
is imported (torchtitan 0.3.0 cannot even be imported on torch 2.11 without one of them):
the `torchtitan` launcher through the `torchtitan_activate` hook, `moerl rl`'s trainer,
the benchmarks and the test workers directly.
"""

from __future__ import annotations

import functools

import patches

from .hookspecs import ModelEntry, hookimpl


def trainer_patches() -> tuple[patches.Patch, ...]:
    """The trainer's patches, in the order they apply. Imported here, not at the top: they import
    torch, which the commands that only read the model specs (`moerl plan`, `torchtitan list`) skip."""
    from patches import (
        fsdp_gloo_sum_reduction,
        torch_compiler_is_non_strict_tracing,
        torch_distributed_set_timeout,
        torch_fsdp_data_parallel_mesh_dims,
        torch_grouped_mm_meta_dtype,
        torchtitan_cpu_device,
    )

    return (
        torch_fsdp_data_parallel_mesh_dims.PATCH,  # first: torchtitan's import needs it on torch 2.11
        torch_compiler_is_non_strict_tracing.PATCH,
        torch_distributed_set_timeout.PATCH,
        torchtitan_cpu_device.PATCH,
        fsdp_gloo_sum_reduction.PATCH,
        torch_grouped_mm_meta_dtype.PATCH,
    )


def activate() -> list[str]:
    """Apply the trainer's runtime patches that are needed here; returns the names applied now.
    Idempotent; raises `patches.PatchError` when upstream changed under one."""
    return patches.activate(trainer_patches())


@hookimpl
def torchtitan_activate() -> None:
    activate()


def _trainer_config(name: str, flavor: str):
    """TorchTitan's Trainer.Config of a model, importing TorchTitan only once a model is trained."""
    from .train_config import trainer_config

    return trainer_config(name, flavor)


@hookimpl
def torchtitan_register_models() -> dict[str, ModelEntry]:
    from .models import ARCHS

    return {
        name: ModelEntry(
            flavors=tuple(flavors),
            trainer_config=functools.partial(_trainer_config, name),
            description=f"{flavors['full'].hf_architecture} layout (titan_ext)",
        )
        for name, flavors in ARCHS.items()
    }


@hookimpl
def torchtitan_help() -> str:
    from .options import options_help

    return options_help()
