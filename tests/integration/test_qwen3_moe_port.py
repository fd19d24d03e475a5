"""titan_ext's Qwen3-MoE port (TorchTitan's Qwen3 MoE blocks) against transformers on tiny checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_moerl
from titan_ext.checkpoint import export_hf_checkpoint, load_hf_checkpoint, model_of_checkpoint
from titan_ext.models.qwen3_moe import FLAVORS, Qwen3MoEArch
from titan_ext.replay import moe_routers, replay_routing


def _check_parity(ckpt, *args):
    out = run_moerl("check-parity", "--hf-checkpoint", str(ckpt), "--model", "qwen3_moe", "--json", *args)
    return out.returncode, (json.loads(out.stdout) if out.returncode in (0, 1) else out.stderr)


@pytest.mark.parametrize("init_scale", [0.02, 0.1])
def test_qwen3_moe_parity(tiny_checkpoint, init_scale):
    code, report = _check_parity(tiny_checkpoint("qwen3_moe", init_scale), "--seq-len", "64")
    assert code == 0, report
    assert report["max_abs_logit_diff"] < 1e-4 and report["argmax_agreement"] == 1.0


def test_tiny_flavor_is_the_tiny_checkpoint(tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen3_moe")
    assert Qwen3MoEArch.from_hf_config(json.loads((ckpt / "config.json").read_text())) == FLAVORS["tiny"]
    assert model_of_checkpoint(ckpt) == "qwen3_moe"


def test_export_round_trip_and_replay_routers(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3_moe", 0.1)
    model, arch = load_hf_checkpoint(src, "qwen3_moe")
    out = export_hf_checkpoint(model, arch, tmp_path / "export")
    original, exported = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    # Every layer routes through the replaying router; replaying its own choice changes nothing.
    assert len(moe_routers(model)) == arch.n_layers
    tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    own = []
    hooks = [r.register_forward_hook(lambda m, i, o: own.append(o[1])) for r in moe_routers(model)]
    with torch.no_grad():
        ref = model(tokens)
    for h in hooks:
        h.remove()
    ids = torch.stack(own, dim=2)  # [B, S, L, K]
    with torch.no_grad(), replay_routing(model, ids) as routers:
        again = model(tokens)
    assert torch.equal(ref, again)
    assert len(routers) == arch.n_layers and all(r.disagreement == 0.0 for r in routers)
