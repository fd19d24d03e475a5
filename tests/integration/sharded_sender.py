"""One trainer rank of a sharded weight update, from an HF checkpoint (for tests and benchmarks).

Holds the FSDP2 ``Shard(0)`` block of every tensor that rank ``rank`` of ``world`` would hold,
plans with ``vllm_ext.weights.plan`` and sends with ``ShardedSender``, exactly as
``rl_loop.trainer.ShardedPublisher`` does from a live model. Prints its senders' join info
(one JSON line), then "sent <bytes>" or "error <message>". ``--fault``: ``corrupt`` flips a
byte of the first shared-memory piece after it was hashed; ``shape`` announces one tensor
transposed; ``stall`` stops every sending thread at its third piece of the verify pass
(the test kills it there).

usage: python tests/integration/sharded_sender.py CKPT RANK WORLD VERSION --tp 1,2 [--lane shm|net] [--fault F]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from safetensors.torch import load_file  # noqa: E402

from vllm_ext.weights.format import dtype_name  # noqa: E402
from vllm_ext.weights.plan import fsdp_boxes, replica_needs, reshard  # noqa: E402
from vllm_ext.weights.shm import RingShape, RingWriter  # noqa: E402
from vllm_ext.weights.sharded import ShardedSender  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("version", type=int)
    ap.add_argument("--tp", default="1")
    ap.add_argument("--lane", default="shm", choices=["shm", "net", "te"])
    ap.add_argument("--fault", default="", choices=["", "corrupt", "shape", "stall"])
    ap.add_argument("--bucket-bytes", type=int, default=1 << 20)
    args = ap.parse_args()
    w = load_file(str(Path(args.ckpt) / "model.safetensors"))
    shapes = {n: tuple(t.shape) for n, t in w.items()}
    owned = {n: [(r, b) for r, b in enumerate(fsdp_boxes(s, args.world)) if b] for n, s in shapes.items()}
    needs = [n for tp in map(int, args.tp.split(",")) for n in replica_needs(shapes, tp)]
    pieces = [p for p in reshard(list(shapes), owned, needs) if p.sender == args.rank]
    sender = ShardedSender(args.rank, len(needs), timeout_s=60, bucket_bytes=args.bucket_bytes,
                           shm=RingShape() if args.lane == "shm" else None, te=args.lane == "te")
    announced = dict(shapes)
    if args.fault == "shape":
        name = next(n for n, s in shapes.items() if len(s) == 2 and s[0] != s[1] and "layers.1." in n)
        announced[name] = shapes[name][::-1]
    if args.fault == "corrupt":
        publish = RingWriter._publish

        def corrupt_first(self, n, digest):
            if self.seq == 0:
                self.ring.view[self.ring.slot_offset(0) + n // 2] ^= 0x01
            publish(self, n, digest)

        RingWriter._publish = corrupt_first
    per_thread = threading.local()  # one sending thread per receiver worker: each stalls halfway

    def read(p):
        per_thread.n = getattr(per_thread, "n", 0) + 1
        if args.fault == "stall" and per_thread.n == 3:
            print("midway", flush=True)
            threading.Event().wait()
        return w[p.name][tuple(slice(a, b) for a, b in p.box)].contiguous()

    print(json.dumps(sender.update_infos(args.version)), flush=True)
    try:
        n = sender.send(pieces, read, {k: dtype_name(t.dtype) for k, t in w.items()}, announced, args.version)
        print(f"sent {n} {json.dumps(sender.lanes)}", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        print(f"error {exc}", flush=True)
    finally:
        sender.close()


if __name__ == "__main__":
    main()
