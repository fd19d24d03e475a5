"""Apply a complete update to a served vLLM model: vLLM's layerwise reload, with each
MoE layer's experts loaded as one stacked tensor per projection.

The layerwise reload is the path a fresh load takes (weight loaders, then each layer's
``process_weights_after_loading``), so an update ends exactly where a fresh server
does. Its cost is per weight-loader call, not per byte: each call is bound, dry-run on
meta tensors to count what the layer has loaded, buffered, and run again when the
layer is complete. A checkpoint stores one tensor per expert and projection, so the
experts make almost all the calls: 576 of tiny Kimi-K2's 633 tensors, about 69,000 per
replica for Kimi-K2 1T without expert parallel. vLLM's ``RoutedExperts.weight_loader``
also takes all experts of a projection as one ``[E, ...]`` tensor (its full load, the
path of checkpoints that store experts fused), so ``ExpertStacks`` gathers a layer's
per-expert tensors into that stack as they stream in and makes one call per layer and
projection (9 for tiny Kimi-K2): the reload runs about 3x faster there, and the loaded
model is tensor-for-tensor the same. The sharded transport already carries experts
stacked (``plan.expert_groups``); their runs go into the same stacks.

Only experts a stack can place exactly are stacked: unquantized ones, every expert of
the layer local to this worker (no expert parallel or redundant experts), under the
names the checkpoint uses. Anything else takes the model's own ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..transport.format import WeightUpdateError
from ..transport.plan import expert_members

__all__ = ["ExpertStacks", "reload"]


@dataclass(frozen=True)
class _Slot:
    """Where one checkpoint tensor goes: expert ``expert`` of ``module.<param>`` as ``shard`` (w1, w2, w3)."""

    module: torch.nn.Module
    param: str
    expert: int
    shard: str


@dataclass
class _Stack:
    buf: torch.Tensor
    have: set[int] = field(default_factory=set)


class ExpertStacks:
    """Per-expert checkpoint tensors in, one ``[E, ...]`` weight-loader call per (layer, projection) out.

    Built once per served model (which tensors stack where); ``route`` then ``check`` per update."""

    def __init__(self, model: torch.nn.Module, names: Collection[str]):
        self.slots: dict[str, _Slot] = {}
        self.sizes: dict[tuple[int, str, str], int] = {}
        for module in model.modules():
            slots = _expert_slots(module)
            if slots and all(n in names for n in slots):
                self.slots.update(slots)
                for s in slots.values():
                    key = (id(s.module), s.param, s.shard)
                    self.sizes[key] = self.sizes.get(key, 0) + 1
        self.stacks: dict[tuple[int, str, str], tuple[_Slot, _Stack]] = {}

    def route(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``items`` less the expert tensors, which go into their stacks; a completed stack is
        loaded at once. An item may itself be a run of experts (``plan.expert_members``: the
        sharded transport's wire layout); where those cannot stack it passes on per expert."""
        self.stacks = {}
        for name, t in items:
            members = expert_members(name)
            if members is None:
                if (slot := self.slots.get(name)) is None:
                    yield name, t
                else:
                    self._put(slot, t.unsqueeze(0))
            elif all(m in self.slots for m in members):
                self._put(self.slots[members[0]], t)
            else:
                yield from zip(members, t.unbind(0))

    def _put(self, slot: _Slot, t: torch.Tensor) -> None:
        """Experts ``slot.expert`` .. + ``len(t)`` of ``slot``'s stack; a whole stack loads as it is."""
        key = (id(slot.module), slot.param, slot.shard)
        if len(t) == self.sizes[key]:
            _load(slot, t)
            return
        if key not in self.stacks:
            self.stacks[key] = (slot, _Stack(torch.empty((self.sizes[key], *t.shape[1:]), dtype=t.dtype)))
        _, stack = self.stacks[key]
        stack.buf[slot.expert:slot.expert + len(t)].copy_(t)
        stack.have.update(range(slot.expert, slot.expert + len(t)))
        if len(stack.have) == self.sizes[key]:
            del self.stacks[key]
            _load(slot, stack.buf)

    def check(self) -> None:
        """Every stack was completed: an update that lacks experts is refused (its callers check
        completeness before applying, so this is the last line, not the first)."""
        if self.stacks:
            raise WeightUpdateError("the update lacks experts of " + "; ".join(
                f"{slot.module.layer_name}.{slot.param} ({slot.shard}): has {len(stack.have)} of "
                f"{self.sizes[key]}" for key, (slot, stack) in self.stacks.items()))


def _load(slot: _Slot, stack: torch.Tensor) -> None:
    """The module's own weight loader (wrapped by the layerwise reload at call time), its full
    load: every expert of the projection at once."""
    param = getattr(slot.module, slot.param)
    param.weight_loader(param, stack, f"{slot.module.layer_name}.{slot.param}", slot.shard, 0)


def _expert_slots(module: torch.nn.Module) -> dict[str, _Slot]:
    """Checkpoint name -> slot for every expert tensor of ``module``, when its experts can be stacked."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    if not isinstance(module, RoutedExperts) or not isinstance(module.quant_method, UnquantizedFusedMoEMethod):
        return {}
    base = module.layer_name.removesuffix("experts")
    slots = {}
    for param, weight, expert, shard in module.get_expert_mapping():
        if module.expert_map_manager.map_global_to_local(expert) != expert:
            return {}  # expert parallel or redundant experts: the model's loader places them
        slots[f"{base}{weight}weight"] = _Slot(module, param.rpartition(".")[2] + "weight", expert, shard)
    experts: dict[tuple[str, str], list[int]] = {}
    for s in slots.values():
        experts.setdefault((s.param, s.shard), []).append(s.expert)
    if any(sorted(e) != list(range(len(e))) for e in experts.values()):
        return {}
    return slots


@torch.no_grad()
def reload(model: torch.nn.Module, model_config, items: Iterable[tuple[str, torch.Tensor]],
           stacks: ExpertStacks) -> None:
    """vLLM's layerwise reload of ``items`` (checkpoint names and tensors), the experts stacked."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    try:
        with disable_mtp_completeness_check():
            model.load_weights(stacks.route(items))
        stacks.check()
    finally:
        finalize_layerwise_reload(model, model_config)
