"""Shared by the RL benchmarks: run `moerl rl` with overrides and read its per-step metrics."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOERL = [sys.executable, "-m", "rl_loop"]


def run_rl(config: str, run_dir: Path, overrides: dict[str, object]) -> list[dict]:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [*MOERL, "rl", "--config", config, "--set", f"run_dir={run_dir}"]
    for k, v in overrides.items():
        cmd += ["--set", f"{k}={json.dumps(v) if isinstance(v, bool) else v}"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def machine() -> dict:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": __import__("os").cpu_count(),
            "machine": platform.machine()}
