"""The chunked LM head + loss (`--titan_ext.loss_chunks`, `train.loss_chunk_tokens`) on every torch.

TorchTitan's `ChunkedLossWrapper` runs the final norm inside the model's forward and the LM head
on its own, chunk by chunk, each chunk's backward at once, and reshards the LM head when the chunks
are done. TorchTitan shards the norm and the LM head as one FSDP2 unit, so that reshard also frees
the norm's gathered weight while the decoder's backward (which starts at the norm) still needs it.
torch 2.13 lets FSDP2 run such a partial unit (pytorch#180428); on the H200's torch 2.11 the first
backward fails with "The tensor has a non-zero number of elements, but its data is not allocated
yet". With the two as their own units the wrapper reshards only the LM head, and the norm's unit
reduces its gradient when the decoder's backward reaches it, as every other unit does: correct on
every torch, for one more all-gather of a vector of `dim` elements per step. So wherever the
chunked loss is on, `torchtitan.distributed.fsdp.fully_shard` shards a list of modules that share
no parameter (TorchTitan's `[norm, lm_head]`; a tied embedding + head stays one unit) one module
at a time.
"""

from __future__ import annotations

import functools

import patches


def _share_a_parameter(modules) -> bool:
    seen: set[int] = set()
    for module in modules:
        ids = {id(p) for p in module.parameters()}
        if ids & seen:
            return True
        seen |= ids
    return False


def _one_unit_per_module(fully_shard):
    @functools.wraps(fully_shard)
    def wrapper(module, *args, **kwargs):
        if isinstance(module, (list, tuple)) and len(module) > 1 and not _share_a_parameter(module):
            for one in module:
                fully_shard(one, *args, **kwargs)
            return module
        return fully_shard(module, *args, **kwargs)

    return wrapper


SEPARATE_HEAD_UNITS = patches.wrapper_patch(
    "titan_ext_chunked_loss_head_units",
    "torchtitan.distributed.fsdp:fully_shard",
    _one_unit_per_module,
    versions="torchtitan>=0.3,<0.4",
    upstream="torchtitan 0.3.0 apply_fsdp_to_decoder (final norm and LM head as one FSDP2 unit) on torch < 2.13",
    symptom="the chunked loss's first backward fails: the norm's weight 'data is not allocated yet'",
)
PATCHES = (SEPARATE_HEAD_UNITS,)


def enable_chunked_loss() -> None:
    """Call before the model is parallelized, wherever the chunked loss is configured."""
    patches.activate([SEPARATE_HEAD_UNITS])
