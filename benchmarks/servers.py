"""vLLM servers for the benchmarks that measure one (routing_codec, weight_sync): started as
`moerl rl` starts its replicas (`rl_loop.replicas`), each on a free port, stopped on exit.

The benchmarks' own helper, not the tests': benchmarks do not import tests/.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rl_loop.replicas import Replica, start_replica, stop_replica, wait_healthy

__all__ = ["cpu_seconds", "free_port", "process_tree", "served"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list:
    """A server's processes (API server, engine core, workers) as psutil.Process objects."""
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(procs) -> float:
    """User + system CPU seconds of `procs` so far (one that exited counts nothing)."""
    import psutil

    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


@contextmanager
def served(name: str, ckpt: Path, log_dir: Path, *, dtype: str, env: dict | None = None,
           **replica_args) -> Iterator[Replica]:
    """One healthy server of `ckpt` (plugin loaded, dev-mode routes, the moerl weight backend);
    `replica_args` go to `rl_loop.replicas.start_replica`."""
    replica = start_replica(name, ckpt, free_port(), log_dir, dtype=dtype, env=env, **replica_args)
    try:
        wait_healthy([replica], timeout_s=600)
        yield replica
    finally:
        stop_replica(replica)
