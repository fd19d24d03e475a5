"""Hook specifications for `torchtitan train --extension NAME`.

TorchTitan 0.3.0 has no plugin discovery: a model is reachable only as
`--module dotted.path --config fn`. An extension is a module, found by name in the
`torchtitan.extensions` entry-point group, that implements some of these hooks;
the launcher (`titan_ext.cli`) loads every requested extension into one pluggy
PluginManager, so a third-party extension composes with titan_ext instead of
replacing it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pluggy

PROJECT = "torchtitan"
ENTRY_POINT_GROUP = "torchtitan.extensions"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class ModelEntry:
    """A trainable model: its flavors and a factory for its TorchTitan Trainer.Config."""

    flavors: tuple[str, ...]
    trainer_config: Callable[[str], object]
    description: str = ""


@hookspec
def torchtitan_activate() -> None:
    """Apply the runtime patches the extension needs; called by `train` before anything else of the
    extension runs (`list` reads the registries only and activates nothing)."""


@hookspec
def torchtitan_register_models() -> dict[str, ModelEntry]:
    """Model name -> ModelEntry, without importing TorchTitan: `list` calls it unpatched (the entry's
    trainer_config, called by `train` after activation, is where TorchTitan comes in). Names must be
    unique across loaded extensions."""


@hookspec
def torchtitan_override_imports() -> list[str]:
    """TorchTitan `@override` factories to activate (as for `--override.imports`)."""


@hookspec
def torchtitan_configure(config: object, model: str, flavor: str) -> None:
    """Adjust the Trainer.Config after defaults, before command-line flags are applied."""


@hookspec
def torchtitan_help() -> str:
    """The extension's own command-line flags, as `torchtitan train --help` lists them."""
