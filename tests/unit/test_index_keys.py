"""The DSA indexer's keys: their section of the routing record, their place in a training batch,
and their replay in titan_ext's DSA attention (`train.replay_indexer`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl_loop.batch import ModelShape, Sample, pack
from vllm_ext.routing.index_keys import IndexKeys, bytes_per_row, mean_bytes_per_token_layer
from vllm_ext.routing.record import RoutingRecord, decode_record, encode_record


def _selection(rng, start: int, rows: int, layers: int, topk: int) -> np.ndarray:
    """Keys as vLLM's indexer leaves them: unsorted, -1 in the slots of queries with fewer keys."""
    out = np.full((rows, layers, topk), -1, np.int32)
    for i in range(rows):
        p = start + i
        for j in range(layers):
            n = min(topk, p + 1)
            out[i, j, :n] = rng.choice(p + 1, n, replace=False)
    return out


def _record(rng, start: int, rows: int, layers: int, topk: int) -> RoutingRecord:
    ids = np.stack([rng.choice(32, 4, replace=False) for _ in range(rows * 2)]).reshape(rows, 2, 4)
    keys = IndexKeys(_selection(rng, start, rows, layers, topk), tuple(range(layers)), topk)
    return RoutingRecord(ids, (1, 2), 32, start, keys)


@pytest.mark.parametrize("start,rows,layers,topk", [(0, 40, 3, 8), (5, 100, 2, 8), (0, 3, 2, 8),
                                                    (30, 50, 4, 16), (0, 300, 1, 2), (200, 20, 2, 64)])
def test_records_with_indexer_keys_round_trip(start, rows, layers, topk):
    rng = np.random.default_rng(rows)
    rec = _record(rng, start, rows, layers, topk)
    back = decode_record(encode_record(rec))
    assert back == rec
    assert back.index_keys.keys.dtype == np.int32
    k = back.index_keys.keys
    assert (np.diff(np.where(k < 0, (1 << 30) + np.arange(topk), k), axis=-1) > 0).all()  # sorted, -1 after
    later = rec.slice_from(start + rows // 2)  # a later turn's rows
    assert decode_record(encode_record(later)) == later
    assert later.index_keys.keys.shape[0] == later.num_rows


def test_a_record_without_keys_is_the_same_payload_as_before():
    rng = np.random.default_rng(0)
    rec = _record(rng, 0, 30, 2, 8)
    plain = RoutingRecord(rec.expert_ids, rec.moe_layers, rec.num_experts, rec.start)
    payload = encode_record(plain)
    assert payload[6] == 0  # header flags: no indexer section
    assert decode_record(payload).index_keys is None
    assert len(encode_record(rec)) > len(payload)


def test_section_size_is_near_the_information_floor_at_131k_and_top_2048():
    k, p = 2048, 131_071
    floor = math.lgamma(p + 2) - math.lgamma(k + 1) - math.lgamma(p + 2 - k)  # ln C(p + 1, k)
    floor_bytes = floor / math.log(2) / 8
    assert bytes_per_row(p, k) == 2048.0  # K * (b + 2) bits, b = 6
    assert floor_bytes < bytes_per_row(p, k) < 1.1 * floor_bytes
    assert bytes_per_row(k - 1, k) == 0.0  # every earlier key: nothing stored
    assert 1500 < mean_bytes_per_token_layer(131_072, k) < 2048
    rng = np.random.default_rng(1)
    start, rows = p - 3, 4
    keys = np.stack([rng.choice(start + i + 1, k, replace=False) for i in range(rows)])[:, None, :]
    section = IndexKeys(keys.astype(np.int32), (0,), k).check(start).encode(start)
    assert abs((len(section) - 20) / rows - 2048) < 1  # past its 20-byte header, what bytes_per_row says


@pytest.mark.parametrize("edit,message", [
    (lambda k: k.__setitem__((12, 0, 0), 13), "past its own position"),
    (lambda k: k.__setitem__((12, 0, 1), k[12, 0, 0]), "repeats a key"),
    (lambda k: k.__setitem__((12, 0, 2), -1), "does not select min"),
    (lambda k: k.__setitem__((3, 0, 7), 2), "repeats a key"),
    (lambda k: k.__setitem__((3, 0, 7), -5), "negative key"),
])
def test_keys_that_do_not_fit_the_sequence_are_refused_naming_the_row(edit, message):
    rng = np.random.default_rng(2)
    keys = _selection(rng, 0, 20, 2, 8)
    keys[12, 0, :8] = np.arange(4, 12)
    edit(keys)
    with pytest.raises(ValueError, match=message):
        IndexKeys(keys, (0, 1), 8).check(0)


def test_a_record_whose_keys_have_other_rows_or_a_corrupt_section_is_refused():
    rng = np.random.default_rng(3)
    rec = _record(rng, 0, 30, 2, 8)
    with pytest.raises(ValueError, match="30 rows of experts but 29 rows of indexer keys"):
        RoutingRecord(rec.expert_ids, rec.moe_layers, 32, 0, IndexKeys(rec.index_keys.keys[1:], (0, 1), 8))
    payload = bytearray(encode_record(rec))
    payload[-10] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        decode_record(bytes(payload))
    # the section's own checks, under the record's checksum: a unary bit more or less, a short body
    section = bytearray(rec.index_keys.encode(0))
    section[20 + 3] ^= 1

    def reader(buf):
        view, at = memoryview(bytes(buf)), [0]

        def take(n, what):
            if at[0] + n > len(view):
                raise ValueError(f"routing payload truncated: {what}")
            at[0] += n
            return view[at[0] - n:at[0]]
        return take

    for damaged in (section, section[:-3]):
        with pytest.raises(ValueError):
            IndexKeys.decode(reader(damaged), 30, 0)


def _sample(rng, prompt: int, completion: int, keys: np.ndarray | None) -> Sample:
    rows = prompt + completion - 1
    routing = np.stack([rng.choice(8, 2, replace=False) for _ in range(rows)])[:, None, :]
    return Sample(list(range(3, 3 + prompt)), list(range(3, 3 + completion)), [0.0] * completion, 1.0, 0,
                  routing=routing, index_keys=keys)


def test_pack_places_the_keys_and_refuses_samples_without_or_with_misfit_keys():
    rng = np.random.default_rng(4)
    shape = ModelShape(1, 2, 8, index_layers=2, index_topk=4)
    good = _sample(rng, 5, 4, _selection(rng, 0, 8, 2, 4))
    short = _sample(rng, 3, 2, _selection(rng, 0, 4, 2, 4))
    batch, rejected = pack([good, short, _sample(rng, 5, 4, None), _sample(rng, 5, 4, _selection(rng, 0, 8, 1, 4))],
                           shape, pad_id=0)
    assert [i for i, _ in rejected] == [2, 3]
    assert rejected[0][1].startswith("no indexer keys") and rejected[1][1].startswith("indexer keys do not fit")
    keys = batch.replay_keys
    assert keys.shape == (2, 8, 2, 4) and keys.dtype == torch.int64
    # rows below top-k: the chosen keys, then the column index (a key past the query, masked)
    assert keys[0, 1, 0].tolist()[2:] == [2, 3] and sorted(keys[0, 1, 0].tolist()[:2]) == [0, 1]
    assert (np.sort(keys[0, 7].numpy(), -1) == np.sort(good.index_keys[7], -1)).all()
    assert (keys[1, 4:] == torch.arange(4)).all()  # padding rows
    assert batch.shard(1, 2).replay_keys.shape[0] == 1 and batch.padded(5).replay_keys.shape[1] == 10


def _dsa_attention():
    import titan_ext
    from torchtitan.config import derive

    from titan_ext.models import get_arch
    from titan_ext.models.builder import build_model_config
    from titan_ext.models.glm5.dsa import DSAAttention

    titan_ext.activate()
    cfg = build_model_config(get_arch("glm5", "tiny"))
    torch.manual_seed(0)
    attn = derive(cfg.layers[0].attention, DSAAttention.Config).build()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return attn, cfg.dim


def test_replayed_keys_are_the_keys_the_attention_reads():
    from titan_ext.models.glm5.dsa import recorded_selections
    from titan_ext.replay import ReplayRecordError, replay_index_keys

    attn, dim = _dsa_attention()
    topk = attn.indexer.topk
    x = torch.randn(2, 30, dim)
    with torch.no_grad(), recorded_selections(attn) as picks:
        own = attn(x, None, None)
    keys = picks[0][:, :, None, :]  # [B, S, 1 layer, topk]
    with torch.no_grad(), replay_index_keys(attn, keys) as (indexer,):
        same = attn(x, None, None)
    assert torch.equal(same, own) and indexer.disagreement == 0.0
    other = keys.clone()
    other[:, topk:] = torch.arange(topk)  # every query past top-k reads the first keys instead
    with torch.no_grad(), replay_index_keys(attn, other) as (indexer,):
        moved = attn(x, None, None)
    assert torch.equal(moved[:, :topk], own[:, :topk]) and not torch.allclose(moved[:, topk:], own[:, topk:])
    assert 0.5 < indexer.disagreement <= 1.0
    assert attn.indexer.replay_keys_BLK is None  # the side channel closes with the block
    for bad, message in ((keys[..., :-1], "expected \\[batch, seq, 1, 8\\]"), (keys.float(), "integers"),
                         (keys + 30, "positions in \\[0, 30\\)")):
        with pytest.raises(ReplayRecordError, match=message), replay_index_keys(attn, bad):
            pass
