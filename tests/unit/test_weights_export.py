"""titan_ext.weights: HF-layout export layer by layer equals the checkpoint, sharded or not."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from titan_ext.weights import OwnedReader, hf_metadata, iter_hf_weights, layer_groups, owned_hf_slices

ROOT = Path(__file__).resolve().parents[2]


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


WORKER = textwrap.dedent('''
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    import titan_ext  # noqa: F401 (patches)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from safetensors.torch import load_file
    from titan_ext.checkpoint import load_hf_checkpoint
    from titan_ext.weights import hf_metadata, iter_hf_weights
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, _ = load_hf_checkpoint(sys.argv[2], "kimi_k2")
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.layers.values():
        # FSDP2 shards every parameter on dim 0; for the grouped experts that
        # is the expert dim, i.e. the layout expert parallelism gives them.
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    assert len(sharded) == len(list(model.parameters())), "every parameter must be sharded"
    local = sum(p.to_local().numel() for p in model.parameters())
    full = sum(p.numel() for p in model.parameters())
    meta = hf_metadata(model, dtype=torch.bfloat16)
    peak = 0
    out = {}
    for k, v in iter_hf_weights(model, dtype=torch.bfloat16):
        out[k] = v
    if rank == 0:
        ref = load_file(sys.argv[2] + "/model.safetensors")
        assert [(k, v.dtype, tuple(v.shape)) for k, v in out.items()] == meta
        assert set(out) == set(ref), set(out) ^ set(ref)
        bad = [k for k in ref if not torch.equal(out[k], ref[k])]
        assert not bad, bad[:5]
        print(f"OK local {local} of {full}")
    # sharded export: this rank's boxes read from its own shard equal the checkpoint's, and
    # the plan over both ranks' boxes tiles every tensor exactly (buffers, which FSDP2 leaves
    # whole on every rank, are sent by one of them; nothing gathered)
    from titan_ext.weights import OwnedReader, owned_hf_slices
    from vllm_ext.transport.plan import check_cover, reshard
    ref = load_file(sys.argv[2] + "/model.safetensors")
    state = model.state_dict()
    mine = owned_hf_slices(model)
    read = OwnedReader(state, torch.bfloat16)
    for s in mine:
        want = ref[s.name][tuple(slice(a, b) for a, b in s.box)]
        assert torch.equal(read(s, s.box), want), s
    # the same in the sharded transport's wire layout (each rank's experts of a stack read in one piece)
    from tests.conftest import wire_tensors
    from titan_ext.weights import wire_slices
    from vllm_ext.transport.plan import expert_groups
    groups = expert_groups({k: tuple(v.shape) for k, v in ref.items()})
    wire = wire_tensors(ref)
    assert len(wire) < len(ref)
    mine_wire = wire_slices(mine, groups)
    for s in mine_wire:
        assert torch.equal(read(s, s.box), wire[s.name][tuple(slice(a, b) for a, b in s.box)]), s
    for layout, slices in (("hf", mine), ("wire", mine_wire)):
        boxes = [None, None]
        dist.all_gather_object(boxes, [(s.name, s.box) for s in slices])
        if rank == 0:
            owned = {}
            for r, lst in enumerate(boxes):
                for n, b in lst:
                    owned.setdefault(n, []).append((r, b))
            full = ref if layout == "hf" else wire
            need = {k: tuple((0, d) for d in v.shape) for k, v in full.items()}
            why = check_cover(reshard(list(need), owned, [need]), need)
            assert why is None, why
            print(f"OK sharded {layout} {len(boxes[0])} + {len(boxes[1])} boxes")
    dist.barrier()  # rank 1 must not tear gloo down while rank 0 still checks (SIGABRT otherwise)
    dist.destroy_process_group()
''')


@pytest.mark.slow
def test_export_from_fsdp2_shards(tiny_checkpoint, tmp_path):
    from tests.conftest import run_torchrun

    ckpt = tiny_checkpoint("kimi_k2", 0.2, "bfloat16")
    script = tmp_path / "export_worker.py"
    script.write_text(WORKER)
    r = run_torchrun(2, str(script), str(ROOT), str(ckpt), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    line = next(l for l in r.stdout.splitlines() if "OK local" in l)
    local, full = map(int, line.split()[2::2])
    assert local < full * 0.6  # each rank holds about half: nothing was gathered up front
    assert "OK sharded hf" in r.stdout and "OK sharded wire" in r.stdout
