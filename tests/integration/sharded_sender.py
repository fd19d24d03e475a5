"""One trainer rank of sharded weight updates, from HF checkpoints (for the integration test).

Holds the FSDP2 ``Shard(0)`` block of every tensor that rank ``rank`` of ``world`` would hold,
plans with ``vllm_ext.transport.plan`` and sends with ``ShardedSender``, as
``rl_loop.trainer.ShardedPublisher`` does from a live model. Kept across updates (one torch
import for the whole test): each line on stdin is one update, ``{"ckpt": DIR, "version": N,
"lane": "shm"|"net"|"te", "fault": F}``; for each it prints its senders' join info (one JSON
line), then, its rings closed, "sent <bytes> <lanes>" or "error <message>". Faults: ``corrupt`` flips a byte of
the first shared-memory piece after it was hashed; ``shape`` announces one tensor transposed;
``stall`` stops every sending thread (one per receiver worker, each past its receiver's join)
at the third piece it reads itself in the verify pass (pieces another lane read come from the
sender's shared reads), where each prints "midway" (the test kills the process once all have).

usage (from the repository root): python -m tests.integration.sharded_sender RANK WORLD --tp 1,2 [--bucket-bytes N] < updates
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from functools import cache
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.conftest import corrupt_first_ring_piece
from vllm_ext.transport.format import dtype_name
from vllm_ext.transport.plan import expert_groups, fsdp_owned, replica_needs, reshard
from vllm_ext.transport.shm import RingShape, RingWriter
from vllm_ext.transport.sharded import ShardedSender

_PUBLISH = RingWriter._publish
_CORRUPT_FIRST = corrupt_first_ring_piece(_PUBLISH)


@cache
def weights(ckpt: str) -> dict:
    """The checkpoint in the sharded transport's wire layout (experts stacked)."""
    w = load_file(str(Path(ckpt) / "model.safetensors"))
    groups = expert_groups({n: t.shape for n, t in w.items()})
    return {g: w[g] if ms == [g] else torch.stack([w[m] for m in ms]) for g, ms in groups.items()}


def update(rank: int, world: int, tps: list[int], bucket_bytes: int, ckpt: str, version: int, lane: str,
           fault: str) -> None:
    w = weights(ckpt)
    shapes = {n: tuple(t.shape) for n, t in w.items()}
    owned = fsdp_owned(shapes, world)
    needs = [n for tp in tps for n in replica_needs(shapes, tp)]
    pieces = [p for p in reshard(list(shapes), owned, needs) if p.sender == rank]
    sender = ShardedSender(rank, len(needs), timeout_s=60, bucket_bytes=bucket_bytes,
                           shm=RingShape() if lane == "shm" else None, te=lane == "te")
    announced = dict(shapes)
    if fault == "shape":
        name = next(n for n, s in shapes.items() if len(s) == 2 and s[0] != s[1] and "layers.1." in n)
        announced[name] = shapes[name][::-1]
    RingWriter._publish = _CORRUPT_FIRST if fault == "corrupt" else _PUBLISH
    per_thread = threading.local()  # one sending thread per receiver worker: each stalls halfway
    say = threading.Lock()  # print() writes the line and its newline apart: two threads' lines interleaved

    def read(p):
        per_thread.n = getattr(per_thread, "n", 0) + 1
        if fault == "stall" and per_thread.n == 3:
            with say:
                sys.stdout.write("midway\n")
                sys.stdout.flush()
            threading.Event().wait()
        return w[p.name][tuple(slice(a, b) for a, b in p.box)].contiguous()

    print(json.dumps(sender.update_infos(version)), flush=True)
    try:
        n = sender.send(pieces, read, {k: dtype_name(t.dtype) for k, t in w.items()}, announced, version)
        result = f"sent {n} {json.dumps(sender.lanes)}"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result = f"error {exc}"
    finally:
        sender.close()
    print(result, flush=True)  # after close: the test then finds this rank's rings gone


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("--tp", default="1")
    ap.add_argument("--bucket-bytes", type=int, default=1 << 20)
    args = ap.parse_args()
    tps = [int(t) for t in args.tp.split(",")]
    for line in sys.stdin:
        u = json.loads(line)
        update(args.rank, args.world, tps, args.bucket_bytes, u["ckpt"], int(u["version"]), u.get("lane", "shm"),
               u.get("fault", ""))


if __name__ == "__main__":
    main()
