"""Run under torchrun: GLM-5 and Kimi-K2 (tiny, fp32) at `--parallelism.context_parallel_degree CP`.

For each model, loads its HF checkpoint through TorchTitan's checkpointer into a Trainer with
that CP degree, takes the fixed batch (`ep_logits_worker.fixed_batch`: 2 x 48 tokens), keeps
this rank's batch rows and, with the layout the trainer uses (`SequenceShards.shard`), its
tokens, labels and recorded expert ids; runs the forward and the backward of the batch's mean
token cross-entropy, then a replayed forward. Rank 0 saves, per model, the unsharded logits,
every parameter's full gradient, the replayed logits, per-token losses and loss, and the bytes one rank's latent
gathers produced in the first forward.

usage: torchrun --nproc_per_node N cp_worker.py GLM5_CKPT KIMI_CKPT CP OUT_FILE
"""

import sys

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import titan_ext

titan_ext.activate()  # the trainer's patches (patches/), before torchtitan is imported

from ep_logits_worker import fixed_batch, load_trainer  # noqa: E402 - this file's directory is on sys.path under torchrun
from titan_ext.replay import replay_routing, shard_replay_ids  # noqa: E402
from titan_ext.teardown import destroy_process_group_together, exit_without_finalizing  # noqa: E402
from titan_ext.train_config import trainer_config  # noqa: E402

IGNORE = -100


def build_trainer(ckpt: str, model: str, cp: int):
    cfg = trainer_config(model, "tiny")
    cfg.parallelism.context_parallel_degree = cp
    return load_trainer(cfg, ckpt), cfg


def unshard(local: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, full_shape) -> torch.Tensor:
    """Every rank's `[b, L, ...]` rows put back at (batch row, global position)."""
    world = torch.distributed.get_world_size()
    gathered = [[torch.empty_like(t) for _ in range(world)] for t in (local, rows, positions)]
    for parts, t in zip(gathered, (local, rows, positions)):
        torch.distributed.all_gather(parts, t.contiguous())
    full = local.new_zeros(full_shape)
    for x, r, p in zip(*gathered):
        full[r[:, None], p] = x
    return full


def run_model(ckpt: str, model: str, cp: int) -> dict:
    trainer, cfg = build_trainer(ckpt, model, cp)
    model_part = trainer.model_parts[0].eval()
    moe = [layer.moe for layer in model_part.layers.values() if layer.moe_enabled]
    tokens, ids = fixed_batch(cfg.model_spec.model.vocab_size, len(moe), moe[0].router.top_k, moe[0].router.num_experts)
    labels = torch.cat([tokens[:, 1:], torch.full((len(tokens), 1), IGNORE)], dim=1)
    dims = trainer.parallel_dims
    dp, dp_rank = (dims.get_mesh("batch").size(), dims.get_mesh("batch").get_local_rank()) if dims.dp_enabled else (1, 0)
    rows = torch.arange(dp_rank * len(tokens) // dp, (dp_rank + 1) * len(tokens) // dp)
    positions = torch.arange(tokens.size(1)).expand(len(rows), -1)
    mine = (tokens[rows], labels[rows], positions)
    shards = model_part.layers["0"].attention.cp
    assert (shards is not None) == (cp > 1)
    if shards is not None:
        mine = shards.shard(*mine)
    tok, lab, pos = mine
    rec = shard_replay_ids(model_part, ids[rows])
    logits = model_part(tok)
    gathered_bytes = shards.gathered_bytes[0] if shards is not None else 0
    # sum over this rank's tokens / all tokens: FSDP's sum over ranks (dp and cp) makes it the batch mean
    loss = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=IGNORE, reduction="sum")
    (loss / (labels != IGNORE).sum()).backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""):
             (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float()
             for n, p in model_part.named_parameters() if p.grad is not None}
    with torch.no_grad(), replay_routing(model_part, rec):
        replayed = model_part(tok)
        per_token = F.cross_entropy(replayed.flatten(0, 1), lab.flatten(), ignore_index=IGNORE, reduction="none")
    # every rank's per-token losses in global (row, position) order, summed as one process sums them
    replay_token_losses = unshard(per_token.view_as(lab), rows, pos, tokens.shape)
    shape = (*tokens.shape, logits.size(-1))
    result = {
        "logits": unshard(logits.detach(), rows, pos, shape),
        "replay_logits": unshard(replayed, rows, pos, shape),
        "replay_token_losses": replay_token_losses,
        "replay_loss": (replay_token_losses.sum() / (labels != IGNORE).sum()).item(),
        "grads": grads,
        "gathered_bytes": gathered_bytes,
        "local_tokens": tok.numel(),
    }
    trainer.close()
    return result


def main() -> None:
    glm5_ckpt, kimi_ckpt, cp, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    results = {model: run_model(ckpt, model, cp) for model, ckpt in (("glm5", glm5_ckpt), ("kimi_k2", kimi_ckpt))}
    if torch.distributed.get_rank() == 0:
        torch.save(results, out)
    destroy_process_group_together()


if __name__ == "__main__":
    main()
    exit_without_finalizing()
