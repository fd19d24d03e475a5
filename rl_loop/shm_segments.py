"""The shared-memory segments a managed server maps, and removing them once nobody does.

vLLM keeps its engine-to-worker message queues (``psm_*``, 160-240 MiB each) and its
CPU tensor-parallel communicator (``vllm_dist_*``) in /dev/shm. A server killed by a
signal never unlinks them, and a TP>1 server leaves the communicator's even when it
exits cleanly: in CI that was about 400 MiB of /dev/shm per run. A replica's segments
are read from its processes' memory maps once it is healthy (vLLM has made them all
by then) and, when it is stopped, unlinked unless a live process still maps or holds
one (a trainer's weight ring that the replica had joined is left to its owner).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from vllm_ext.transport.shm import SHM_DIR


def _pids() -> list[int]:
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]


def _group_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[2])  # fields after "(comm)": state, ppid, pgrp


def _mapped(pid: int) -> set[str]:
    """/dev/shm paths that process `pid` maps or holds open."""
    out: set[str] = set()
    prefix = str(SHM_DIR) + "/"
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            if len(fields) == 6 and fields[5].startswith(prefix):
                out.add(fields[5].removesuffix(" (deleted)"))
        for fd in os.scandir(f"/proc/{pid}/fd"):
            target = os.readlink(fd.path)
            if target.startswith(prefix):
                out.add(target)
    except OSError:  # the process ended meanwhile, or is not ours to read
        pass
    return out


def group_segments(pgid: int) -> set[str]:
    """The /dev/shm paths mapped by the processes of group `pgid` (a server and its children)."""
    return {p for pid in _pids() if _group_of(pid) == pgid for p in _mapped(pid)}


def remove_unused(paths: Iterable[str]) -> list[str]:
    """Unlink those of `paths` that still exist and that no live process maps or holds; returns them."""
    left = [p for p in paths if os.path.exists(p)]
    if not left:
        return []
    in_use = set().union(*(_mapped(pid) for pid in _pids()))
    removed = []
    for p in left:
        if p not in in_use:
            try:
                os.unlink(p)
                removed.append(p)
            except FileNotFoundError:
                pass
    return removed
