"""Which lane carries new weights to the replicas in `moerl rl`, and the files both ends meet at.

Lanes (benchmarks/results/weight_sync.json, section moerl_rl_sync). 'auto' is `shm` for managed
replicas (they run on this host): it measured faster per step than `fs` at the main job's size;
`fs` where shm cannot work, for external replicas (`inference.endpoints`: the run directory is
what they are sure to share) and for block-fp8 checkpoints (only `fs` exports those).
  shm  every trainer rank streams only the slices it owns (vllm_ext.transport.sharded), each
       replica reads them from shared-memory rings: same host only;
  net  the same pieces over gloo (TCP): replicas on other hosts;
  te   the same pieces pulled by the replicas with Mooncake Transfer Engine (P2P, no master;
       TCP here, RDMA where the cluster has it); only when asked for: over TCP on loopback
       it measured below gloo here;
  fs   rank 0 gathers every layer and writes safetensors + a commit marker to the run dir;
       the replicas read the whole version: any host with the run dir mounted, block-fp8
       checkpoints, and the fallback.

The sharded lanes meet through the run directory: for version N every trainer rank writes
`sync/vNNNNNN/rank{r}.json` (its senders' join info per replica) and then sends; the
orchestrator, once all ranks' files are there, drives each replica's update (pause, update
naming every rank's sender, resume) while the ranks send. A replica that is out of rotation,
or whose update request fails (it died, it refused), is written off for that version as
`sync/vNNNNNN/lost-r{i}` (why, one line) the moment the orchestrator knows: the ranks' senders
poll for it and drop that replica's lanes instead of waiting out their timeout, and every
other replica's update runs to its end.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from .run_dir import write_atomic

__all__ = ["LaneChoice", "choose_lane", "sync_dir", "read_infos", "write_off", "written_off"]


@dataclass(frozen=True)
class LaneChoice:
    lane: str  # "shm", "net" or "fs"
    why: str


def choose_lane(requested: str, *, block_fp8: bool, shm_problem: str | None, managed: bool = True) -> LaneChoice:
    """The lane for this run: the requested one if it can work here, else one clear error;
    under 'auto' the fastest that works (see the module docstring). ``managed``: the
    replicas are `moerl rl`'s own, on this host."""
    if requested == "auto":
        if block_fp8:
            return LaneChoice("fs", "auto: the checkpoint is block-fp8, which only fs carries")
        if not managed:
            return LaneChoice("fs", "auto: external replicas (inference.endpoints) share the run directory, not "
                                    "this host's memory; set inference.weight_sync = 'net' to stream to them")
        if shm_problem:
            return LaneChoice("fs", f"auto: no shared-memory lane here ({shm_problem})")
        return LaneChoice("shm", "auto: managed replicas on this host; measured faster per step than fs "
                                 "(benchmarks/results/weight_sync.json, moerl_rl_sync)")
    if requested != "fs" and block_fp8:
        raise ValueError(f"inference.weight_sync = '{requested}' streams plain tensors, but the checkpoint is "
                         "block-fp8: use 'fs' (or 'auto')")
    from vllm_ext.transport.te import te_problem

    if requested == "te" and (problem := te_problem()):
        raise ValueError(f"inference.weight_sync = 'te' cannot work here ({problem}): use 'net' or 'auto'")
    if requested == "shm" and shm_problem:
        raise ValueError(f"inference.weight_sync = 'shm' cannot work here ({shm_problem}): use 'net' or 'auto'")
    return LaneChoice(requested, "set by inference.weight_sync")


def sync_dir(run_dir: Path, version: int) -> Path:
    return run_dir / "sync" / f"v{version:06d}"


def read_infos(run_dir: Path, version: int, ranks: int, *, alive=lambda: None, timeout_s: float = 3600.0
               ) -> list[list[dict]]:
    """Every trainer rank's senders' join info for `version`: [rank][replica]."""
    d = sync_dir(run_dir, version)
    deadline = time.time() + timeout_s
    while not all((d / f"rank{r}.json").exists() for r in range(ranks)):
        alive()
        if time.time() > deadline:
            raise TimeoutError(f"trainer ranks did not offer weights v{version} after {timeout_s:.0f}s")
        time.sleep(0.02)
    return [json.loads((d / f"rank{r}.json").read_text()) for r in range(ranks)]


def _lost_path(run_dir: Path, version: int, replica: int) -> Path:
    return sync_dir(run_dir, version) / f"lost-r{replica}"


def write_off(run_dir: Path, version: int, replica: int, why: str) -> None:
    """Tell the trainer ranks that replica `replica` (its index) will not take `version`, and why."""
    write_atomic(_lost_path(run_dir, version, replica), lambda tmp: tmp.write_text(why))


def written_off(run_dir: Path, version: int, replica: int) -> str | None:
    """Why replica `replica` will not take `version`, or None (it may still)."""
    try:
        return _lost_path(run_dir, version, replica).read_text() or "written off"
    except FileNotFoundError:
        return None
