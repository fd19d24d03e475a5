"""Run under torchrun: load an HF checkpoint through TorchTitan's own checkpointer
(our adapter, HF storage reader) into a Trainer with the requested expert-parallel
degree, run fixed tokens forward (optionally replaying fixed expert ids; each rank
takes its share of the batch rows), and save the whole batch's logits from rank 0. With
--grads also run the backward of the batch's mean token cross-entropy and save
{"logits", "grads"} (full parameter gradients by name). `--titan_ext.*` flags pick the
dispatcher / fp8 as on the command line.

Each VARIANT is one argument holding such flags (shell-quoted, may be empty); every variant
builds its own Trainer in this one torchrun run, one after another, and OUT_FILE holds the
list of their results in order: several checks share one process start-up.

usage: torchrun --nproc_per_node N ep_logits_worker.py CKPT_DIR MODEL EP OUT_FILE VARIANT [VARIANT ...]
       VARIANT: "[--replay] [--grads] [--titan_ext.dispatcher NAME] [--titan_ext.fp8]"
"""

import shlex
import sys
import tempfile

import torch
from torch.distributed.tensor import DTensor

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

from titan_ext.options import apply_options, take_options  # noqa: E402
from titan_ext.replay import replay_routing  # noqa: E402
from titan_ext.teardown import destroy_process_group_together, exit_without_finalizing  # noqa: E402
from titan_ext.train_config import trainer_config  # noqa: E402


def fixed_batch(arch_vocab: int, num_moe_layers: int, top_k: int, num_experts: int):
    """Tokens and a random expert-id record for them (distinct ids per row), the same in every process."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch_vocab, (2, 48), generator=gen)
    ids = torch.rand(2, 48, num_moe_layers, num_experts, generator=gen).argsort(dim=-1)[..., :top_k]
    return tokens, ids


def load_trainer(cfg, ckpt: str):
    """Build `cfg`'s Trainer with its model loaded from the HF checkpoint `ckpt` by TorchTitan's checkpointer."""
    cfg.hf_assets_path = ckpt
    cfg.dump_folder = tempfile.mkdtemp(prefix="moerl_worker_")
    cfg.checkpoint.enable = True
    cfg.checkpoint.initial_load_path = ckpt
    cfg.checkpoint.initial_load_in_hf = True
    cfg.checkpoint.initial_load_model_only = True
    trainer = cfg.build()
    if not trainer.checkpointer.load():
        raise RuntimeError(f"no checkpoint loaded from {ckpt}")
    return trainer


def run_variant(ckpt: str, model: str, ep: int, flags: list[str]):
    """One Trainer with `flags`: rank 0 returns the logits (or {"logits", "grads"}), other ranks None."""
    replay, grads = "--replay" in flags, "--grads" in flags
    cfg = trainer_config(model, "tiny")
    apply_options(cfg, take_options(list(flags)))
    cfg.parallelism.expert_parallel_degree = ep
    trainer = load_trainer(cfg, ckpt)
    model_part = trainer.model_parts[0].eval()
    moe = [layer.moe for layer in model_part.layers.values() if layer.moe_enabled]
    tokens, ids = fixed_batch(cfg.model_spec.model.vocab_size, len(moe), moe[0].router.top_k, moe[0].router.num_experts)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mine = slice(rank * len(tokens) // world, (rank + 1) * len(tokens) // world)
    # the backward inside the replay block too: activation checkpointing recomputes the routing
    with torch.set_grad_enabled(grads), replay_routing(model_part, ids[mine] if replay else None):
        logits = model_part(tokens[mine])
        if grads:  # sum over this rank's tokens / all tokens: FSDP's sum over ranks makes it the batch mean
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[mine, 1:].flatten(),
                                                     reduction="sum") / tokens[:, 1:].numel()
            loss.backward()
    if grads:
        named = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for n, p in model_part.named_parameters()}
    parts = [torch.empty_like(logits) for _ in range(world)]
    torch.distributed.all_gather(parts, logits.detach().contiguous())
    trainer.close()
    if rank != 0:
        return None
    full = torch.cat(parts).float()
    return {"logits": full, "grads": {n: g.float() for n, g in named.items()}} if grads else full


def main() -> None:
    ckpt, model, ep, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    variants = [shlex.split(v) for v in sys.argv[5:]]
    if not variants:
        raise SystemExit(__doc__)
    results = [run_variant(ckpt, model, ep, flags) for flags in variants]
    if torch.distributed.get_rank() == 0:
        torch.save(results, out)
    destroy_process_group_together()


if __name__ == "__main__":
    main()
    exit_without_finalizing()
