"""titan_ext's own training flags on `torchtitan train --extension titan_ext`: `--titan_ext.FIELD`.

TorchTitan names its flags `--section.field` after its config dataclasses; titan_ext's
live in the section `titan_ext`, one field of `TitanExtOptions` each. They change how the
model is built (which token dispatcher, fp8 experts), so they are taken off the command
line before TorchTitan parses the rest and applied to the prebuilt Trainer.Config. The
dataclass is the one registry: parsing and `options_help()` both read its fields.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass, field, fields

from torchtitan.components.loss import ChunkedLossWrapper

from .chunked_loss import enable_chunked_loss
from .models.builder import Dispatcher, configure_indexer, configure_moe
from .offload import LayerInputOffload, OptimizerStateOffload

SECTION = "titan_ext"


@dataclass(frozen=True)
class TitanExtOptions:
    dispatcher: Dispatcher = field(default="lean", metadata={"help": (
        "MoE token dispatcher: lean (gathers with gather duals; under expert parallel one count "
        "exchange and one all-to-all each way), torchtitan (TorchTitan's AllToAllTokenDispatcher), "
        "deepep (DeepEP v1 intranode; needs the deep_ep wheel and bf16)")})
    fp8: bool = field(default=False, metadata={"help": (
        "routed and shared expert GEMMs in fp8 e4m3 with row-wise scales (titan_ext.models.fp8_experts); "
        "needs the lean or deepep dispatcher")})
    loss_chunks: int = field(default=1, metadata={"help": (
        "LM head and cross-entropy on this many pieces of the sequence (TorchTitan's ChunkedLossWrapper), "
        "so [tokens, vocabulary] logits never exist at once; must divide each process's sequence length "
        "(training.seq_len / context_parallel_degree); 1: whole-sequence logits")})
    activation_offload: bool = field(default=False, metadata={"help": (
        "each transformer block's input (what activation checkpointing keeps) in host memory from the "
        "block's forward until its backward (titan_ext.offload)")})
    indexer_fp8: bool = field(default=False, metadata={"help": (
        "GLM-5's DSA indexer ranks keys from fp8 queries and keys as vLLM's indexer does (vllm_ext.dsa.ops), "
        "so training attends to the keys inference selected; RL turns it on (train.indexer_fp8)")})
    optimizer_offload: bool = field(default=False, metadata={"help": (
        "AdamW's moments in host memory from each forward until the optimizer step (titan_ext.offload), "
        "so they never share the GPU with the activations")})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchtitan train", add_help=False, allow_abbrev=False)
    group = parser.add_argument_group(f"{SECTION} options (--extension titan_ext)")
    hints = typing.get_type_hints(TitanExtOptions)
    for f in fields(TitanExtOptions):
        flag = f"--{SECTION}.{f.name}"
        if hints[f.name] is bool:
            group.add_argument(flag, dest=f.name, action="store_true", help=f.metadata["help"])
        elif hints[f.name] is int:
            group.add_argument(flag, dest=f.name, default=f.default, type=int, metavar="N",
                               help=f"{f.metadata['help']} (default: {f.default})")
        else:
            group.add_argument(flag, dest=f.name, default=f.default, choices=typing.get_args(hints[f.name]) or None,
                               help=f"{f.metadata['help']} (default: {f.default})")
    return parser


def take_options(args: list[str]) -> TitanExtOptions:
    """Remove the `--titan_ext.*` flags from `args` (in place) and return them parsed."""
    parsed, rest = _parser().parse_known_args(args)
    args[:] = rest
    return TitanExtOptions(**vars(parsed))


def options_help() -> str:
    """The `--titan_ext.*` flags as `--help` lists them."""
    return _parser().format_help().split("\n", 2)[-1].strip("\n") + "\n"


def apply_options(config, options: TitanExtOptions) -> None:
    """Build the Trainer.Config's model and loss with `options` (a titan_ext model's config)."""
    configure_moe(config.model_spec.model, dispatcher=options.dispatcher, fp8=options.fp8)
    configure_indexer(config.model_spec.model, fp8_ranking=options.indexer_fp8)
    if options.loss_chunks < 1:
        raise ValueError(f"--{SECTION}.loss_chunks must be >= 1, got {options.loss_chunks}")
    if options.loss_chunks > 1:
        enable_chunked_loss()
        config.loss = ChunkedLossWrapper.Config(num_chunks=options.loss_chunks, loss_fn=config.loss)
    if options.optimizer_offload:
        config.model_spec.post_optimizer_build_fn = _with_offload(config.model_spec.post_optimizer_build_fn)
    if options.activation_offload:
        config.model_spec.parallelize_fn = _with_layer_input_offload(config.model_spec.parallelize_fn)


def _with_layer_input_offload(parallelize):
    """The model spec's parallelize step, then the layer-input offload's hooks on every block."""

    def build(model, **kwargs):
        model = parallelize(model, **kwargs) or model
        LayerInputOffload(list(model.layers.values()))  # its hooks keep it
        return model

    return build


def _with_offload(post_build):
    """The model spec's post-optimizer-build step, then the optimizer-state offload's hooks."""

    def build(optimizers, model_parts, parallel_dims):
        if post_build is not None:
            post_build(optimizers, model_parts, parallel_dims)
        OptimizerStateOffload(optimizers, model_parts)  # its hooks keep it

    return build
