"""RoutingStore: rows by position, prefix-cache hits from blocks, no gaps."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_ext.api import inject_into_chunk, moe_layer_indices
from vllm_ext.routing.store import MissingRowsError, RoutingStore


def rows(rng, n, lay=2, k=3):
    return rng.integers(0, 255, (n, lay, k)).astype(np.uint8)


def test_chunked_prefill_then_decode_emits_each_row_once():
    rng = np.random.default_rng(0)
    s = RoutingStore(2, 3, np.uint8, block_size=4)
    s.open("a", 0)
    full = rows(rng, 12)
    s.write("a", 0, full[:5])
    s.write("a", 5, full[5:10])
    out1 = s.emit("a", 10, 0)
    s.write("a", 10, full[10:11])
    out2 = s.emit("a", 11, 0)
    assert np.array_equal(np.concatenate([out1, out2]), full[:11])
    assert s.emit("a", 11, 0) is None


def test_prefix_cache_hit_filled_from_block_hashes():
    rng = np.random.default_rng(1)
    s = RoutingStore(2, 3, np.uint8, block_size=4)
    a = rows(rng, 10)
    s.open("a", 0)
    s.add_block_hashes("a", [b"h0", b"h1"])
    s.write("a", 0, a)
    s.publish("a")
    s.finish("a")
    assert s.num_blocks == 2
    # b shares the first 8 tokens: only positions 8.. are computed
    s.open("b", 0)
    s.add_block_hashes("b", [b"h0", b"h1"])
    b_tail = rows(rng, 4)
    s.write("b", 8, b_tail)
    out = s.emit("b", 12, 0)
    assert np.array_equal(out[:8], a[:8]) and np.array_equal(out[8:], b_tail)


def test_missing_rows_raise_instead_of_gap():
    s = RoutingStore(2, 3, np.uint8, block_size=4)
    s.open("c", 0)
    s.add_block_hashes("c", [b"unknown"])
    s.write("c", 4, np.zeros((2, 2, 3), np.uint8))
    with pytest.raises(MissingRowsError, match="position 0"):
        s.emit("c", 6, 0)


def test_recompute_overwrites_and_emit_start():
    rng = np.random.default_rng(2)
    s = RoutingStore(2, 3, np.uint8, block_size=4)
    s.open("d", 3)
    r = rows(rng, 6)
    s.write("d", 0, r)
    s.write("d", 0, r)  # preempted and recomputed: same positions again
    out = s.emit("d", 6, 3)
    assert np.array_equal(out, r[3:])


def test_reset_forgets_blocks():
    s = RoutingStore(2, 3, np.uint8, block_size=2)
    s.open("a", 0)
    s.add_block_hashes("a", [b"x"])
    s.write("a", 0, np.ones((2, 2, 3), np.uint8))
    s.publish("a")
    assert s.num_blocks == 1
    s.reset()
    assert s.num_blocks == 0


def test_lru_bound():
    s = RoutingStore(1, 1, np.uint8, block_size=1, max_blocks=3)
    s.open("a", 0)
    s.add_block_hashes("a", [bytes([i]) for i in range(5)])
    s.write("a", 0, np.zeros((5, 1, 1), np.uint8))
    s.publish("a")
    assert s.num_blocks == 3


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_moe_layer_indices_conventions():
    assert moe_layer_indices(_Cfg(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=1)) == (0, 1, 2, 3)
    assert moe_layer_indices(_Cfg(num_hidden_layers=4, mlp_only_layers=[0, 2], decoder_sparse_step=1)) == (1, 3)
    assert moe_layer_indices(_Cfg(num_hidden_layers=61, first_k_dense_replace=1, moe_layer_freq=1)) == tuple(
        range(1, 61))
    with pytest.raises(ValueError, match="columns"):
        moe_layer_indices(_Cfg(num_hidden_layers=4, first_k_dense_replace=1), 4)


def test_inject_into_final_chunk_only():
    final = 'data: {"choices":[{"index":0,"text":"x","finish_reason":"length"}]}\n\n'
    mid = 'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
    pending = {0: "PAYLOAD"}
    assert inject_into_chunk(mid, pending) == mid
    out = inject_into_chunk(final, pending)
    assert '"routed_experts":"PAYLOAD"' in out and pending == {}
    assert inject_into_chunk("data: [DONE]\n\n", {0: "x"}) == "data: [DONE]\n\n"


def test_all_layer_rows_from_vllm_capture_drop_dense_columns():
    from vllm_ext.api import encode_rows
    from vllm_ext.routing.record import decode_record_b64

    cfg = _Cfg(num_hidden_layers=4, first_k_dense_replace=1, moe_layer_freq=1, n_routed_experts=64)
    rng = np.random.default_rng(3)
    moe = np.sort(np.argpartition(rng.random((5, 3, 64)), 5, axis=-1)[..., :6], axis=-1).astype(np.uint8)
    full = np.concatenate([np.zeros((5, 1, 6), np.uint8), moe], axis=1)  # dense layer 0 as zeros
    for rows in (moe, full):
        rec = decode_record_b64(encode_rows(rows, cfg, start=2))
        assert rec.moe_layers == (1, 2, 3) and rec.start == 2 and np.array_equal(rec.expert_ids, moe)
