"""The run directory: the whole protocol between the orchestrator and the trainer ranks.

Each side only writes files and reads the other's, so either can be restarted on its own
(`moerl rl --resume`):
    batches/step_NNNNNN.pt       written by the orchestrator
    weights/vNNNNNN/             policy version N in HF layout (vllm_ext.transport filesystem transport;
                                 with a sharded lane only at checkpoint steps, for --resume)
    sync/vNNNNNN/rank{r}.json    sharded lanes: rank r's senders' join info for version N (rl_loop.weight_lane)
    trainer/metrics_NNNNNN.json  loss and mismatch metrics of step N
    trainer/checkpoint/          TorchTitan checkpoints
Every file the other side polls for is written with `write_atomic`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["batch_path", "weights_dir", "metrics_path", "write_atomic"]


def batch_path(run_dir: Path, step: int) -> Path:
    return run_dir / "batches" / f"step_{step:06d}.pt"


def weights_dir(run_dir: Path, version: int) -> Path:
    return run_dir / "weights" / f"v{version:06d}"


def metrics_path(run_dir: Path, step: int) -> Path:
    return run_dir / "trainer" / f"metrics_{step:06d}.json"


def write_atomic(path: Path, writer: Callable[[Path], object]) -> None:
    """`writer(tmp)`, then rename tmp to `path`: readers see the whole file or none. The temporary
    name is per process and thread, so threads may write at once (the orchestrator's write-offs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.{threading.get_ident()}")
    writer(tmp)
    os.replace(tmp, path)
