"""Stream a (sharded) titan_ext model's weights in HF layout, one layer at a time.

For weight sync to inference (``vllm_ext.weights`` consumes the stream; titan_ext
does not import it). The model may be plain, FSDP2-sharded, expert-parallel or
both: each parameter that is a ``DTensor`` is materialised with
``full_tensor()`` (a collective) **one layer group at a time** (the embeddings,
each decoder layer, then the final norm and LM head), converted to HF names and
shapes with the checkpoint adapter (grouped experts split per expert), yielded,
and dropped before the next group is gathered: peak extra memory per rank is one
layer, never the whole model.

Every rank of the model's process group must iterate ``iter_hf_weights`` in
lockstep (the gathers are collectives); typically rank 0 sends what it yields
and the others discard it (``drain``). ``hf_metadata`` gives the names, dtypes
and shapes of the whole stream without gathering anything (global DTensor
shapes on meta tensors), in the same order, so a receiver can check and size
the update before the first byte.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

__all__ = ["layer_groups", "hf_metadata", "iter_hf_weights", "drain", "adapter_for"]

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


def _to_hf(adapter, group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return adapter.to_hf(group)


def hf_metadata(model: torch.nn.Module, *, dtype: torch.dtype | None = None, adapter=None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(hf_name, dtype, shape) for everything ``iter_hf_weights`` yields, in order; no communication."""
    adapter = adapter or adapter_for(model)
    sd = _state(model)
    out = []
    for names in layer_groups(list(sd)):
        meta = {n: torch.empty(tuple(sd[n].shape), dtype=_wire_dtype(sd[n], dtype), device="meta") for n in names}
        for k, v in _to_hf(adapter, meta).items():
            out.append((k, v.dtype, tuple(v.shape)))
    return out


def _wire_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if (dtype is not None and t.dtype.is_floating_point) else t.dtype


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


@torch.no_grad()
def iter_hf_weights(model: torch.nn.Module, *, dtype: torch.dtype | None = None, adapter=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) layer by layer; call on every rank in lockstep.

    ``dtype`` casts floating tensors for the wire (e.g. bf16 for a bf16 server
    while training in fp32). Tensors are detached CPU tensors, contiguous."""
    adapter = adapter or adapter_for(model)
    sd = _state(model)
    for names in layer_groups(list(sd)):
        group = {}
        for n in names:
            t = _full(sd[n]).detach()
            if t.device.type != "cpu":
                t = t.cpu()
            group[n] = t.to(_wire_dtype(t, dtype))
        hf = _to_hf(adapter, group)
        del group
        for k, v in hf.items():
            yield k, v.contiguous()
        del hf


def drain(model: torch.nn.Module, **kw) -> None:
    """Take part in the gathers without keeping anything (non-sending ranks)."""
    for _ in iter_hf_weights(model, **kw):
        pass
