"""Routing rows of one KV block as a pool value (numpy only).

When a replica puts a KV block into a shared pool (Mooncake), the rows of the
block's tokens go into the pool next to it, under the block's key plus
``ROUTING_SUFFIX`` (both keys start with ``versioned_cache_prefix``: the policy
version whose weights computed them): a replica that later loads the block instead of computing
it has no other way to know which experts those tokens chose. The value is a
routing record of the record codec (``record.py``: CRC-checked, self-describing),
whose ``start`` is the block's first position.

``decode_block`` accepts a value only when it is exactly what this replica
would have computed the block into: same MoE layers, expert count, top-k, rows
and first position. Anything else (a truncated, corrupt or foreign value)
raises ``ValueError``, and the caller treats the block as a miss for both KV and
routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .record import RoutingRecord, decode_record, encode_record

__all__ = ["ROUTING_SUFFIX", "VERSION_TAG", "BlockShape", "versioned_cache_prefix", "routing_key", "encode_block",
           "decode_block"]

ROUTING_SUFFIX = "@moerl-routing"
VERSION_TAG = "moerl-policy-v"


def versioned_cache_prefix(cache_prefix: str, version: int) -> str:
    """The namespace that starts every pool key (KV and routing) of a replica serving policy `version`.

    A block's hash says which tokens it holds, not which weights computed it: after
    a weight update the same hash names different KV and routing. vLLM's Mooncake
    store puts its ``cache_prefix`` (``kv_connector_extra_config``) before every key
    it builds (``cache_prefix@model@tp_rank:...@hash``); moerl makes that prefix the
    configured one plus the policy version, so a replica reads and writes only
    blocks of the weights it serves."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"policy version must be a non-negative integer, got {version!r}")
    return f"{cache_prefix}@{VERSION_TAG}{version}" if cache_prefix else f"{VERSION_TAG}{version}"


def routing_key(kv_key: str) -> str:
    """The pool key of the routing rows of the block stored under `kv_key`."""
    return kv_key + ROUTING_SUFFIX


@dataclass(frozen=True)
class BlockShape:
    """What every block's rows look like on this model: ``[block_size, len(moe_layers), top_k]``."""

    block_size: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int


def encode_block(rows: np.ndarray, shape: BlockShape, block_index: int) -> bytes:
    """Encode the rows of block `block_index` (positions ``block_index * block_size`` on)."""
    if rows.shape != (shape.block_size, len(shape.moe_layers), shape.top_k):
        raise ValueError(f"block rows have shape {rows.shape}, expected "
                         f"{(shape.block_size, len(shape.moe_layers), shape.top_k)}")
    return encode_record(RoutingRecord(rows, shape.moe_layers, shape.num_experts, block_index * shape.block_size))


def decode_block(payload: bytes | memoryview, shape: BlockShape, block_index: int) -> np.ndarray:
    """The rows ``[block_size, L, K]`` (sorted per row, the record's id dtype) of a pool value;
    ValueError when it is not the complete, intact routing of that block on this model."""
    if not payload:
        raise ValueError("no routing value")
    rec = decode_record(payload)
    start = block_index * shape.block_size
    got = (rec.moe_layers, rec.num_experts, rec.top_k, rec.num_rows, rec.start)
    want = (shape.moe_layers, shape.num_experts, shape.top_k, shape.block_size, start)
    if got != want:
        raise ValueError(f"routing value is for (layers, experts, top_k, rows, start) {got}, expected {want}")
    return rec.expert_ids
