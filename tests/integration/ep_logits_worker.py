"""Run under torchrun: load an HF checkpoint through TorchTitan's own checkpointer
(our adapter, HF storage reader) into a Trainer with the requested expert-parallel
degree, run fixed tokens forward (optionally replaying fixed expert ids), and save
rank 0's logits.

usage: torchrun --nproc_per_node N ep_logits_worker.py CKPT_DIR MODEL EP OUT_FILE [--replay]
"""

import sys
import tempfile

import torch

import titan_ext  # noqa: F401  (applies patches)
from titan_ext.replay import replay_routing
from titan_ext.train_config import trainer_config


def fixed_batch(arch_vocab: int, num_moe_layers: int, top_k: int, num_experts: int):
    """Tokens and a random expert-id record for them (distinct ids per row), the same in every process."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch_vocab, (2, 48), generator=gen)
    ids = torch.rand(2, 48, num_moe_layers, num_experts, generator=gen).argsort(dim=-1)[..., :top_k]
    return tokens, ids


def main() -> None:
    ckpt, model, ep, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    replay = "--replay" in sys.argv[5:]
    cfg = trainer_config(model, "tiny")
    cfg.hf_assets_path = ckpt
    cfg.dump_folder = tempfile.mkdtemp(prefix="moerl_ep_")
    cfg.checkpoint.enable = True
    cfg.checkpoint.initial_load_path = ckpt
    cfg.checkpoint.initial_load_in_hf = True
    cfg.checkpoint.initial_load_model_only = True
    cfg.parallelism.expert_parallel_degree = ep
    trainer = cfg.build()
    if not trainer.checkpointer.load():
        raise RuntimeError(f"no checkpoint loaded from {ckpt}")
    model_part = trainer.model_parts[0].eval()
    moe = [layer.moe for layer in model_part.layers.values() if layer.moe_enabled]
    tokens, ids = fixed_batch(cfg.model_spec.model.vocab_size, len(moe), moe[0].router.top_k, moe[0].router.num_experts)
    with torch.no_grad(), replay_routing(model_part, ids if replay else None):
        logits = model_part(tokens)
    if torch.distributed.get_rank() == 0:
        torch.save(logits.detach().float(), out)
    trainer.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
