"""titan_ext: the TorchTitan extension of moerl (`torchtitan train --extension titan_ext`).

Registers the Kimi-K2 and GLM-5 model specs through the hooks in `hookspecs`, and
applies the runtime patches this TorchTitan/torch combination needs (`patches/`)
on import, in every process the launcher or torchrun starts.
"""

from __future__ import annotations

import patches

from .hookspecs import ModelEntry, hookimpl

patches.apply_all()


@hookimpl
def torchtitan_register_models() -> dict[str, ModelEntry]:
    from .models import ARCHS
    from .train_config import trainer_config

    return {
        name: ModelEntry(
            flavors=tuple(flavors),
            trainer_config=lambda flavor, name=name: trainer_config(name, flavor),
            description=f"{flavors['full'].hf_architecture} layout (titan_ext)",
        )
        for name, flavors in ARCHS.items()
    }


@hookimpl
def torchtitan_help() -> str:
    from .options import options_help

    return options_help()
