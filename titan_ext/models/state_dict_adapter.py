"""HF safetensors <-> titan_ext state dicts for the MLA + MoE family.

TorchTitan's DeepSeek-V3 adapter already maps the shared names and splits/stacks
per-expert tensors; we add GLM-5's indexer names and the checks a port needs: a
checkpoint with missing, extra or mis-shaped tensors is refused with the names,
instead of loading silently wrong or failing deep inside `load_state_dict`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

_INDEXER_MAP = {
    f"model.layers.{{}}.self_attn.indexer.{hf}": f"layers.{{}}.attention.indexer.{tt}"
    for hf, tt in {
        "wq_b.weight": "wq_b.weight",
        "wk.weight": "wk.weight",
        "k_norm.weight": "k_norm.weight",
        "k_norm.bias": "k_norm.bias",
        "weights_proj.weight": "weights_proj.weight",
    }.items()
}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

logger = logging.getLogger(__name__)


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model it is loaded into."""


class MLAMoEStateDictAdapter(DeepSeekV3StateDictAdapter):
    def __init__(self, model_config, hf_assets_path: str | None = None):
        super().__init__(model_config, hf_assets_path)
        if getattr(model_config.layers[0].attention, "indexer", None) is not None:
            self.from_hf_map.update(_INDEXER_MAP)

    def drop_mtp(self, hf_keys: Mapping[str, Any]) -> dict[str, Any]:
        """Checkpoints may carry MTP layers (numbered after the last decoder layer; GLM-5 ships one);
        we train without them: their tensors are left out, with a log line saying so."""
        n_layers = len(self.model_config.layers)
        mtp = {int(m.group(1)) for k in hf_keys if (m := _LAYER.match(k)) and int(m.group(1)) >= n_layers}
        if mtp:
            logger.info("skipping the MTP layer(s) %s of the checkpoint (%d tensors): titan_ext trains without MTP",
                        sorted(mtp), sum(1 for k in hf_keys if (m := _LAYER.match(k)) and int(m.group(1)) in mtp))
        return {
            k: v for k, v in hf_keys.items()
            if not ((m := _LAYER.match(k)) and int(m.group(1)) >= n_layers)
        }

    def check_hf_shapes(self, hf_shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> None:
        """Raise CheckpointMismatchError naming every missing, extra and mis-shaped tensor."""
        got = self.drop_mtp(hf_shapes)
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(
            f"{k}: checkpoint {tuple(got[k])}, model {tuple(expected[k])}"
            for k in set(got) & set(expected)
            if tuple(got[k]) != tuple(expected[k])
        )
        if missing or extra or wrong:
            parts = []
            for title, names in (("missing", missing), ("unexpected", extra), ("mis-shaped", wrong)):
                if names:
                    shown = "\n  ".join(names[:20]) + (f"\n  ... and {len(names) - 20} more" if len(names) > 20 else "")
                    parts.append(f"{len(names)} {title} tensor(s):\n  {shown}")
            raise CheckpointMismatchError(
                "HF checkpoint does not match the model config (was it made for another model or flavor?)\n"
                + "\n".join(parts)
            )
