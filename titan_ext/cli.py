"""The `torchtitan` console script: `torchtitan train --extension NAME --model M --flavor F [flags]`.

Everything after the extension/model/flavor selection is handed to stock
TorchTitan's own argument parsing (tyro), so every TorchTitan flag works as
documented. Without `--model`, `--module/--config` pass through unchanged.
Works the same under `torchrun ... $(which torchtitan) train ...`.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from importlib.metadata import entry_points

import pluggy

import patches

from . import hookspecs


class ExtensionError(Exception):
    """A user error (extension, model, flavor, options, the checkpoint to start from): `main` prints
    it in one line and exits with code 2."""


def available_extensions() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=hookspecs.ENTRY_POINT_GROUP)}


def load_extensions(names: list[str]) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    found = available_extensions()
    for name in names:
        if name not in found:
            listed = ", ".join(sorted(found)) or "none installed"
            raise ExtensionError(
                f"unknown extension {name!r}; extensions in entry-point group "
                f"{hookspecs.ENTRY_POINT_GROUP!r}: {listed}"
            )
        pm.register(found[name].load(), name=name)
    return pm


def collect_models(pm: pluggy.PluginManager) -> dict[str, hookspecs.ModelEntry]:
    models: dict[str, hookspecs.ModelEntry] = {}
    for plugin_models in pm.hook.torchtitan_register_models():
        for name, entry in plugin_models.items():
            if name in models:
                raise ExtensionError(f"model {name!r} is registered by two extensions")
            models[name] = entry
    return models


def build_config(pm: pluggy.PluginManager, model: str, flavor: str):
    models = collect_models(pm)
    if model not in models:
        raise ExtensionError(f"unknown model {model!r}; loaded extensions provide: {', '.join(sorted(models)) or 'none'}")
    entry = models[model]
    if flavor not in entry.flavors:
        raise ExtensionError(f"unknown flavor {flavor!r} for model {model!r}; it has: {', '.join(entry.flavors)}")
    config = entry.trainer_config(flavor)
    for imports in pm.hook.torchtitan_override_imports():
        config.override.imports.extend(i for i in imports if i not in config.override.imports)
    pm.hook.torchtitan_configure(config=config, model=model, flavor=flavor)
    return config


def _take(args: list[str], flag: str, *, many: bool = False):
    """Remove `--flag V` / `--flag=V` from args; returns the value(s)."""
    values, rest, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a == flag:
            if i + 1 >= len(args):
                raise ExtensionError(f"{flag} needs a value")
            values.append(args[i + 1])
            i += 2
            continue
        if a.startswith(flag + "="):
            values.append(a.split("=", 1)[1])
        else:
            rest.append(a)
        i += 1
    args[:] = rest
    if many:
        return values
    if len(values) > 1:
        raise ExtensionError(f"{flag} given more than once")
    return values[0] if values else None


USAGE = """usage: torchtitan train [--extension NAME ...] --model MODEL --flavor FLAVOR [TorchTitan flags]
       torchtitan train --module MODULE --config CONFIG_FN [TorchTitan flags]
       torchtitan list [--extension NAME ...]"""

LAUNCHER_FLAGS = """launcher flags (taken out before TorchTitan parses the rest):
  --extension NAME  load extension NAME from entry-point group {group!r} (repeatable);
                    installed: {installed}
  --model MODEL     train MODEL, registered by a loaded extension (models below); without
                    --model, --module/--config select a stock TorchTitan config
  --flavor FLAVOR   the model's flavor (default: full)"""

HELP_FLAGS = ("-h", "--help")


def _print_launcher_help(pm: pluggy.PluginManager) -> None:
    """The launcher's own flags and the loaded extensions' models, printed before TorchTitan's help."""
    installed = ", ".join(sorted(available_extensions())) or "none"
    print(USAGE, "", LAUNCHER_FLAGS.format(group=hookspecs.ENTRY_POINT_GROUP, installed=installed), sep="\n")
    models = collect_models(pm)
    print("\nmodels of the loaded extensions:" if models else "\nno models: no extension loaded (--extension NAME)")
    for name, entry in sorted(models.items()):
        print(f"  {name}: flavors {', '.join(entry.flavors)}  {entry.description}")
    for text in pm.hook.torchtitan_help():
        print("\n" + text.rstrip("\n"))
    print("\nTorchTitan's own flags follow.\n", flush=True)


def main(argv: list[str] | None = None) -> None:
    try:
        _main(list(sys.argv[1:] if argv is None else argv))
    except ExtensionError as e:
        print(f"torchtitan: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _main(args: list[str]) -> None:
    if not args or args[0] in HELP_FLAGS or args[0] not in ("train", "list"):
        print(USAGE, file=sys.stderr if args and args[0] not in HELP_FLAGS else sys.stdout)
        raise SystemExit(0 if args and args[0] in HELP_FLAGS else 2)
    command, args = args[0], args[1:]
    extensions = _take(args, "--extension", many=True)
    pm = load_extensions(extensions)
    wants_help = any(a in HELP_FLAGS for a in args)
    if command == "list":  # the registries only: nothing imports TorchTitan, nothing is patched
        if wants_help:
            print(USAGE.splitlines()[-1].strip(), "\n\nPrints the models (and their flavors) the extensions register.")
            return
        for name, entry in sorted(collect_models(pm).items()):
            print(f"{name}: flavors {', '.join(entry.flavors)}  {entry.description}")
        return
    pm.hook.torchtitan_activate()  # before anything imports TorchTitan
    model, flavor = _take(args, "--model"), _take(args, "--flavor")
    if wants_help:
        _print_launcher_help(pm)
    if model is None:
        if flavor is not None:
            raise ExtensionError("--flavor needs --model")
        if wants_help and not any(a == "--module" or a.startswith("--module=") for a in args):
            from torchtitan.trainer import Trainer

            # TorchTitan's help describes a config: with no model chosen, the Trainer's defaults.
            return _run_torchtitan(args, config=Trainer.Config())
        return _run_torchtitan(args, config=None)
    config = build_config(pm, model, flavor or "full")
    from .options import apply_options, take_options

    try:
        apply_options(config, take_options(args))
        _check_hf_initial_checkpoint(args)
    except (ValueError, FileNotFoundError) as e:
        raise ExtensionError(str(e)) from None
    _run_torchtitan(args, config=config)


def _check_hf_initial_checkpoint(args: list[str]) -> None:
    """An HF checkpoint to start from (`--checkpoint.initial_load_path DIR --checkpoint.initial_load_in_hf`)
    has every shard's header read first: a damaged, truncated or missing file is one line here, not
    a traceback from inside TorchTitan's checkpoint reader on every rank."""
    if "--checkpoint.initial_load_in_hf" not in args:
        return
    path = _take(list(args), "--checkpoint.initial_load_path")
    if path is not None:
        from .checkpoint import checkpoint_tensors

        checkpoint_tensors(path)


def _default_single_process_env() -> None:
    """Outside torchrun, run as a world of one (TorchTitan itself insists on torchrun's variables)."""
    if "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


_prebuilt: list = []  # the Trainer.Config main() built, if it built one


def prebuilt_config_manager(stock: type) -> type:
    """TorchTitan's ConfigManager, answering with the config `main()` built (a model chosen with
    --model) as the default that TorchTitan's flags then override; without one, stock parsing."""

    class PrebuiltConfigManager(stock):
        def _load_config(self, args):
            if _prebuilt:
                return _prebuilt[0], args
            return super()._load_config(args)

    PrebuiltConfigManager.__doc__ = stock.__doc__
    return PrebuiltConfigManager


PREBUILT_CONFIG = patches.wrapper_patch(
    "torchtitan_train_prebuilt_config", "torchtitan.train:ConfigManager", prebuilt_config_manager,
    versions="torchtitan>=0.3,<0.4",
    upstream="torchtitan 0.3.0 train.main (builds its config only from --module/--config)",
    symptom="torchtitan train --model M: TorchTitan ignores the model's config and asks for --module",
    probe=patches.probe_target("torchtitan.config:ConfigManager._load_config", ["self", "args"]),
)
PATCHES = (PREBUILT_CONFIG,)


def _run_torchtitan(args: list[str], config) -> None:
    """Run stock `torchtitan.train.main`, with our prebuilt config as the parse default."""
    from .teardown import DESTROY_TOGETHER, exit_without_finalizing, together_on_destroy  # imports torch

    patches.activate([PREBUILT_CONFIG, DESTROY_TOGETHER])
    import torchtitan.train as tt_train

    _default_single_process_env()
    _prebuilt[:] = [] if config is None else [config]
    sys.argv = ["torchtitan", *args]
    with together_on_destroy():  # rank 0 leaves Trainer.train 2 s after the others
        tt_train.main()
    gc.collect()  # TorchTitan's Trainer, which holds the process groups, is garbage only now (teardown.py)
    exit_without_finalizing()  # some of its groups stay referenced: no finalization for their threads to die in
