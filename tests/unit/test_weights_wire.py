"""vllm_ext.weights.wire: both transports deliver a whole update or refuse it (no vLLM)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from vllm_ext.weights.wire import (
    COMMIT_MARKER, StreamSender, TensorMeta, WeightUpdateError, check_against, read_fs, stream_receive, unit_plan,
    write_fs,
)


def weights():
    g = torch.Generator().manual_seed(0)
    return [("model.embed.weight", torch.randn(64, 32, generator=g)),
            ("model.layers.0.w", torch.randn(300, 7, generator=g).to(torch.bfloat16)),
            ("model.layers.0.b", torch.randn(5, generator=g)),
            ("model.layers.1.w", torch.randn(1000, 40, generator=g)),
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


def _recv(info, expected, q):
    try:
        v, items = stream_receive(**info, expected=expected)
        ref = weights()  # deterministic: compare here, send a summary back
        same = [k for k, _ in items] == [k for k, _ in ref] and all(
            torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(items, ref))
        q.put(("ok", v, same))
    except WeightUpdateError as exc:
        q.put(("err", str(exc), None))


def _stream(items, expected=None, version=5, send_items=None):
    s = StreamSender(2, bucket_bytes=4096, streams=2, timeout_s=60)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_recv, args=(s.update_info(1, version), expected, q))
    p.start()
    try:
        s.send([TensorMeta.of(k, v) for k, v in items], send_items or items, version)
        return q.get(timeout=120)
    finally:
        p.join(60)
        s.close()


def test_stream_round_trip_is_exact():
    items = weights()
    kind, v, same = _stream(items)
    assert kind == "ok" and v == 5 and same is True


def test_stream_shape_mismatch_drains_then_refuses():
    items = weights()
    expected = {k: TensorMeta.of(k, v) for k, v in items}
    expected["model.layers.1.w"] = TensorMeta("model.layers.1.w", "float32", (40, 1000))
    kind, msg, _ = _stream(items, expected)
    assert kind == "err" and "model.layers.1.w: update [1000, 40], model [40, 1000]" in msg
