"""RoutingStore and the shared-memory hand-off: rows by position, prefix-cache hits from blocks, no gaps."""

from __future__ import annotations

import errno
import glob
import json
import os
import secrets
import subprocess
import time

import numpy as np
import pytest

from vllm_ext.api import inject_into_chunk, moe_layer_indices
from vllm_ext.routing.handoff import SHM_DIR, SegmentReaper, read_rows, segment_name, sweep_dead_servers
from vllm_ext.routing.missing import BAD_SEGMENT, NO_SEGMENT, ROWS_MISSING, SHM_FULL, RoutingMissing
from vllm_ext.routing.store import RoutingStore


def rows(rng, n, lay=2, k=3):
    return rng.integers(0, 255, (n, lay, k)).astype(np.uint8)


@pytest.fixture
def store():
    """A store on real /dev/shm segments under a token of its own; every segment is gone after."""
    made = []

    def make(lay=2, k=3, block_size=4, **kw):
        s = RoutingStore(lay, k, np.uint8, block_size, f"{os.getpid():x}{secrets.token_hex(4)}", **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.reaper.unlink_all()
        assert not glob.glob(f"{SHM_DIR}/moerl-r3-{s.token}-*")


def test_chunked_prefill_then_decode_hands_over_every_row(store):
    rng = np.random.default_rng(0)
    s = store()
    s.open("a", 0, 16)
    full = rows(rng, 12)
    s.write("a", 0, full[:5])
    s.write("a", 5, full[5:10])
    s.write("a", 10, full[10:11])
    start, out = read_rows(s.token, "a", 11)
    assert start == 0 and np.array_equal(out, full[:11])
    assert not os.path.exists(f"{SHM_DIR}/{segment_name(s.token, 'a')}")  # the reader unlinks


def test_prefix_cache_hit_filled_from_block_hashes(store):
    rng = np.random.default_rng(1)
    s = store()
    a = rows(rng, 10)
    s.add_block_hashes("a", [b"h0"])  # hashes may arrive before the request is opened
    s.open("a", 0, 12)
    s.add_block_hashes("a", [b"h1"])
    s.write("a", 0, a)
    s.finish("a")
    assert s.num_blocks == 2
    # b shares the first 8 tokens: only positions 8.. are computed
    s.open("b", 0, 16)
    s.add_block_hashes("b", [b"h0", b"h1"])
    b_tail = rows(rng, 4)
    s.write("b", 8, b_tail)
    _, out = read_rows(s.token, "b", 12)
    assert np.array_equal(out[:8], a[:8]) and np.array_equal(out[8:], b_tail)


def test_one_step_of_several_requests_lands_at_each_requests_positions(store):
    """A batched step: rows packed in runner order, prefill chunk + decodes; a request
    whose rows do not fit is reported and skipped, a request never opened is skipped,
    and the others' rows are all written."""
    rng = np.random.default_rng(4)
    s = store(lay=3, k=2, block_size=4)
    s.open("x", 0, 12)
    s.open("y", 0, 10)
    s.open("z", 0, 2)
    s.write("y", 0, rows(rng, 7, 3, 2))
    step = rows(rng, 5 + 1 + 1 + 2, 3, 2)
    errors = s.write_step([("x", 0, 5), ("y", 7, 1), ("gone", 3, 1), ("z", 1, 2)], step)
    assert errors == ["request z: positions [1, 3) outside its capacity 2"]
    _, out = read_rows(s.token, "x", 5)
    assert np.array_equal(out, step[:5])
    _, out = read_rows(s.token, "y", 8)
    assert np.array_equal(out[7], step[5])
    with pytest.raises(RoutingMissing, match="position 0"):
        read_rows(s.token, "z", 2)  # nothing of z was written
    with pytest.raises(ValueError, match="dtype"):
        s.write_step([("x", 5, 1)], step[:1].astype(np.uint16))


def test_missing_rows_raise_instead_of_gap(store):
    s = store()
    s.open("c", 0, 8)
    s.add_block_hashes("c", [b"unknown"])
    s.write("c", 4, np.zeros((2, 2, 3), np.uint8))
    with pytest.raises(RoutingMissing, match="position 0") as exc:
        read_rows(s.token, "c", 6)
    assert exc.value.reason == ROWS_MISSING
    with pytest.raises(RoutingMissing, match="does not exist") as exc:
        read_rows(s.token, "never-scheduled", 6)
    assert exc.value.reason == NO_SEGMENT


def test_recompute_overwrites_and_first_position(store):
    rng = np.random.default_rng(2)
    s = store()
    s.open("d", 3, 8)
    r = rows(rng, 6)
    s.write("d", 0, r)
    s.write("d", 0, r)  # preempted and recomputed: same positions again
    start, out = read_rows(s.token, "d", 6)
    assert start == 3 and np.array_equal(out, r[3:])


def test_preempted_request_resumes_its_segment(store):
    rng = np.random.default_rng(3)
    s = store()
    r = rows(rng, 9)
    s.open("p", 2, 12)
    s.write("p", 0, r[:6])
    s.finish("p")  # vLLM reports a preemption to the worker as a finish
    assert s.resume("p")
    s.write("p", 4, r[4:9])  # recomputed from its cached prefix on
    start, out = read_rows(s.token, "p", 9)
    assert start == 2 and np.array_equal(out, r[2:9])
    assert not s.resume("never-opened")


def test_segments_of_dead_servers_are_swept(store):
    s = store()
    s.open("a", 0, 4)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{SHM_DIR}/moerl-r3-{dead.pid:x}{secrets.token_hex(4)}-abc"
    open(stale, "w").close()
    assert sweep_dead_servers() >= 1
    assert not os.path.exists(stale)
    assert os.path.exists(f"{SHM_DIR}/{segment_name(s.token, 'a')}")  # this process's server lives


def test_no_room_for_a_segment_is_a_clear_error_and_the_reader_says_so(store, monkeypatch):
    """A full /dev/shm: the worker's open fails clearly, leaves an empty stub (no pages), does not
    retry the request every step, and the API server's read reports shm_full."""
    s = store(reaper=SegmentReaper(grace_s=10.0))

    def fake_full_tmpfs(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(os, "posix_fallocate", fake_full_tmpfs)
        with pytest.raises(OSError, match="larger /dev/shm"):
            s.open("big", 0, 1 << 20)
    stub = f"{SHM_DIR}/{segment_name(s.token, 'big')}"
    assert os.path.getsize(stub) == 0
    assert "big" not in s and s.not_open({"big": 0, "other": 0}) == {"other"}
    assert not s.resume("big")  # preempted and scheduled again: still no segment
    s.write_step([("big", 0, 1)], np.zeros((1, 2, 3), np.uint8))  # its rows are skipped, not an error
    with pytest.raises(RoutingMissing, match="could not reserve") as exc:
        read_rows(s.token, "big", 4)
    assert exc.value.reason == SHM_FULL and not os.path.exists(stub)

    s.open("c", 0, 1 << 20)  # room again: the next request is served
    with monkeypatch.context() as mp:
        mp.setattr(os, "posix_fallocate", fake_full_tmpfs)
        with pytest.raises(OSError):
            s.open("unread", 0, 8)
    s.finish("unread")  # aborted: nobody reads its stub, the reaper removes it after the grace period
    assert s.not_open({"unread": 0}) == {"unread"}
    s.reaper.sweep(now=time.monotonic() + 11)
    assert not os.path.exists(f"{SHM_DIR}/{segment_name(s.token, 'unread')}")


def test_bad_writes_are_refused(store):
    s = store()
    s.open("e", 0, 4)
    with pytest.raises(ValueError, match=r"positions \[2, 5\) outside its capacity 4"):
        s.write("e", 2, np.zeros((3, 2, 3), np.uint8))
    with pytest.raises(ValueError, match="does not match"):
        s.write("e", 0, np.zeros((1, 3, 3), np.uint8))
    with pytest.raises(KeyError, match="never opened"):
        s.write("f", 0, np.zeros((1, 2, 3), np.uint8))


def test_reset_forgets_blocks(store):
    s = store(block_size=2)
    s.open("a", 0, 4)
    s.add_block_hashes("a", [b"x"])
    s.write("a", 0, np.ones((2, 2, 3), np.uint8))
    assert s.num_blocks == 1
    s.reset()
    assert s.num_blocks == 0


def test_lru_bound(store):
    s = store(1, 1, block_size=1, max_blocks=3)
    s.open("a", 0, 5)
    s.add_block_hashes("a", [bytes([i]) for i in range(5)])
    s.write("a", 0, np.zeros((5, 1, 1), np.uint8))
    assert s.num_blocks == 3


def test_unread_segments_are_reaped_after_the_grace_period(store):
    s = store(reaper=SegmentReaper(grace_s=10.0))
    s.open("a", 0, 4)
    s.write("a", 0, np.zeros((1, 2, 3), np.uint8))
    path = f"{SHM_DIR}/{segment_name(s.token, 'a')}"
    s.finish("a")  # e.g. aborted: the API server never reads it
    s.reaper.sweep(now=time.monotonic() + 5)
    assert os.path.exists(path)
    s.reaper.sweep(now=time.monotonic() + 11)
    assert not os.path.exists(path)


def test_a_foreign_or_truncated_segment_is_refused(store):
    s = store()
    path = f"{SHM_DIR}/{segment_name(s.token, 'x')}"
    s.reaper.created(os.path.basename(path))
    with open(path, "wb") as f:
        f.write(b"\0" * 100)
    with pytest.raises(RoutingMissing, match="not a moerl rows segment") as exc:
        read_rows(s.token, "x", 1)
    assert exc.value.reason == BAD_SEGMENT


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
    pending = {0: {"routed_experts": "PAYLOAD"}}
    assert inject_into_chunk(mid, pending) == mid
    out = inject_into_chunk(final, pending)
    assert '"routed_experts":"PAYLOAD"' in out and pending == {}
    assert inject_into_chunk("data: [DONE]\n\n", {0: {"routed_experts": "x"}}) == "data: [DONE]\n\n"
    out = inject_into_chunk(final, {0: {"routed_experts_error": "shm_full: no room"}})
    assert json.loads(out[len("data: "):])["choices"][0]["routed_experts_error"] == "shm_full: no room"


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
