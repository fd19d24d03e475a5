"""TorchTitan `Trainer.Config`s for titan_ext models, with defaults that run anywhere.

The defaults are the CPU/gloo-safe choices (maskless causal SDPA, the
`partial_dtensor` SPMD backend, fp32, no compile); every field stays overridable
from the command line exactly as in stock TorchTitan (`--training.steps 20`,
`--parallelism.expert_parallel_degree 2`, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

import patches
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.trainer import Trainer

from .models import model_spec
from .tiny_assets import corpus, train_tokenizer

_ASSETS = Path(__file__).resolve().parent.parent / ".cache" / "titan_assets"


def local_assets(model: str) -> Path:
    """Tokenizer + a small local text corpus for `model`'s tiny flavor (made once; nothing is downloaded)."""
    out = _ASSETS / model
    corpus_dir = out / "corpus"
    if not (out / "tokenizer.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        train_tokenizer(out)
    if not (corpus_dir / "train.jsonl").exists():
        corpus_dir.mkdir(parents=True, exist_ok=True)
        (corpus_dir / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus()))
    return out


# Lets `activation-checkpoint:memory-budget` partition graphs that hold a ProcessGroup. Under
# expert parallel the dispatcher's collectives take the EP process group, which a compiled
# block sees as a script object; the budgeted partitioner refuses script objects it cannot
# size unless told they are empty. These are titan_ext's only script objects and hold no
# tensors, so zero is their true activation size. torch 2.11 (the H200 machines) has no such
# setting: there the patch is skipped with a WARNING.
SCRIPT_OBJECTS_ZERO_SIZE = patches.setting_patch(
    "torch_script_objects_zero_size", "torch._functorch.config:unsafe_treat_script_objects_as_zero_size", True,
    versions="torch>=2.11,<2.14",
    upstream="torch 2.13 functorch min-cut partitioner under activation_memory_budget",
    symptom="activation-checkpoint:memory-budget with EP > 1: the partitioner refuses the EP process group",
)
PATCHES = (SCRIPT_OBJECTS_ZERO_SIZE,)


def trainer_config(model: str, flavor: str) -> Trainer.Config:
    patches.activate([SCRIPT_OBJECTS_ZERO_SIZE])
    spec = model_spec(model, flavor)
    assets = local_assets(model) if flavor == "tiny" else Path(f"./assets/hf/{model}")
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=str(assets),
        loss=CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size),
        metrics=MetricsProcessor.Config(log_freq=1),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(assets / "corpus")),
        optimizer=default_adamw(lr=3e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.1),
        training=TrainingConfig(
            local_batch_size=4, seq_len=64, steps=10,
            mixed_precision_param="float32", mixed_precision_reduce="float32",
            # the all-to-all EP dispatcher syncs with the host, which graph capture forbids
            disable_cuda_graphs=True,
        ),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(enable=False),
    )
