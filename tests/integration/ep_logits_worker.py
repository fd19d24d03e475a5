"""Run under torchrun: load an HF checkpoint through TorchTitan's own checkpointer
(our adapter, HF storage reader) into a Trainer with the requested expert-parallel
degree, run fixed tokens forward, and save rank 0's logits.

usage: torchrun --nproc_per_node N ep_logits_worker.py CKPT_DIR MODEL EP OUT_FILE
"""

import sys
import tempfile

import torch

import titan_ext  # noqa: F401  (applies patches)
from titan_ext.train_config import trainer_config


def main() -> None:
    ckpt, model, ep, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
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
    tokens = torch.randint(0, cfg.model_spec.model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    model_part = trainer.model_parts[0].eval()
    with torch.no_grad():
        logits = model_part(tokens)
    if torch.distributed.get_rank() == 0:
        torch.save(logits.detach().float(), out)
    trainer.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
