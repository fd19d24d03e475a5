"""The GPU benchmarks' multi-process code on CPU/gloo: what the 2-GPU runs and the GPU check use.

`benchmarks.moe_ep` and `benchmarks.cp` are meant for H200s (`benchmarks.gpu_check` runs them
there under one process); here they run at tiny size on two gloo processes, so a broken mesh,
results file or skipped-case path shows in CI rather than in a GPU lease. Their figures are
not measurements.
"""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _run(argv, timeout=300):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_moe_ep_two_gloo_ranks_time_every_block_and_dispatcher(tmp_path):
    out = tmp_path / "ep.json"
    _run([*TORCHRUN, "-m", "benchmarks.moe_ep", "--flavor", "tiny", "--tokens", "64", "--iters", "1",
          "--models", "glm5", "--out", str(out)])
    ep = json.loads(out.read_text())["ep"]
    assert {c["dispatcher"] for c in ep["cases"]} == {"lean", "torchtitan"}
    lean = next(c for c in ep["cases"] if c["dispatcher"] == "lean")
    # bf16 and fp8, replay off and on, the EP=1 reference and the EP=2 block: 8 timed blocks
    assert sorted((r["dtype"], r["block"], r["ep"], r["replay"]) for r in lean["blocks"]) == sorted(
        (dt, role, ep_, rp) for dt in ("bf16", "fp8") for role, ep_ in (("reference", 1), ("ep", 2))
        for rp in (False, True))
    assert all(r["ms"] > 0 for r in lean["blocks"])
    assert lean["dispatch"]["cross_rank_bytes_per_rank"] > 0
    assert {(s["dtype"], s["best_dispatcher"]) for s in ep["summary"]} >= {("fp8", "lean")}


_OOM_ONE_CASE = textwrap.dedent("""
    import os, sys, torch
    import benchmarks.moe_ep as m
    real = m.case
    def case(model, tokens, *a):
        if tokens == 32:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 GiB")
        return real(model, tokens, *a)
    m.case = case
    sys.argv = ["moe_ep", "--flavor", "tiny", "--tokens", "32", "48", "--iters", "1", "--models", "glm5",
                "--dispatchers", "lean", "--skip-fp8", "--out", sys.argv[1]]
    m.main()
""")


def test_moe_ep_case_out_of_memory_is_reported_and_the_run_goes_on(tmp_path):
    out = tmp_path / "ep.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
          "--no-python", sys.executable, "-c", _OOM_ONE_CASE, str(out)])
    cases = json.loads(out.read_text())["ep"]["cases"]
    assert [c["tokens_per_rank"] for c in cases] == [32, 48]
    assert cases[0]["skipped"].startswith("OutOfMemoryError: CUDA out of memory") and "blocks" not in cases[0]
    assert "skipped" not in cases[1] and len(cases[1]["blocks"]) == 4


def test_cp_two_gloo_ranks(tmp_path):
    out = tmp_path / "cp.json"
    _run([*TORCHRUN, "-m", "benchmarks.cp", "--device", "cpu", "--flavor", "tiny", "--seq", "512",
          "--models", "glm5", "--iters", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    assert {"cp_layers", "cp_run", "indexer_topk"} <= res.keys()
