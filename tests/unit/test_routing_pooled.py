"""Routing rows of a KV block as a pool value: round trip, and every mismatch or corruption refused."""

from __future__ import annotations

import glob
import os
import secrets

import numpy as np
import pytest

from vllm_ext.routing.handoff import SHM_DIR, read_rows
from vllm_ext.routing.pooled import BlockShape, decode_block, encode_block, routing_key, versioned_cache_prefix
from vllm_ext.routing.store import RoutingStore

SHAPE = BlockShape(block_size=32, moe_layers=(0, 1, 3), num_experts=64, top_k=8)


def block_rows(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(64)[:8] for _ in range(32 * 3)]).reshape(32, 3, 8).astype(np.uint8)


def test_round_trip_gives_the_rows_as_sets():
    rows = block_rows(0)
    out = decode_block(encode_block(rows, SHAPE, 2), SHAPE, 2)
    assert np.array_equal(out, np.sort(rows, axis=-1))
    assert routing_key("m@tp_rank:0@ab12") == "m@tp_rank:0@ab12@moerl-routing"


@pytest.mark.parametrize("damage", ["empty", "truncated", "flipped", "other_block", "other_layers", "other_experts"])
def test_a_value_that_is_not_this_blocks_routing_is_refused(damage):
    payload = encode_block(block_rows(1), SHAPE, 2)
    index, shape = 2, SHAPE
    if damage == "empty":
        payload = b""
    elif damage == "truncated":
        payload = payload[:-5]
    elif damage == "flipped":
        payload = payload[:20] + bytes([payload[20] ^ 0x10]) + payload[21:]
    elif damage == "other_block":
        index = 3
    elif damage == "other_layers":
        shape = BlockShape(32, (0, 1, 2), 64, 8)
    else:
        shape = BlockShape(32, (0, 1, 3), 128, 8)
    with pytest.raises(ValueError):
        decode_block(payload, shape, index)


def test_wrong_block_shape_is_not_encoded():
    with pytest.raises(ValueError, match="expected"):
        encode_block(block_rows(2)[:31], SHAPE, 0)


def test_pooled_block_fills_a_request_that_starts_after_it():
    """A block added from the pool (any thread) fills the skipped positions at the request's first write,
    as a locally published block would; every newly published block goes to on_publish."""
    token = f"{os.getpid():x}{secrets.token_hex(4)}"
    s = RoutingStore(3, 8, np.uint8, 32, token)
    published = []
    s.on_publish = lambda h, i, rows: published.append((h, i, bytes(rows)))
    try:
        pooled = np.sort(block_rows(3), axis=-1)
        s.add_block(b"h0", pooled)
        s.add_block_hashes("r", [b"h0", b"h1"])
        s.open("r", 0, 70)
        tail = np.sort(block_rows(4), axis=-1)
        s.write("r", 32, tail)
        start, out = read_rows(token, "r", 64)
        assert start == 0 and np.array_equal(out, np.concatenate([pooled, tail]))
        assert [(h, i) for h, i, _ in published] == [(b"h1", 1)]
        assert published[0][2] == tail.tobytes()
        with pytest.raises(ValueError, match="do not match"):
            s.add_block(b"h2", pooled[:, :2])
    finally:
        s.reaper.unlink_all()
    assert not glob.glob(f"{SHM_DIR}/moerl-r3-{token}-*")


def test_pool_keys_are_namespaced_by_policy_version():
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata, PoolKey

    assert versioned_cache_prefix("", 0) == "moerl-policy-v0"
    assert versioned_cache_prefix("team-a", 12) == "team-a@moerl-policy-v12"

    def kv_key(version: int, cache_prefix: str = "") -> str:
        meta = KeyMetadata("m", 0, 0, 0, 0, cache_prefix=versioned_cache_prefix(cache_prefix, version))
        return PoolKey.build_key_string(PoolKey.build_prefix(meta), "ab12")

    assert kv_key(3) == "moerl-policy-v3@m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab12"
    # distinct per version and configured prefix; no version's keys start with another's prefix (v1 vs v12)
    prefixes = {PoolKey.build_prefix(KeyMetadata("m", 0, 0, 0, 0, cache_prefix=versioned_cache_prefix(p, v))) + "@"
                for v in (1, 12, 2) for p in ("", "team-a")}
    assert len(prefixes) == 6 and not any(a != b and b.startswith(a) for a in prefixes for b in prefixes)
    for bad in (-1, 1.0, "3", True):
        with pytest.raises(ValueError, match="non-negative integer"):
            versioned_cache_prefix("", bad)
