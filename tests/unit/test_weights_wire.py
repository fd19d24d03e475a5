"""vllm_ext.transport: both transports (``wire``: filesystem, ``stream``: torch.distributed with
the ``shm`` ring) deliver a whole update or refuse it (no vLLM).

Streaming runs on both data lanes: the shared-memory ring (same host, the
default) and gloo broadcasts (``shm=None``), with rings of 4 KiB slots so that
tensors and buckets are cut into many pieces."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading

import pytest
import torch

from vllm_ext.transport import shm
from vllm_ext.transport.shm import RingShape, RingWriter, ShmRing, choose, sweep
from vllm_ext.transport.format import TensorMeta, WeightUpdateError, check_against
from vllm_ext.transport.stream import StreamReceiver, StreamSender, UpdateRefused, stream_receive, unit_plan
from vllm_ext.transport.wire import COMMIT_MARKER, read_fs, write_fs


def weights():
    """Mixed dtypes and shapes: packed small tensors, tensors of many slots, odd sizes, a scalar."""
    g = torch.Generator().manual_seed(0)
    return [("model.embed.weight", torch.randn(64, 32, generator=g)),
            ("model.layers.0.w", torch.randn(300, 7, generator=g).to(torch.bfloat16)),
            ("model.layers.0.b", torch.randn(5, generator=g)),
            ("model.layers.0.scale", torch.tensor(0.5)),
            ("model.layers.0.ids", torch.randint(-2**40, 2**40, (3, 11), generator=g)),
            ("model.layers.0.mask", torch.rand(9, generator=g) > 0.5),
            ("model.layers.0.h", torch.randn(17, 3, generator=g).half()),
            ("model.layers.1.w", torch.randn(1000, 40, generator=g)),
            ("model.layers.1.q", torch.randint(0, 256, (4097,), dtype=torch.uint8, generator=g)),
            ("lm_head.weight", torch.randn(64, 32, generator=g))]


def test_fs_round_trip_is_exact_and_versioned(tmp_path):
    items = weights()
    write_fs(tmp_path / "v3", iter(items), 3, shard_bytes=20_000)
    assert len(list((tmp_path / "v3").glob("*.safetensors"))) > 1
    v, got = read_fs(tmp_path / "v3", version=3, expected={m.name: m for m in map(lambda kv: TensorMeta.of(*kv), items)})
    assert v == 3 and [k for k, _ in got] == [k for k, _ in items]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(got, items))
    with pytest.raises(WeightUpdateError, match="holds version 3"):
        read_fs(tmp_path / "v3", version=4)


def test_fs_refuses_uncommitted_corrupted_and_truncated(tmp_path):
    d = tmp_path / "v1"
    write_fs(d, weights(), 1, shard_bytes=20_000)
    shard = sorted(d.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(WeightUpdateError, match="checksum mismatch"):
        read_fs(d)
    shard.write_bytes(bytes(raw[:-10]))
    with pytest.raises(WeightUpdateError, match="truncated"):
        read_fs(d)
    (d / COMMIT_MARKER).unlink()
    with pytest.raises(WeightUpdateError, match="no commit marker"):
        read_fs(d)


def test_layout_check_names_missing_extra_and_misshaped():
    exp = {m.name: m for m in (TensorMeta("a", "float32", (2, 3)), TensorMeta("b", "bfloat16", (4,)),
                               TensorMeta("c", "int64", (1,)))}
    check_against([TensorMeta("a", "bfloat16", (2, 3)), TensorMeta("b", "float32", (4,)),
                   TensorMeta("c", "int64", (1,))], exp)  # float casts are allowed
    with pytest.raises(WeightUpdateError) as e:
        check_against([TensorMeta("a", "float32", (3, 2)), TensorMeta("x", "float32", (1,)),
                       TensorMeta("c", "float32", (1,))], exp)
    msg = str(e.value)
    assert "1 missing: b" in msg and "1 unexpected: x" in msg and "a: update [3, 2], model [2, 3]" in msg
    assert "c: update dtype float32, model int64" in msg


def test_unit_plan_packs_small_and_isolates_large():
    metas = [TensorMeta(str(i), "uint8", (n,)) for i, n in enumerate([10, 60, 1000, 30, 30])]
    plan = unit_plan(metas, 128)
    assert plan == [[(0, 0), (1, 64)], [(2, 0)], [(3, 0), (4, 64)]]


SLOTS = RingShape(slots=2, slot_bytes=4096)


def _recv(inbox, expected, q):
    """A receiver process, like a replica: one update per info from inbox (None ends), a
    summary of each to q; it keeps its StreamReceiver (buffers, groups, ring) throughout."""
    receiver = StreamReceiver()
    while (info := inbox.get()) is not None:
        try:
            v, items = receiver.receive(**info, expected=expected)
            ref = weights()  # deterministic: compare here, send a summary back
            same = [k for k, _ in items] == [k for k, _ in ref] and all(
                torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape for (_, a), (_, b) in zip(items, ref))
            q.put(("ok", v, same, receiver.channel.groups.gen))
        except WeightUpdateError as exc:
            q.put(("err", str(exc), None))


def _stream(updates, expected=None, *, receivers=1, shm_shape=SLOTS, bucket_bytes=4096, timeout_s=60.0,
            tamper=lambda rank, info: info):
    """Run updates [(version, items to send)] through one sender and ``receivers``
    receiver processes: [(summary of rank 1, lanes, send error or None, summaries
    of all ranks)] per update."""
    s = StreamSender(1 + receivers, bucket_bytes=bucket_bytes, streams=2, timeout_s=timeout_s, shm=shm_shape)
    ctx = mp.get_context("spawn")
    inboxes, outs = [ctx.Queue() for _ in range(receivers)], [ctx.Queue() for _ in range(receivers)]
    procs = [ctx.Process(target=_recv, args=(i, expected, o)) for i, o in zip(inboxes, outs)]
    for p in procs:
        p.start()
    out = []
    try:
        for version, items in updates:
            for rank, inbox in enumerate(inboxes, 1):
                inbox.put(tamper(rank, s.update_info(rank, version)))
            err = None
            try:
                s.send([TensorMeta.of(k, v) for k, v in weights()], items, version)
            except Exception as exc:  # noqa: BLE001
                err = exc
            got = [o.get(timeout=120) for o in outs]
            out.append((got[0], dict(s.lanes), err, got))
    finally:
        for inbox, p in zip(inboxes, procs):
            inbox.put(None)
            p.join(60)
        ring = s.ring
        s.close()
    if ring is not None:
        assert not ring.path.exists(), "close() must unlink the ring"
    return out


@pytest.mark.parametrize("bucket_bytes,shm_shape,lane", [
    (4096, SLOTS, "shm"),
    (16384, SLOTS, "shm"),  # packed buckets span several slots
    (4096, RingShape(3, 8192), "shm"),
    (4096, None, "net"),  # network path forced
])
def test_stream_round_trip_is_exact(bucket_bytes, shm_shape, lane):
    (res, lanes, err, _), = _stream([(5, weights())], shm_shape=shm_shape, bucket_bytes=bucket_bytes)
    assert res[:3] == ("ok", 5, True) and lanes == {1: lane} and err is None


def _elsewhere(rank, info):
    """Make the receiver of rank 2 believe the sender runs on another host."""
    return {**info, "shm": {**info["shm"], "host": "elsewhere/0"}} if rank == 2 else info


def test_stream_to_three_receivers_on_both_lanes_at_once():
    """Rank 2 falls back to the network (its sender seems remote) while 1 and 3 share the ring."""
    (_, lanes, err, got), (_, _, _, again) = _stream([(5, weights()), (6, weights())], receivers=3, tamper=_elsewhere)
    assert lanes == {1: "shm", 2: "net", 3: "shm"} and err is None
    assert [r[:3] for r in got] == [("ok", 5, True)] * 3 and [r[:3] for r in again] == [("ok", 6, True)] * 3


@pytest.mark.parametrize("shm_shape", [SLOTS, None], ids=["shm", "net"])
def test_stream_shape_mismatch_drains_then_refuses(shm_shape):
    items = weights()
    expected = {k: TensorMeta.of(k, v) for k, v in items}
    expected["model.layers.1.w"] = TensorMeta("model.layers.1.w", "float32", (40, 1000))
    (res, _, err, _), = _stream([(5, items)], expected, shm_shape=shm_shape)
    assert res[0] == "err" and "model.layers.1.w: update [1000, 40], model [40, 1000]" in res[1]
    assert isinstance(err, UpdateRefused), "the sender learns of the refusal at the close"


def test_shm_corrupted_piece_is_refused_and_next_update_succeeds(monkeypatch):
    publish, writers = RingWriter._publish, []

    def corrupt_third_piece_of_second_update(self, n, digest):
        if self not in writers:  # a writer per update
            writers.append(self)
        if len(writers) == 2 and self.seq == 2:  # after the sender hashed it: a byte changed in shared memory
            self.ring.view[self.ring.slot_offset(self.seq) + n // 2] ^= 0x10
        publish(self, n, digest)

    monkeypatch.setattr(RingWriter, "_publish", corrupt_third_piece_of_second_update)
    first, bad, good = _stream([(4, weights()), (5, weights()), (6, weights())])
    assert first[0][:3] == ("ok", 4, True)
    assert bad[0][0] == "err" and "checksum mismatch in piece 2" in bad[0][1] and bad[1] == {1: "shm"}
    assert good[0][:3] == ("ok", 6, True) and good[0][3] == first[0][3], "a refusal keeps the groups"


def test_shm_sender_abort_is_reported_and_next_update_succeeds():
    def dies_midway():
        items = weights()
        yield from items[:7]
        raise RuntimeError("exporter failed")

    bad, good = _stream([(5, dies_midway()), (6, weights())])
    assert bad[0][0] == "err" and "aborted" in bad[0][1] and "exporter failed" in str(bad[2])
    assert good[0][:3] == ("ok", 6, True)


@pytest.mark.parametrize("shm_shape", [SLOTS, None], ids=["shm", "net"])
def test_groups_are_kept_across_updates_and_rebuilt_after_a_failure(shm_shape):
    """Gloo groups cost 10-20 ms to destroy here: consecutive updates share them, a
    sender-side failure drops them and the next update rebuilds them everywhere.
    (A network receiver only learns of the failure when its broadcast times out.)"""
    items = weights()

    def dies():
        yield from items[:3]
        raise RuntimeError("exporter failed")

    runs = _stream([(1, items), (2, items), (3, dies()), (4, items)], shm_shape=shm_shape, timeout_s=10.0)
    gens = [res[3] if res[0] == "ok" else None for res, *_ in runs]
    assert [res[:3] for res, *_ in runs[:2]] == [("ok", 1, True), ("ok", 2, True)] and runs[2][0][0] == "err"
    assert gens[0] == gens[1] and gens[3] == gens[1] + 1


def _doomed_sender(q):
    s = StreamSender(2, timeout_s=30, bucket_bytes=4096, shm=SLOTS)
    q.put(s.update_info(1, 7))

    def stalls_midway():
        items = weights()
        yield from items[:7]
        q.put("midway")
        threading.Event().wait()

    s.send([TensorMeta.of(k, v) for k, v in weights()], stalls_midway(), 7)


def test_shm_killed_sender_is_detected_and_its_ring_removed():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_doomed_sender, args=(q,))
    p.start()
    errors = []
    try:
        info = q.get(timeout=120)
        path = shm.SHM_DIR / info["shm"]["name"]

        def receive():
            try:
                stream_receive(**info)
            except WeightUpdateError as exc:
                errors.append(str(exc))

        t = threading.Thread(target=receive)
        t.start()
        assert q.get(timeout=120) == "midway"
        assert path.exists()
        os.kill(p.pid, signal.SIGKILL)
        t.join(60)
        assert not t.is_alive()
    finally:
        p.kill()
        p.join()
    assert errors and "lost the peer" in errors[0]
    assert not path.exists(), "the receiver removes the ring its dead sender left"


def test_a_sender_gone_before_the_receiver_joins_fails_the_join_at_once(monkeypatch):
    """Its store no longer listens: the receiver gives up after the connect timeout (5 s, here
    shortened to 1 s), not after the update's operation timeout (120 s here)."""
    import socket
    import time

    from vllm_ext.transport import channel

    monkeypatch.setattr(channel, "CONNECT_TIMEOUT_S", 1.0)
    with socket.socket() as sock:  # a port nothing listens on any more
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(WeightUpdateError, match=f"cannot reach the sender at 127.0.0.1:{port}"):
        stream_receive(transport="stream", version=3, addr="127.0.0.1", port=port, rank=1, world_size=2,
                       timeout_s=120.0, session="3-0", sender="gone", shm=None)
    assert time.monotonic() - t0 < 4 * channel.CONNECT_TIMEOUT_S + 20  # c10d may retry the connect once; was 120 s


def _ring_owner(q):
    ring = ShmRing.create(1, SLOTS)
    q.put(ring.name)
    threading.Event().wait()


def test_rings_are_removed_on_close_and_after_their_sender_dies():
    ring = ShmRing.create(2, SLOTS)
    assert ring.path.exists() and ring.name not in sweep(), "a live sender's ring is kept"
    ring.close()
    assert not ring.path.exists()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_ring_owner, args=(q,))
    p.start()
    name = q.get(timeout=120)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    assert (shm.SHM_DIR / name).exists()
    assert name in sweep() and not (shm.SHM_DIR / name).exists()


def test_lane_falls_back_to_network_with_a_reason():
    ring = ShmRing.create(1, SLOTS)
    try:
        offer = ring.offer().to_json()
        assert choose(offer, 0)[0] is not None
        for changed, reason in [(None, "offers no shared memory"), ({**offer, "host": "elsewhere/0"}, "another host"),
                                ({**offer, "token": "00" * 8}, "token differs"),
                                ({**offer, "name": offer["name"] + "x"}, "cannot open"),
                                ({**offer, "checksum": "crc32"}, "hashes with crc32")]:
            got, why = choose(changed, 0)
            assert got is None and reason in why, (reason, why)
        assert choose(offer, 1)[0] is None  # a rank the ring has no reader slot for
    finally:
        ring.close()
