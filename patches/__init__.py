"""The one contract for every change moerl makes to an upstream module or class.

vllm, torch, torchtitan, transformers and safetensors are used as published; where moerl
must replace an attribute of theirs (a gap fixed, a hook for routing capture, a config
setting), that replacement is a `Patch`: named, written against a version range, with a
`probe` that says whether the target still has the shape the patch expects, `needed`,
`apply`, and whether it is required. Nothing applies a patch on import: each entry point
activates the patches it needs (`activate`), before the code that depends on them runs.

A patch whose probe fails does not install quietly: a required one stops the process
with a `PatchError` naming the patch, the upstream version found and what to do; an
optional one is skipped with a WARNING, recorded (`skipped()`) and reported to the
listeners the process registered (`on_skip`: vllm_ext counts them on /metrics and names
them in responses).

`PATCH_MODULES` indexes every module that defines patches (its `PATCHES`), in the tree's
packages too; activation never goes through it, tests do: tests/unit/test_upstream_hooks.py
checks each probe and version range against the installed upstream and that no code
outside these modules assigns to an upstream attribute, and tests/unit/test_patches.py
that each fix in this package is still needed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from packaging.requirements import Requirement

logger = logging.getLogger("moerl.patches")

__all__ = ["Patch", "PatchError", "PATCH_MODULES", "all_patches", "activate", "installed_version", "in_range",
           "wrapper_patch", "setting_patch", "probe_target", "skipped", "on_skip", "resolve"]


@dataclass(frozen=True)
class Patch:
    """The installation record of one replacement of an upstream attribute.

    `versions` is a requirement on the upstream package whose attribute is replaced, by its
    import name ("vllm>=0.32,<0.33"). `probe` returns None when the target has the shape
    the patch expects, else what differs. `needed` is False where the patch has nothing to
    do (already applied, upstream fixed, not this kind of process)."""

    name: str
    target: str
    versions: str
    upstream: str
    symptom: str
    probe: Callable[[], str | None]
    needed: Callable[[], bool]
    apply: Callable[[], None]
    required: bool = True


class PatchError(RuntimeError):
    """A required patch cannot be installed on the upstream version found."""


PATCH_MODULES = (
    # First: torchtitan cannot even be imported on torch 2.11 without it.
    "patches.torch_fsdp_data_parallel_mesh_dims",
    "patches.torch_compiler_is_non_strict_tracing",
    "patches.torch_distributed_set_timeout",
    "patches.torchtitan_cpu_device",
    "patches.fsdp_gloo_sum_reduction",
    "patches.torch_grouped_mm_meta_dtype",
    "patches.vllm_cpu_moe_reload_prepack",
    "patches.vllm_cpu_mla_rope",
    "patches.vllm_cpu_portable_kernels",
    "patches.vllm_executor_reads_every_answer",
    "patches.vllm_cpu_shm_reader_naps",
    # The tree's hooks: each module keeps its wrappers' logic and their records.
    "titan_ext.chunked_loss",
    "titan_ext.cli",
    "titan_ext.teardown",
    "titan_ext.train_config",
    "vllm_ext.dsa.backend",
    "vllm_ext.hooks",
    "vllm_ext.serving",
    "vllm_ext.weights.api",
    "vllm_ext.routes",
)


def all_patches() -> list[Patch]:
    return [p for m in PATCH_MODULES for p in importlib.import_module(m).PATCHES]


@functools.cache
def _providers() -> dict[str, list[str]]:
    """Import name -> the distributions that provide it, read once per process: it parses every
    installed distribution's file list (about a second beside vLLM), and each patch activated
    asks for it (20 times, 8 s, in each of a vLLM server's three processes when uncached)."""
    return importlib.metadata.packages_distributions()


def installed_version(requirement: str) -> str | None:
    """The installed version of the distribution that provides `requirement`'s import name (None if absent)."""
    name = Requirement(requirement).name
    dists = _providers().get(name) or [name]
    try:
        return importlib.metadata.version(dists[0])
    except importlib.metadata.PackageNotFoundError:
        return None


def in_range(requirement: str) -> bool:
    found = installed_version(requirement)
    return found is not None and Requirement(requirement).specifier.contains(found, prereleases=True)


_skipped: dict[str, tuple[Patch, str]] = {}
_listeners: list[Callable[[Patch, str], None]] = []


def skipped() -> dict[str, str]:
    """Optional patches this process skipped, with why."""
    return {name: why for name, (_, why) in _skipped.items()}


def on_skip(listener: Callable[[Patch, str], None]) -> None:
    """Call `listener(patch, why)` for every optional patch skipped, those skipped before included."""
    _listeners.append(listener)
    for patch, why in _skipped.values():
        listener(patch, why)


def _found(patch: Patch) -> str:
    package = Requirement(patch.versions).name
    return f"{package} {installed_version(patch.versions) or 'not installed'}"


def activate(selected: Iterable[Patch]) -> list[str]:
    """Apply each of `selected` that is needed, in order; returns the names applied now. Idempotent."""
    applied = []
    for patch in selected:
        if not patch.needed():
            continue
        problem = patch.probe()
        if problem is not None:
            why = (f"{patch.target}: {problem} (patch {patch.name} was written for {patch.versions}; found "
                   f"{_found(patch)})")
            if patch.required:
                raise PatchError(f"{why}. Install a version in that range (requirements/lock.txt), or update "
                                 f"the patch to the new upstream and its range")
            _skip(patch, why)
            continue
        if not in_range(patch.versions):
            logger.warning("moerl patch %s: written for %s, found %s; its probe passes, applying it",
                           patch.name, patch.versions, _found(patch))
        patch.apply()
        applied.append(patch.name)
    return applied


def _skip(patch: Patch, why: str) -> None:
    if patch.name in _skipped:
        return
    _skipped[patch.name] = (patch, why)
    logger.warning("moerl patch %s skipped, %s: %s", patch.name, patch.symptom, why)
    for listener in _listeners:
        listener(patch, why)


def resolve(target: str) -> tuple[Any, str]:
    """"pkg.mod:Class.attr" -> (the object holding `attr`, "attr"), importing the module."""
    module, _, path = target.partition(":")
    *owners, attr = path.split(".")
    owner: Any = importlib.import_module(module)
    for name in owners:
        owner = getattr(owner, name)
    return owner, attr


def probe_target(target: str, params: Sequence[str] | None = None) -> Callable[[], str | None]:
    """A probe: `target` ("pkg.mod:Class.attr") exists and, given `params`, has those parameter names
    (a wrapped target answers with its original's, through `__wrapped__`)."""

    def probe() -> str | None:
        try:
            owner, attr = resolve(target)
            obj = getattr(owner, attr)
        except (ImportError, AttributeError) as exc:
            return f"not found ({type(exc).__name__}: {exc})"
        if params is not None:
            found = list(inspect.signature(obj).parameters)
            if found != list(params):
                return f"parameters are ({', '.join(found)}), expected ({', '.join(params)})"
        return None

    return probe


_MARK = "_moerl_patch"


def wrapper_patch(name: str, target: str, wrap: Callable[[Callable], Callable], *, versions: str, upstream: str,
                  symptom: str, params: Sequence[str] | None = None, probe: Callable[[], str | None] | None = None,
                  applies: Callable[[], bool] = lambda: True, required: bool = True) -> Patch:
    """A Patch that replaces `target` ("pkg.mod:Class.attr") by `wrap(original)`.

    The probe (default: `probe_target(target, params)`) says whether the target still has the
    shape `wrap` expects; `wrap` keeps the original's name and signature (`functools.wraps`).
    `applies` says whether this kind of process has the target at all (a CPU-only class on
    a GPU build)."""

    def current() -> Any:
        owner, attr = resolve(target)
        return getattr(owner, attr)

    def needed() -> bool:
        if not applies():
            return False
        try:
            return getattr(current(), _MARK, None) != name
        except (ImportError, AttributeError):
            return True  # the probe says what is missing

    def apply() -> None:
        owner, attr = resolve(target)
        orig = getattr(owner, attr)
        if getattr(orig, _MARK, None) == name:
            return
        new = wrap(orig)
        setattr(new, _MARK, name)
        setattr(owner, attr, new)

    return Patch(name=name, target=target, versions=versions, upstream=upstream, symptom=symptom,
                 probe=probe or probe_target(target, params), needed=needed, apply=apply, required=required)


def setting_patch(name: str, target: str, value: Any, *, versions: str, upstream: str, symptom: str,
                  required: bool = False) -> Patch:
    """A Patch that sets an upstream config setting ("torch._functorch.config:flag") to `value`.

    The one place settings that may not exist are detected: where the setting is absent the
    probe says so, and the patch is skipped with a WARNING (optional) or stops the process
    (required), instead of an AttributeError or a silent `hasattr` branch."""

    def probe() -> str | None:
        try:
            owner, attr = resolve(target)
        except (ImportError, AttributeError) as exc:
            return f"not found ({type(exc).__name__}: {exc})"
        return None if hasattr(owner, attr) else "no such setting"

    def needed() -> bool:
        try:
            owner, attr = resolve(target)
            return getattr(owner, attr) != value
        except (ImportError, AttributeError):
            return True  # the probe says what is missing

    def apply() -> None:
        owner, attr = resolve(target)
        setattr(owner, attr, value)

    return Patch(name=name, target=target, versions=versions, upstream=upstream, symptom=symptom, probe=probe,
                 needed=needed, apply=apply, required=required)
