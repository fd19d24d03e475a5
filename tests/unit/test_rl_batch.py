import base64

import numpy as np
import pytest
import torch

from rl_loop.batch import Batch, ModelShape, Sample, pack, reason_kind
from rl_loop.rollouts import Completion, Conversation, parse_choice

SHAPE = ModelShape(num_moe_layers=3, top_k=2, num_experts=8)


def _sample(p=3, c=2, routing="ok", logprobs=None, adv=1.0):
    rows = p + c - 1
    r = {"ok": np.tile(np.array([1, 5]), (rows, 3, 1)), "short": np.zeros((rows - 1, 3, 2), int),
         "layers": np.zeros((rows, 2, 2), int), "topk": np.zeros((rows, 3, 3), int),
         "range": np.full((rows, 3, 2), 8), "none": None}[routing]
    return Sample(prompt_ids=list(range(10, 10 + p)), completion_ids=list(range(20, 20 + c)),
                  logprobs=logprobs if logprobs is not None else [-0.5] * c, reward=1.0, group=0,
                  routing=r, advantage=adv)


def test_pack_aligns_targets_logprobs_and_routing_rows():
    batch, rejected = pack([_sample(3, 2), _sample(2, 4, adv=-1.0)], SHAPE, pad_id=0)
    assert rejected == []
    assert batch.tokens.tolist()[0] == [10, 11, 12, 20, 21, 0] and batch.tokens.tolist()[1] == [10, 11, 20, 21, 22, 23]
    # position t predicts token t+1: completion targets start at prompt_len - 1
    assert batch.mask.tolist() == [[False, False, True, True, False], [False, True, True, True, True]]
    assert torch.all(batch.logp_infer[batch.mask] == -0.5) and torch.all(batch.logp_infer[~batch.mask] == 0)
    assert batch.replay_ids.shape == (2, 5, 3, 2) and batch.replay_ids[0, :4].unique().tolist() == [1, 5]
    assert batch.advantages.tolist() == [[1.0], [-1.0]]


@pytest.mark.parametrize("kind,msg", [("short", "shape"), ("layers", "shape"), ("topk", "shape"),
                                      ("range", "outside"), ("none", "no routing")])
def test_samples_with_bad_records_are_rejected_and_the_rest_kept(kind, msg):
    batch, rejected = pack([_sample(), _sample(routing=kind), _sample()], SHAPE, pad_id=0)
    assert len(rejected) == 1 and rejected[0][0] == 1 and msg in rejected[0][1]
    assert batch.tokens.shape[0] == 2


def test_a_sample_the_server_returned_without_routing_carries_the_servers_reason():
    lost = _sample(routing="none")
    lost.routing_error = "shm_full: request r: the worker could not reserve its routing rows in /dev/shm"
    batch, rejected = pack([_sample(), lost, _sample(routing="none"), _sample(routing="range")], SHAPE, pad_id=0)
    assert batch.tokens.shape[0] == 1 and [i for i, _ in rejected] == [1, 2, 3]
    assert rejected[0][1] == f"no routing record (shm_full): {lost.routing_error}"
    assert [reason_kind(r) for _, r in rejected] == ["no routing record (shm_full)", "no routing record",
                                                     "routing record does not fit"]


def test_a_multi_turn_sample_keeps_the_reason_of_the_first_turn_that_lost_its_routing():
    conv = Conversation([10, 11, 12])
    rows = np.tile(np.array([1, 5]), (4, 3, 1))
    conv.record(Completion([20, 21], [-0.5, -0.5], "", rows), 0, 0)
    conv.append([30])
    conv.record(Completion([22], [-0.5], "", None, routing_error="rows_missing: request r: position 6"), 4, 0)
    conv.record(Completion([23], [-0.5], "", None, routing_error="shm_full: request r2: no room"), 6, 0)
    sample = conv.sample(1.0, 0)
    assert sample.routing is None and sample.routing_error == "rows_missing: request r: position 6"
    _, rejected = pack([_sample(), sample], SHAPE, pad_id=0)
    assert [(i, reason_kind(r)) for i, r in rejected] == [(1, "no routing record (rows_missing)")]


def test_without_replay_records_are_not_needed_and_logprob_count_is_checked():
    batch, rejected = pack([_sample(routing="none"), _sample(logprobs=[-1.0])], None, pad_id=0)
    assert batch.replay_ids is None and batch.tokens.shape[0] == 1
    assert rejected[0][0] == 1 and "logprobs" in rejected[0][1]
    assert pack([_sample(routing="none")], SHAPE, 0)[0] is None


def test_shard_keeps_rows_and_records_together():
    batch, _ = pack([_sample(3, 2, adv=float(i)) for i in range(4)], SHAPE, pad_id=0)
    part = batch.shard(1, 2)
    assert part.advantages.flatten().tolist() == [1.0, 3.0] and part.replay_ids.shape[0] == 2
    assert Batch.from_dict(part.to_dict()).tokens.equal(part.tokens)


def test_padded_sequences_split_into_equal_chunks_and_padding_is_out_of_the_loss():
    batch, _ = pack([_sample(3, 2), _sample(2, 4, adv=-1.0)], SHAPE, pad_id=0)  # 5 model inputs
    assert batch.padded(5) is batch
    out = batch.padded(4)
    assert out.tokens.shape == (2, 9) and out.mask.shape == out.logp_infer.shape == (2, 8)
    assert out.tokens[:, 6:].tolist() == [[0, 0, 0], [23, 23, 23]]
    assert out.mask[:, :5].equal(batch.mask) and not out.mask[:, 5:].any() and not out.logp_infer[:, 5:].any()
    assert out.replay_ids.shape == (2, 8, 3, 2) and out.replay_ids[:, 5:].equal(batch.replay_ids[:, 4:5].expand(-1, 3, -1, -1))


def _keys(start: int, rows: int, topk: int = 2) -> np.ndarray:
    """An indexer's keys for positions start.., one layer: the latest `topk` keys."""
    p = np.arange(start, start + rows)[:, None]
    return np.where(p - np.arange(topk) >= 0, p - np.arange(topk), -1)[:, None, :].astype(np.int32)


def test_a_record_with_indexer_keys_that_do_not_fit_rejects_its_sample_alone():
    from vllm_ext.routing.record import IndexKeys, RoutingRecord, encode_record_b64

    rows = np.tile(np.array([1, 5]), (4, 3, 1))
    good = encode_record_b64(RoutingRecord(rows, (1, 2, 3), 8, 0, IndexKeys(_keys(0, 4), (0,), 2)))
    payload = bytearray(base64.b64decode(good))
    payload[-5] ^= 0x40  # damaged in transit: the checksum fails
    choice = {"logprobs": {"tokens": ["token_id:20", "token_id:21"], "token_logprobs": [-0.5, -0.5]},
              "routed_experts": base64.b64encode(bytes(payload)).decode()}
    comp = parse_choice(choice)
    assert comp.routing is None and comp.routing_error.startswith("malformed_record: routing payload checksum")
    ok = parse_choice({**choice, "routed_experts": good})
    assert ok.index_keys.shape == (4, 1, 2)
    shape = ModelShape(3, 2, 8, index_layers=1, index_topk=2)
    samples = [Sample([10, 11, 12], [20, 21], [-0.5] * 2, 1.0, 0, routing=c.routing, routing_error=c.routing_error,
                      index_keys=c.index_keys) for c in (ok, comp)]
    batch, rejected = pack(samples, shape, pad_id=0)
    assert batch.replay_keys.shape == (1, 4, 1, 2) and [(i, reason_kind(r)) for i, r in rejected] == [
        (1, "no routing record (malformed_record)")]


def test_a_multi_turn_sample_stitches_the_indexer_keys_of_its_turns():
    conv = Conversation([10, 11, 12])
    rows = np.tile(np.array([1, 5]), (4, 3, 1))
    conv.record(Completion([20, 21], [-0.5, -0.5], "", rows, index_keys=_keys(0, 4)), 0, 0)
    conv.append([30])
    conv.record(Completion([22], [-0.5], "", rows[:2], index_keys=_keys(4, 2)), 4, 0)
    sample = conv.sample(1.0, 0)
    assert np.array_equal(sample.index_keys, _keys(0, 6))
    batch, rejected = pack([sample], ModelShape(3, 2, 8, index_layers=1, index_topk=2), pad_id=0)
    assert not rejected and batch.replay_keys[0, :, 0, :].tolist() == np.where(_keys(0, 6) < 0, 1, _keys(0, 6))[:, 0].tolist()
    conv.append([31])
    conv.record(Completion([23], [-0.5], "", rows[:2]), 6, 0)  # a turn from a replica that did not capture keys
    assert conv.sample(1.0, 0).index_keys is None
