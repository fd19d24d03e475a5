"""A replica worker lost in the middle of a sharded update (vllm_ext.transport.sharded), with real processes.

Two trainer ranks (ShardedSenders in this process) update two receiver processes
(TP=1 replicas r0 and r1) over the shm lane. r1 dies: before it joins (killed by
the test, reported through ``gone``), in the verify pass, or in the apply pass (it
SIGKILLs itself). Each rank's update must fail well before the senders' 60 s
operation timeout with one error naming r1 and the pass, while r0, kept across
the cases, ends every update on exactly the new weights; the senders' rings are
gone once they close."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from vllm_ext.transport.format import TensorMeta, WeightUpdateError, dtype_name
from vllm_ext.transport.plan import fsdp_owned, replica_needs, reshard
from vllm_ext.transport.shm import PREFIX, SHM_DIR, RingShape
from vllm_ext.transport.sharded import ShardedReceiver, ShardedSender

RANKS, TIMEOUT_S, BOUND_S = 2, 60.0, 10.0
NAMES = ["replica r0 worker 0", "replica r1 worker 0"]
SPAWN = mp.get_context("spawn")


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    shapes = {"model.embed_tokens.weight": (256, 64), "model.layers.0.self_attn.o_proj.weight": (64, 128),
              "model.layers.0.mlp.gate_proj.weight": (128, 64), "model.layers.0.input_layernorm.weight": (64,)}
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _needs_and_expected(version: int):
    shapes = {n: tuple(t.shape) for n, t in weights(version).items()}
    return replica_needs(shapes, 1)[0], {n: TensorMeta(n, "bfloat16", s) for n, s in shapes.items()}


def _receive(receiver: ShardedReceiver, infos: list[dict], version: int, apply) -> None:
    needs, expected = _needs_and_expected(version)
    receiver.receive(infos, needs, expected, apply, version=version, budget=1 << 16)


def healthy_receiver(conn) -> None:
    """Replica r0: one ShardedReceiver kept across updates, as a vLLM worker keeps it."""
    torch.set_num_threads(1)
    receiver = ShardedReceiver()
    while (job := conn.recv()) is not None:
        infos, version = job
        got: dict[str, str] = {}
        try:
            _receive(receiver, infos, version, lambda items: got.update((n, _digest(t)) for n, t in items))
            conn.send(got)
        except WeightUpdateError as exc:
            conn.send(str(exc))
    receiver.close()


def _die(killed_at) -> None:
    killed_at.value = time.time()
    os.kill(os.getpid(), signal.SIGKILL)


def lost_receiver(infos: list[dict], version: int, where: str, killed_at) -> None:
    """Replica r1: dies where the case says (``before``: waits to be killed without joining)."""
    torch.set_num_threads(1)
    if where == "before":
        time.sleep(3600)
    if where == "verify":  # at the first unit it hashes: the verify pass's first unit
        import vllm_ext.transport.stream as stream

        stream.unit_digest = lambda parts: _die(killed_at)

    def apply(items) -> None:
        next(items)
        _die(killed_at)

    _receive(ShardedReceiver(), infos, version, apply)


@pytest.fixture(scope="module")
def r0():
    ours, theirs = SPAWN.Pipe()
    proc = SPAWN.Process(target=healthy_receiver, args=(theirs,), daemon=True)
    proc.start()
    yield ours
    ours.send(None)
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def _update(version: int, where: str, r0) -> tuple[list[str], float, str | dict]:
    """One update to r0 and r1 with r1 lost ``where``: each rank's error, seconds from r1's
    death to the last rank's error, and what r0 reported."""
    w = weights(version)
    shapes = {n: tuple(t.shape) for n, t in w.items()}
    owned = fsdp_owned(shapes, RANKS)
    pieces = reshard(list(shapes), owned, [replica_needs(shapes, 1)[0]] * 2)
    senders = [ShardedSender(r, 2, timeout_s=TIMEOUT_S, join_timeout_s=TIMEOUT_S, bucket_bytes=2048,
                             shm=RingShape(2, 4096), names=NAMES) for r in range(RANKS)]
    infos = [s.update_infos(version) for s in senders]
    killed_at = SPAWN.Value("d", 0.0)
    r1 = SPAWN.Process(target=lost_receiver, args=([i[1] for i in infos], version, where, killed_at), daemon=True)
    r1.start()
    errors: list[str] = []
    ended = [0.0]

    def gone(receiver: int) -> str | None:
        """What the replicas' driver knows: r1's process exited."""
        return f"its process exited ({r1.exitcode})" if receiver == 1 and r1.exitcode is not None else None

    def send(rank: int) -> None:
        try:
            senders[rank].send([p for p in pieces if p.sender == rank],
                               lambda p: w[p.name][tuple(slice(a, b) for a, b in p.box)].contiguous(),
                               {n: dtype_name(t.dtype) for n, t in w.items()}, shapes, version, gone=gone)
        except WeightUpdateError as exc:
            errors.append(str(exc))
        ended[0] = max(ended[0], time.time())

    threads = [threading.Thread(target=send, args=(r,)) for r in range(RANKS)]
    try:
        for t in threads:
            t.start()
        r0.send(([i[0] for i in infos], version))
        if where == "before":
            time.sleep(1.0)  # both ranks are waiting for r1 to join
            r1.kill()
            killed_at.value = time.time()
        for t in threads:
            t.join(TIMEOUT_S * 3)
        got = r0.recv() if r0.poll(TIMEOUT_S) else "r0 did not answer"
    finally:
        r1.kill()
        r1.join(10)
        for s in senders:
            s.close()
    assert not any(t.is_alive() for t in threads), "a sender is still blocked"
    assert not list(SHM_DIR.glob(f"{PREFIX}{os.getpid()}-*")), "the senders left a ring"
    return errors, ended[0] - killed_at.value, got


@pytest.mark.parametrize("where,phase", [("before", "verify"), ("verify", "verify"), ("apply", "apply")])
def test_lost_replica_fails_its_lanes_fast_and_the_other_replica_updates(r0, where, phase):
    version = {"before": 11, "verify": 12, "apply": 13}[where]
    errors, after_death_s, got = _update(version, where, r0)
    assert len(errors) == RANKS, errors
    for rank, err in enumerate(sorted(errors)):
        assert err.startswith(f"v{version} from trainer rank {rank}: replica r1 worker 0 failed in the {phase} pass:"), err
        assert "replica r0" not in err, err
    if where == "before":
        assert all("will not join: its process exited (-9)" in e for e in errors), errors
    assert after_death_s < BOUND_S, f"{after_death_s:.1f} s from r1's death to the senders' errors"
    assert got == {n: _digest(t) for n, t in weights(version).items()}, got
