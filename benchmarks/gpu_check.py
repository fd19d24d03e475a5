"""The GPU check: every GPU path of titan_ext and the GPU benchmarks, on one GPU, in one command.

CI has no GPU, so a change that breaks the CUDA paths (a torch setting absent from the GPU
machines' torch, a process group that NCCL refuses, a benchmark that no longer fits) is caught
only by running this after every change to `titan_ext/`, `benchmarks/` or `patches/`
(`scripts/gpu_check.sh` installs the carried wheels first; docs/gpu.md says how). It runs,
each as its own process so one failure does not hide the next:

* ``train_kimi_k2``: `benchmarks.train_step` (the README's `torchtitan train --extension titan_ext`
  on Kimi-K2 ``bench``, fp8 and bf16);
* ``train_glm5``: `torchtitan train --extension titan_ext --model glm5 --flavor tiny
  --titan_ext.optimizer_offload --titan_ext.indexer_fp8` on the GPU (the indexer ranks as `moerl rl`
  trains it);
* ``kernels``: the Triton kernels' own test cases (``tests/unit/*_kernel_cases.py``: sparse MLA,
  the indexer, fp8 and block-fp8 quantisation, the lean dispatcher's combine/dispatch) on the
  real GPU instead of Triton's interpreter, fp32 ``tl.dot`` in IEEE precision;
* ``cp`` and ``moe_ep``: `benchmarks.cp` and `benchmarks.moe_ep` under
  ``torchrun --nproc_per_node 1`` at reduced size: the process-group and mesh code the 2-GPU
  runs use.

It writes a short JSON summary (each step's command, exit code, wall time and what it checked)
and exits non-zero if any step failed.

    python -m benchmarks.gpu_check --out benchmarks/results/gpu_check_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_CASES = "tests/unit/*_kernel_cases.py"
LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naif]+)")


@dataclass(frozen=True)
class Step:
    """One process of the check; `verify` reads what it wrote and says what it found (raising
    `CheckFailed` where the process exited 0 but its output is wrong)."""

    name: str
    argv: list[str]
    timeout_s: int
    verify: Callable[[str], dict]
    env: dict[str, str] | None = None


class CheckFailed(Exception):
    pass


def _torchtitan() -> str:
    exe = shutil.which("torchtitan")
    if exe is None:
        raise SystemExit("gpu_check: no `torchtitan` command on PATH: install the checkout (scripts/gpu_check.sh does)")
    return exe


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckFailed(f"{path} was not written: {e}") from None


def _verify_train_step(path: Path) -> Callable[[str], dict]:
    def verify(_log: str) -> dict:
        res = _json(path)
        out = {}
        for name in ("fp8", "bf16"):
            run = res.get("runs", {}).get(name)
            if not run or run.get("returncode") != 0 or not run.get("tps_median"):
                raise CheckFailed(f"train_step {name}: {run and run.get('log_tail', '')[-800:]}")
            out[name] = {"tokens_per_s": run["tps_median"], "mfu": round(run["mfu_vs_measured_dense_bf16"], 4),
                         "spread": run.get("tps_spread")}
        out["fp8_over_bf16"] = round(res["fp8_speedup_tokens_per_s"], 3)
        return out
    return verify


def _verify_losses(steps: int) -> Callable[[str], dict]:
    def verify(log: str) -> dict:
        losses = {int(s): float(v) for s, v in LOSS.findall(re.sub(r"\x1b\[[0-9;]*m", "", log))}
        if sorted(losses) != list(range(1, steps + 1)) or not all(math.isfinite(v) for v in losses.values()):
            raise CheckFailed(f"expected finite losses for steps 1..{steps}, log has {losses}")
        return {"losses": [losses[s] for s in sorted(losses)]}
    return verify


def _verify_pytest(log: str) -> dict:
    m = re.search(r"(\d+) passed", log)
    if not m or re.search(r"\d+ (failed|error)", log):
        raise CheckFailed("kernel cases did not all pass")
    return {"passed": int(m[1])}


def _verify_cp(path: Path) -> Callable[[str], dict]:
    def verify(_log: str) -> dict:
        res = _json(path)
        if not res:
            raise CheckFailed(f"{path} is empty")
        return {"keys": sorted(res)}
    return verify


def _verify_moe_ep(path: Path) -> Callable[[str], dict]:
    def verify(_log: str) -> dict:
        cases = _json(path).get("ep", {}).get("cases", [])
        ran = [c for c in cases if "blocks" in c]
        if not ran:
            raise CheckFailed(f"no moe_ep case ran: {cases}")
        return {"cases": len(ran), "skipped": [c["skipped"] for c in cases if "skipped" in c],
                "dispatchers": sorted({c["dispatcher"] for c in ran})}
    return verify


def steps(args, tmp: Path) -> list[Step]:
    py = sys.executable
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    train_out = Path(args.train_step_out) if args.train_step_out else tmp / "train_step.json"
    kernels = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(KERNEL_CASES))
    pytest_kernels = ([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *kernels] if kernels else
                      [py, "-c", f"raise SystemExit('no kernel case files match {KERNEL_CASES}')"])
    return [
        Step("train_kimi_k2", [py, "-m", "benchmarks.train_step", "--steps", str(args.train_steps),
                               "--short-seq-len", "0", "--out", str(train_out)], 300, _verify_train_step(train_out)),
        # optimizer offload's CUDA path (side-stream copies, pinned buffers) and the fp8-ranked
        # indexer that `moerl rl` trains with (train.indexer_fp8) run here
        Step("train_glm5", [_torchtitan(), "train", "--extension", "titan_ext", "--model", "glm5", "--flavor", "tiny",
                            "--training.steps", "3", "--dump_folder", str(tmp / "glm5"),
                            "--titan_ext.optimizer_offload", "--titan_ext.indexer_fp8"], 180, _verify_losses(3)),
        Step("kernels", pytest_kernels, 240, _verify_pytest,
             env={"TRITON_F32_DEFAULT": "ieee"}),
        Step("cp", [*torchrun, "-m", "benchmarks.cp", "--seq", "16384", "--iters", "1", "--out", str(tmp / "cp.json")],
             180, _verify_cp(tmp / "cp.json")),
        Step("moe_ep", [*torchrun, "-m", "benchmarks.moe_ep", "--tokens", "4096", "--iters", "2",
                        "--out", str(tmp / "moe_ep.json")], 240, _verify_moe_ep(tmp / "moe_ep.json")),
    ]


def run_step(step: Step) -> dict:
    t0 = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(step.env or {})}
    row = {"name": step.name, "command": " ".join(step.argv), "env": step.env or {}}
    try:
        proc = subprocess.run(step.argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=step.timeout_s)
        log, row["returncode"] = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log, row["returncode"] = f"{e.stdout or ''}{e.stderr or ''}", None
        row["error"] = f"timed out after {step.timeout_s} s"
    row["wall_s"] = round(time.time() - t0, 1)
    if row["returncode"] == 0:
        try:
            row["found"] = step.verify(log)
        except CheckFailed as e:
            row["error"] = str(e)
    elif "error" not in row:
        row["error"] = f"exit code {row['returncode']}"
    row["ok"] = "error" not in row
    if not row["ok"]:
        row["log_tail"] = log[-3000:]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/gpu_check_h200.json")
    ap.add_argument("--train-steps", type=int, default=3, help="steps of each Kimi-K2 training run (10 to re-measure)")
    ap.add_argument("--train-step-out", help="also keep benchmarks.train_step's JSON here")
    ap.add_argument("--only", nargs="+", help="run only these steps")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device: run it on a GPU machine (docs/gpu.md)")
    import triton

    t0 = time.time()
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "commit": os.environ.get("MOERL_COMMIT"), "command": " ".join(["python -m benchmarks.gpu_check", *sys.argv[1:]]),
               "steps": []}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for step in steps(args, Path(tmp)):
            if args.only and step.name not in args.only:
                continue
            row = run_step(step)
            summary["steps"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
            if not row["ok"]:
                print(row["log_tail"], file=sys.stderr, flush=True)
    summary["ok"] = all(r["ok"] for r in summary["steps"])
    summary["wall_s"] = round(time.time() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"gpu_check: {'ok' if summary['ok'] else 'FAILED'} in {summary['wall_s']} s -> {out}")
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
