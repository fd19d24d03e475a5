"""Stream a (sharded) titan_ext model's weights in HF layout, in layer order.

For weight sync to inference (``vllm_ext.transport`` carries the stream; titan_ext
does not import it). The model may be plain, FSDP2-sharded, expert-parallel or
both: each parameter that is a ``DTensor`` is materialised with
``full_tensor()`` (a collective) **one tensor at a time**, in layer order (the
embeddings, each decoder layer, then the final norm and LM head), converted to HF
names and shapes with the checkpoint adapter (grouped experts split per expert),
yielded, and dropped before the next is gathered: peak extra memory per rank is
one tensor, never the whole model.

When the replicas serve a block-fp8 checkpoint (``quant``, from
``titan_ext.checkpoint.checkpoint_quantization``), the weights that checkpoint stores
in fp8 are quantized where the gathered tensor lives (``models.block_fp8``: the Triton
kernel on CUDA, torch on CPU) and each is followed by its ``*_scale_inv``.

Every rank of the model's process group must iterate ``iter_hf_weights`` in
lockstep (the gathers are collectives); typically rank 0 sends what it yields
and the others discard it (``drain``). ``hf_metadata`` gives the names, dtypes
and shapes of the whole stream without gathering anything (global DTensor
shapes on meta tensors), in the same order, so a receiver can check and size
the update before the first byte.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from .models.block_fp8 import FP8, SCALE_SUFFIX, BlockFp8Config, quantize, scale_shape

__all__ = ["layer_groups", "hf_metadata", "iter_hf_state", "iter_hf_weights", "drain", "adapter_for", "OwnedSlice",
           "owned_hf_slices", "wire_slices", "OwnedReader"]

_LAYER = re.compile(r"^layers\.(\d+)\.")


def adapter_for(model: torch.nn.Module):
    from .models.state_dict_adapter import MLAMoEStateDictAdapter

    return MLAMoEStateDictAdapter(model.config)


def layer_groups(names: list[str]) -> list[list[str]]:
    """Partition titan state-dict names: [pre (embeddings)], one per decoder layer in order, [post]."""
    pre: list[str] = []
    post: list[str] = []
    layers: dict[int, list[str]] = {}
    for n in names:
        m = _LAYER.match(n)
        if m:
            layers.setdefault(int(m.group(1)), []).append(n)
        elif not layers:
            pre.append(n)
        else:
            post.append(n)
    return ([pre] if pre else []) + [layers[i] for i in sorted(layers)] + ([post] if post else [])


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items()}


def _meta(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(tuple(t.shape), dtype=dtype or t.dtype, device="meta")


def _quantized(adapter, name: str, t: torch.Tensor, quant: BlockFp8Config | None) -> list[str] | None:
    """The HF names of titan tensor `name` if `quant` stores them in block fp8, else None."""
    if quant is None:
        return None
    hf_names = list(adapter.to_hf({name: _meta(t)}))
    per_matrix = t.shape[-2:] if t.dim() == 3 and len(hf_names) == t.shape[0] else tuple(t.shape)
    return hf_names if all(quant.quantizes(k, tuple(per_matrix)) for k in hf_names) else None


def hf_metadata(model: torch.nn.Module, *, dtype: torch.dtype | None = None, adapter=None,
                quant: BlockFp8Config | None = None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(hf_name, dtype, shape) for everything ``iter_hf_weights`` yields, in order; no communication."""
    adapter = adapter or adapter_for(model)
    sd = _state(model)
    out = []
    for names in layer_groups(list(sd)):
        for n in names:
            hf_names = _quantized(adapter, n, sd[n], quant)
            if hf_names is None:
                for k, v in adapter.to_hf({n: _meta(sd[n], _wire_dtype(sd[n], dtype))}).items():
                    out.append((k, v.dtype, tuple(v.shape)))
                continue
            shape = tuple(sd[n].shape[-2:])
            for k in hf_names:
                out += [(k, FP8, shape), (k + SCALE_SUFFIX, torch.float32, scale_shape(shape, quant.block))]
    return out


def _wire_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if (dtype is not None and t.dtype.is_floating_point) else t.dtype


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _quantize_sharded(t: torch.Tensor, quant: BlockFp8Config, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8, scale_inv) of the full tensor `t`.

    Grouped experts sharded only on the expert dim (FSDP2's and expert parallel's layout) are
    quantized where each rank holds them and gathered as fp8 + scales: half the bytes of
    gathering bf16, and each rank quantizes its own experts. Anything else (row-sharded 2-D
    weights, whose shards need not align with 128-row blocks) is gathered first."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(t, DTensor) and t.dim() == 3
            and all(p.is_replicate() or p.is_shard(0) for p in t.placements)):
        return quantize(_full(t), quant.block, name)
    q, s = quantize(t.to_local(), quant.block, name)

    def gather(local: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=torch.Size(shape),
                                  stride=stride).full_tensor()

    # fp8 travels as bytes: collectives (gloo) need not know the dtype
    return gather(q.view(torch.uint8), tuple(t.shape)).view(FP8), gather(s, scale_shape(tuple(t.shape), quant.block))


@torch.no_grad()
def iter_hf_state(state: Mapping[str, torch.Tensor], adapter, *, dtype: torch.dtype | None = None,
                  quant: BlockFp8Config | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for a titan state dict, layer by layer (see ``iter_hf_weights``).

    With ``quant``, each weight the published layout stores in block fp8 is cast to ``dtype``
    and quantized on the device it lives on (a layer's grouped experts in one call: on CUDA
    one Triton launch; sharded experts before the gather), and crosses to the CPU as fp8
    plus its float32 ``*_scale_inv``, in that order."""
    for names in layer_groups(list(state)):
        for n in names:
            t = state[n].detach()
            t = t.to(_wire_dtype(t, dtype))
            hf_names = _quantized(adapter, n, t, quant)
            if hf_names is None:
                hf = adapter.to_hf({n: _full(t).cpu()})
                yield from ((k, v.contiguous()) for k, v in hf.items())
                continue
            q, s = _quantize_sharded(t, quant, hf_names[0])
            q, s = q.cpu(), s.cpu()
            pairs = zip(q.unbind(0), s.unbind(0)) if len(hf_names) > 1 else [(q, s)]
            for k, (qk, sk) in zip(hf_names, pairs):
                yield k, qk.contiguous()
                yield k + SCALE_SUFFIX, sk.contiguous()
            del t, q, s


def iter_hf_weights(model: torch.nn.Module, *, dtype: torch.dtype | None = None, adapter=None,
                    quant: BlockFp8Config | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) layer by layer; call on every rank in lockstep.

    ``dtype`` casts floating tensors for the wire (e.g. bf16 for a bf16 server
    while training in fp32); ``quant`` (``titan_ext.checkpoint.checkpoint_quantization`` of the
    checkpoint the replica serves) sends its block-fp8 weights as such. Tensors are detached
    CPU tensors, contiguous."""
    yield from iter_hf_state(_state(model), adapter or adapter_for(model), dtype=dtype, quant=quant)


def drain(model: torch.nn.Module, **kw) -> None:
    """Take part in the gathers without keeping anything (non-sending ranks)."""
    for _ in iter_hf_weights(model, **kw):
        pass


# ----------------------------------------------------------------------------- sharded export


Box = tuple[tuple[int, int], ...]  # [start, stop) per dim of the global (HF) tensor


@dataclass(frozen=True)
class OwnedSlice:
    """What this rank holds of HF tensor ``name`` (global ``shape``): ``box``, read from
    titan tensor ``source``. Of a grouped-experts tensor: expert ``expert`` (a 2-D HF
    tensor), or, for a stack of experts (``wire_slices``), the experts from ``expert`` on;
    else None."""

    name: str
    shape: tuple[int, ...]
    box: Box
    source: str
    expert: int | None = None


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of ``t``, detached (a DTensor's own ``detach`` costs a sharding
    propagation: its local tensor's does not)."""
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _box(t: torch.Tensor) -> Box:
    """The box of the global tensor that this rank's local tensor of ``t`` holds; no communication."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return tuple((0, int(n)) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple((int(o), int(o) + int(n)) for o, n in zip(offset, shape))


def owned_hf_slices(model: torch.nn.Module, *, adapter=None) -> list[OwnedSlice]:
    """This rank's slices of every HF tensor, in ``iter_hf_weights`` order, without gathering.

    FSDP2 and expert parallel shard titan tensors on dim 0: a 2-D weight's shard is a row
    block of the HF tensor (the adapter renames it, same layout), a grouped-experts shard is
    whole experts (the adapter splits experts into HF tensors of their own). Ranks holding
    replicas of the same bytes all list them; the planner picks one sender."""
    adapter = adapter or adapter_for(model)
    sd = _state(model)
    out: list[OwnedSlice] = []
    for names in layer_groups(list(sd)):
        for n in names:
            local, box = _local(sd[n]), _box(sd[n])
            if local.numel() == 0:
                continue
            hf = adapter.to_hf({n: _meta(sd[n])})
            if len(hf) == 1:
                (k, v), = hf.items()
                if tuple(v.shape) != tuple(sd[n].shape):
                    raise NotImplementedError(f"{n} -> {k}: reshaped on export; sharded export cannot slice it")
                out.append(OwnedSlice(k, tuple(sd[n].shape), box, n))
                continue
            if len(hf) != sd[n].shape[0]:
                raise NotImplementedError(f"{n}: {len(hf)} HF tensors for dim 0 of {list(sd[n].shape)}")
            for e, (k, v) in enumerate(hf.items()):
                if box[0][0] <= e < box[0][1]:
                    out.append(OwnedSlice(k, tuple(v.shape), box[1:], n, e))
    return out


def wire_slices(slices: list[OwnedSlice], groups: Mapping[str, list[str]]) -> list[OwnedSlice]:
    """``slices`` in the sharded transport's wire layout (``groups``: ``plan.expert_groups``):
    this rank's experts of each stack as one slice of it, read from the grouped-experts
    tensor in one piece."""
    by_name = {s.name: s for s in slices}
    out: list[OwnedSlice] = []
    for g, members in groups.items():
        mine = [by_name[m] for m in members if m in by_name]
        if members == [g] or not mine:
            out.extend(mine)
            continue
        lo = members.index(mine[0].name)
        hi, start = lo + len(mine), mine[0].expert - lo  # start: the stack's first expert
        if (any(s.source != mine[0].source or s.box != mine[0].box for s in mine)
                or [s.expert for s in mine] != list(range(start + lo, start + hi))):
            raise NotImplementedError(f"{g}: this rank's experts are not one run of one tensor")
        out.append(OwnedSlice(g, (len(members), *mine[0].shape), ((lo, hi), *mine[0].box), mine[0].source, start))
    return out


class OwnedReader:
    """Reads sub-boxes of this rank's owned slices for one update.

    Each titan tensor's local shard is found once per update, on first use (FSDP2 may
    hand out other local tensors after a step), its box once per reader chain: pass the
    last update's reader as ``after``. DTensor's offset computation costs about as much as
    copying a small piece, and doing it per piece made it most of a sharded send's time."""

    def __init__(self, model_state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
                 after: OwnedReader | None = None):
        self.state, self.dtype = model_state, dtype
        self.local: dict[str, torch.Tensor] = {}
        self.boxes: dict[str, Box] = after.boxes if after is not None else {}

    @torch.no_grad()
    def __call__(self, s: OwnedSlice, box: Box) -> torch.Tensor:
        """Sub-box ``box`` (global coordinates, inside ``s.box``) of ``s``, as a contiguous
        CPU tensor in the reader's dtype: only that piece is copied."""
        if (local := self.local.get(s.source)) is None:
            local = self.local[s.source] = _local(self.state[s.source])
        if (lbox := self.boxes.get(s.source)) is None:
            lbox = self.boxes[s.source] = _box(self.state[s.source])
        if s.expert is not None and len(box) == local.dim():  # a stack of experts from s.expert on
            lbox = ((lbox[0][0] - s.expert, lbox[0][1] - s.expert), *lbox[1:])
        elif s.expert is not None:
            local, lbox = local[s.expert - lbox[0][0]], lbox[1:]
        idx = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(box, lbox))
        piece = local[idx] if idx else local
        return piece.to(device="cpu", dtype=_wire_dtype(piece, self.dtype)).contiguous()
