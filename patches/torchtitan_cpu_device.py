"""torchtitan 0.3.0 assumes an accelerator: with none it picks "cuda" anyway.

`torchtitan.tools.utils.get_device_info()` falls back to `"cuda"` when no
accelerator is found, so on a CPU-only machine with PyPI's CUDA torch build the
Trainer dies in `torch.cuda.set_device` ("Found no NVIDIA driver"). Several
modules copied `device_type`/`device_module` at import time, so each copy is
rebound to a CPU device module. `torch.cpu` lacks the memory-monitor calls the
metrics use, so those report the process's resident memory instead. Only applied
when there is no accelerator.
"""

import importlib
import os
import resource
import types

import torch

from . import Patch

# Modules that did `from torchtitan.tools.utils import device_type, device_module`.
_HOLDERS = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiler",
)


def _cpu_device_module() -> types.ModuleType:
    mod = types.ModuleType("moerl_cpu_device")
    mod.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")})
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def memory_stats(device=None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    mod.current_device = lambda: 0  # an index, as callers pass it on as device_ids
    mod.get_device_name = lambda device=None: "cpu"
    mod.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=total, name="cpu")
    mod.memory_stats = memory_stats
    mod.reset_peak_memory_stats = lambda device=None: None
    mod.empty_cache = lambda: None
    return mod


def _needed() -> bool:
    if torch.accelerator.is_available():
        return False
    utils = importlib.import_module("torchtitan.tools.utils")
    return utils.device_type != "cpu"


def _probe() -> str | None:
    try:
        holders = [importlib.import_module(name) for name in _HOLDERS]
    except ImportError as exc:
        return f"a module that held the device moved: {exc}"
    bare = [name for name, mod in zip(_HOLDERS, holders) if not hasattr(mod, "device_type")
            and not hasattr(mod, "device_module")]
    return f"no device_type/device_module in {', '.join(bare)}" if bare else None


def _apply() -> None:
    cpu = _cpu_device_module()
    for name in _HOLDERS:
        mod = importlib.import_module(name)
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = cpu


PATCH = Patch(
    name="torchtitan_cpu_device",
    target="torchtitan.tools.utils:device_module",
    versions="torchtitan>=0.3,<0.4",
    upstream="torchtitan 0.3.0 (tools/utils.py get_device_info) on a machine without accelerator",
    symptom="RuntimeError: Found no NVIDIA driver on your system (Trainer.__init__ -> torch.cuda.set_device)",
    probe=_probe,
    needed=_needed,
    apply=_apply,
)
PATCHES = (PATCH,)
