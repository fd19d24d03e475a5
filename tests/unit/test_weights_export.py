"""titan_ext.weights: HF-layout export layer by layer equals the checkpoint, sharded or not."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from titan_ext.weights import OwnedReader, hf_metadata, iter_hf_weights, layer_groups, owned_hf_slices

def test_layer_groups_keep_embeddings_first_and_head_last():
    names = ["tok_embeddings.weight", "layers.1.a", "layers.0.b", "layers.10.c", "layers.0.d", "norm.weight", "lm_head.weight"]
    assert layer_groups(names) == [["tok_embeddings.weight"], ["layers.0.b", "layers.0.d"], ["layers.1.a"],
                                   ["layers.10.c"], ["norm.weight", "lm_head.weight"]]


@pytest.mark.parametrize("arch,dtype", [("kimi_k2", "bfloat16"), ("glm5", "float32")])
def test_export_equals_checkpoint(tiny_checkpoint, arch, dtype):
    from titan_ext.checkpoint import load_hf_checkpoint

    ckpt = tiny_checkpoint(arch, 0.2, dtype)
    model, _ = load_hf_checkpoint(ckpt, arch)  # fp32 in the trainer
    ref = load_file(str(ckpt / "model.safetensors"))
    wire = getattr(torch, dtype)
    items = list(iter_hf_weights(model, dtype=wire))
    assert [(k, v.dtype, tuple(v.shape)) for k, v in items] == hf_metadata(model, dtype=wire)
    got = dict(items)
    assert len(got) == len(items)
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    # layer by layer: all of layer i before anything of layer i+1
    layer_of = [int(k.split(".")[2]) for k, _ in items if k.startswith("model.layers.")]
    assert layer_of == sorted(layer_of)
    # the sharded export's view of an unsharded model: every tensor whole, in the same order
    state = model.state_dict()
    owned = owned_hf_slices(model)
    assert [s.name for s in owned] == [k for k, _ in items]
    for s in owned:
        assert s.box == tuple((0, n) for n in s.shape) and torch.equal(OwnedReader(state, wire)(s, s.box), got[s.name])


@pytest.mark.slow
def test_export_from_fsdp2_shards(tiny_checkpoint):
    from tests.conftest import run_torchrun

    ckpt = tiny_checkpoint("kimi_k2", 0.2, "bfloat16")
    r = run_torchrun(2, "-m", "tests.unit.weights_export_worker", str(ckpt), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    line = next(l for l in r.stdout.splitlines() if "OK local" in l)
    local, full = map(int, line.split()[2::2])
    assert local < full * 0.6  # each rank holds about half: nothing was gathered up front
    assert "OK sharded hf" in r.stdout and "OK sharded wire" in r.stdout
