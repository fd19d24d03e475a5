"""Parameter counts of a model spec, computed on the meta device (no memory, any size)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .models import get_arch, spec_from_arch


@dataclass
class ModelInfo:
    model: str
    flavor: str
    total_params: int
    active_params: int
    embedding_params: int
    routed_expert_params: int
    num_layers: int
    num_moe_layers: int
    num_experts: int
    top_k: int

    def to_dict(self) -> dict:
        return asdict(self)


def model_info(model: str, flavor: str) -> ModelInfo:
    """Active = everything a token touches: all non-routed weights plus top_k of each layer's experts."""
    arch = get_arch(model, flavor)
    spec = spec_from_arch(model, flavor, arch)
    with torch.device("meta"):
        m = spec.model.build()
    total = routed = embedding = 0
    for name, p in m.named_parameters():
        total += p.numel()
        if ".routed_experts." in name:
            routed += p.numel()
        if name.startswith("tok_embeddings."):
            embedding += p.numel()
    active = total - routed + routed * arch.top_k // arch.num_experts
    return ModelInfo(
        model=model,
        flavor=flavor,
        total_params=total,
        active_params=active,
        embedding_params=embedding,
        routed_expert_params=routed,
        num_layers=arch.n_layers,
        num_moe_layers=len(arch.moe_layer_ids),
        num_experts=arch.num_experts,
        top_k=arch.top_k,
    )
