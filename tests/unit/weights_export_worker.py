"""One FSDP2 rank of test_weights_export's sharded export (run by it under torchrun from the
repository root: ``torchrun --nproc_per_node 2 -m tests.unit.weights_export_worker CKPT``)."""

import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

from tests.conftest import wire_tensors  # noqa: E402
from titan_ext.checkpoint import load_hf_checkpoint  # noqa: E402
from titan_ext.weights import OwnedReader, hf_metadata, iter_hf_weights, owned_hf_slices, wire_slices  # noqa: E402
from vllm_ext.transport.plan import check_cover, expert_groups, reshard  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
model, _ = load_hf_checkpoint(sys.argv[1], "kimi_k2")
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
    ref = load_file(sys.argv[1] + "/model.safetensors")
    assert [(k, v.dtype, tuple(v.shape)) for k, v in out.items()] == meta
    assert set(out) == set(ref), set(out) ^ set(ref)
    bad = [k for k in ref if not torch.equal(out[k], ref[k])]
    assert not bad, bad[:5]
    print(f"OK local {local} of {full}")
# sharded export: this rank's boxes read from its own shard equal the checkpoint's, and
# the plan over both ranks' boxes tiles every tensor exactly (buffers, which FSDP2 leaves
# whole on every rank, are sent by one of them; nothing gathered)
ref = load_file(sys.argv[1] + "/model.safetensors")
state = model.state_dict()
mine = owned_hf_slices(model)
read = OwnedReader(state, torch.bfloat16)
for s in mine:
    want = ref[s.name][tuple(slice(a, b) for a, b in s.box)]
    assert torch.equal(read(s, s.box), want), s
# the same in the sharded transport's wire layout (each rank's experts of a stack read in one piece)
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
