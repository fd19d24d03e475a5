"""What the GPU benchmarks share: the EP=8 shapes, timing, and the results file they write into.

``moe_block``, ``dsa_layer`` and ``fp8_probe`` (one GPU) all write
``benchmarks/results/moe_block_h200.json``, each under its own keys, so that one run does not
drop the others' results: ``ResultsFile.update`` reads the file, replaces the keys it is given,
and writes it back. ``moe_ep`` (torchrun, 2+ GPUs) writes its key ``ep`` the same way, by default
into ``benchmarks/results/moe_ep_h200.json`` (an earlier dispatch-only run of it is in the block file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Local expert counts at EP=8 (384 / 8 and 256 / 8): what one GPU holds of the full models.
LOCAL_EXPERTS = {"kimi_k2": 48, "glm5": 32}
RESULTS = "benchmarks/results/moe_block_h200.json"


@dataclass(frozen=True)
class Clock:
    """Seconds since the run started, on every log line: the runs take minutes and are read as they go."""

    t0: float = field(default_factory=time.time)

    def log(self, *a) -> None:
        print(f"[{time.time() - self.t0:7.1f}s]", *a, flush=True)


@dataclass(frozen=True)
class ResultsFile:
    path: Path

    def read(self) -> dict:
        """The file's results; {} when it is missing or unreadable (a first run)."""
        try:
            return json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def update(self, part: dict) -> dict:
        """Replace ``part``'s keys in the file, keep every other key; returns the whole file's results.
        Called after each case, so a run cut short keeps what it measured."""
        res = {**self.read(), **part}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(res, indent=1))
        return res


def moe_arg_parser(doc: str, iters: int) -> argparse.ArgumentParser:
    """The options every MoE benchmark takes: the results file, token counts, models, timed runs."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--models", nargs="+", default=list(LOCAL_EXPERTS))
    ap.add_argument("--iters", type=int, default=iters)
    return ap


def run_info(module: str, launcher: str = "python") -> dict:
    """Where and how a run was made: the device, versions, and the command that repeats it."""
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": " ".join([launcher, "-m", module, *sys.argv[1:]]),
    }


def cuda_device() -> torch.device:
    """The GPU, with TF32 allowed for fp32 matmuls: the setting every committed run was made with."""
    torch.set_float32_matmul_precision("high")  # what torch.backends.cuda.matmul.allow_tf32 = True sets
    return torch.device("cuda")


def torchrun_mesh(cuda: bool, dim: str) -> tuple[torch.device, DeviceMesh]:
    """This torchrun process's device and a 1-D mesh over all of them, named ``dim``: NCCL with
    one GPU per process (``LOCAL_RANK``), or gloo on CPU for the small-size checks."""
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # NCCL's eager init wants an indexed device ("cuda:N"), not plain "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        cuda_device()
    dist.init_process_group("nccl" if cuda else "gloo", device_id=dev if cuda else None)
    return dev, init_device_mesh(dev.type, (dist.get_world_size(),), mesh_dim_names=(dim,))


def timed(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median milliseconds of fn() over iters runs, after warmup runs (CUDA events)."""
    return timed_interleaved([fn], iters, warmup)[0]


def timed_interleaved(fns: Sequence[Callable[[], object]], iters: int, warmup: int) -> list[float]:
    """Median milliseconds of each fn, run in turn round after round.

    The H200's clocks drift by a few percent between seconds-apart measurements of the same
    GEMMs; interleaving exposes the cases compared with each other (roofline, replay off/on)
    to the same drift.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
    return [statistics.median(ts) for ts in times]


def dense_bf16_tflops(n: int = 8192, iters: int = 20, warmup: int = 3) -> float:
    """The GPU's dense bf16 rate: median TFLOP/s of an n^3 `torch.matmul` on random data.

    The yardstick for "fraction of the device": measured in the same run as the figures
    compared with it, since these shared GPUs' clocks differ between leases."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = timed(lambda: a @ b, iters, warmup)
    return 2 * n**3 / ms / 1e9


def zero_grads(m: torch.nn.Module) -> None:
    for p in m.parameters():
        p.grad = None
