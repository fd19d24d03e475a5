"""The routing record codec: lossless, within the size target, loud on bad input."""

from __future__ import annotations

import base64
import math
import subprocess
import sys

import numpy as np
import pytest

from vllm_ext.routing.record import (
    RoutingRecord,
    baseline_bytes_per_token,
    decode_record,
    decode_record_b64,
    encode_record,
    encode_record_b64,
    floor_bits_per_row,
)

CASES = [(8, 2), (64, 6), (256, 8), (384, 8), (512, 22)]


def random_ids(rng, t, layers, e, k, skew=None):
    if skew is None:
        keys = rng.random((t, layers, e))
    else:  # Zipf-like popularity, a different order per layer
        w = np.arange(1, e + 1, dtype=float) ** -skew
        perm = np.stack([rng.permutation(e) for _ in range(layers)])
        keys = -np.log(rng.random((t, layers, e))) / w[perm][None]
    return np.argpartition(keys, k - 1, axis=-1)[..., :k]


def target_bytes_per_token(e, k, layers):
    return max(0.4 * baseline_bytes_per_token(e, k, layers), 1.1 * layers * floor_bits_per_row(e, k) / 8)


@pytest.mark.parametrize("e,k", CASES)
@pytest.mark.parametrize("skew", [None, 1.2])
def test_round_trip_and_size_target(e, k, skew):
    rng = np.random.default_rng(e * 100 + k)
    t, layers = 600, 5
    ids = random_ids(rng, t, layers, e, k, skew)
    rec = RoutingRecord(ids, tuple(range(1, 2 * layers, 2)), e, start=7)
    payload = encode_record(rec)
    back = decode_record(payload)
    assert back == rec
    assert np.array_equal(back.expert_ids, np.sort(ids, axis=-1))
    assert back.moe_layers == (1, 3, 5, 7, 9) and back.start == 7 and back.num_experts == e
    # binary payload per token within the target (header amortised)
    assert len(payload) / t <= target_bytes_per_token(e, k, layers) * 1.02
    assert decode_record_b64(encode_record_b64(rec)) == rec


def test_order_within_row_carries_nothing():
    rng = np.random.default_rng(0)
    ids = random_ids(rng, 50, 3, 64, 6)
    shuffled = np.take_along_axis(ids, np.argsort(rng.random(ids.shape), axis=-1), axis=-1)
    assert encode_record(RoutingRecord(ids, (0, 1, 2), 64)) == encode_record(RoutingRecord(shuffled, (0, 1, 2), 64))


@pytest.mark.parametrize("e,k", [(1, 1), (2, 2), (3, 1), (5, 5), (1000, 3), (40000, 4), (300, 300)])
def test_edge_shapes_round_trip(e, k):
    rng = np.random.default_rng(1)
    for t in (0, 1, 9, 70):
        rec = RoutingRecord(random_ids(rng, t, 2, e, k) if t else np.zeros((0, 2, k), np.int64), (3, 4), e)
        assert decode_record(encode_record(rec)) == rec


def test_repetition_uses_the_dictionary():
    rng = np.random.default_rng(2)
    palette = random_ids(rng, 4, 6, 256, 8)
    ids = palette[rng.integers(0, 4, (2000, 6)), np.arange(6)[None, :]]  # 4 distinct rows per layer
    rec = RoutingRecord(ids, tuple(range(6)), 256)
    payload = encode_record(rec)
    assert decode_record(payload) == rec
    set_code = 2000 * 6 * 52 / 8
    assert len(payload) < 0.2 * set_code


def test_invalid_records_rejected():
    with pytest.raises(ValueError, match="out of range"):
        RoutingRecord(np.array([[[0, 8]]]), (0,), 8)
    with pytest.raises(ValueError, match="repeats"):
        RoutingRecord(np.array([[[3, 3]]]), (0,), 8)
    with pytest.raises(ValueError, match="layer columns"):
        RoutingRecord(np.zeros((2, 2, 1), int), (0,), 8)
    with pytest.raises(ValueError, match="rows, layers, top_k"):
        RoutingRecord(np.zeros((2, 2), int), (0,), 8)


def _valid_payload(e=256, k=8):
    rng = np.random.default_rng(3)
    return encode_record(RoutingRecord(random_ids(rng, 200, 4, e, k), (0, 1, 2, 3), e))


def test_truncated_payloads_raise():
    p = _valid_payload()
    for n in (0, 3, 10, len(p) // 2, len(p) - 1):
        with pytest.raises(ValueError):
            decode_record(p[:n])


def test_corrupted_payloads_raise():
    p = bytearray(_valid_payload())
    rng = np.random.default_rng(4)
    for _ in range(50):
        q = bytearray(p)
        q[int(rng.integers(0, len(q)))] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(ValueError):
            decode_record(bytes(q))


def test_out_of_range_payload_with_valid_checksum_raises():
    """A payload forged with a correct CRC still cannot smuggle ids >= E."""
    import struct
    import zlib

    from vllm_ext.routing import record as R

    # E=384 with b=6 lo bits: ids up to 383; forge lo bits of the top bucket
    rec = RoutingRecord(np.array([[[380, 381, 382, 383, 0, 1, 2, 3]]]), (0,), 384)
    body = bytearray(encode_record(rec)[:-4])
    body[-1] = 0xFF  # last lo bits -> an id beyond 383 or an unsorted row
    forged = bytes(body) + struct.pack("<I", zlib.crc32(body))
    with pytest.raises(ValueError):
        R.decode_record(forged)


def test_bad_text_raises():
    with pytest.raises(ValueError, match="base64"):
        decode_record_b64("not base64!!")
    with pytest.raises(ValueError, match="not a routing payload"):
        decode_record_b64(base64.b64encode(b"x" * 40).decode())
    with pytest.raises(ValueError, match="bytes"):
        decode_record("a string")


def test_slice_from_position():
    rng = np.random.default_rng(5)
    rec = RoutingRecord(random_ids(rng, 30, 2, 64, 6), (1, 2), 64, start=4)
    tail = rec.slice_from(10)
    assert tail.start == 10 and np.array_equal(tail.expert_ids, rec.expert_ids[6:])
    with pytest.raises(ValueError):
        rec.slice_from(2)


def test_record_module_imports_neither_torch_nor_vllm():
    code = "import sys, vllm_ext, vllm_ext.routing.record; print('torch' in sys.modules, 'vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_floor_and_baseline_helpers():
    assert baseline_bytes_per_token(8, 2, 1) == pytest.approx(8 / 3)
    assert baseline_bytes_per_token(384, 8, 1) == pytest.approx(4 / 3 * 16)
    assert floor_bits_per_row(64, 6) == pytest.approx(math.log2(math.comb(64, 6)))
