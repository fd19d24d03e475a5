"""The resharding plan: which trainer rank sends which slice of which tensor to which replica worker.

Plain functions of shapes and layouts (no torch, no vLLM, no communication), so the
trainer ranks, the replicas and a planner on a laptop all derive the same plan.

* The trainer's layout is what each rank holds of each HF tensor, as boxes of the
  global tensor (``owned``): FSDP2's ``Shard(0)`` gives row blocks, expert parallel
  whole experts (one HF tensor per expert), ``Replicate`` the same box on several
  ranks. ``fsdp_boxes`` gives FSDP2's chunking for a tensor.
* A replica worker's layout is the box of each HF tensor its vLLM tensor-parallel
  rank loads (``vllm_tp_box``: column-parallel weights split on dim 0, row-parallel
  on dim 1, vocabulary-parallel ones on padded vocab blocks, the rest replicated).
* ``reshard`` intersects them: every needed box is covered exactly once by pieces,
  each piece sent by one rank that owns it (replicated ownership is spread over the
  owners by bytes), so no rank sends what it does not hold and nothing is gathered.
* The tensors the plan moves are the checkpoint's, except that a projection's
  per-expert tensors travel stacked (``expert_groups``): both ends derive the same
  wire layout from the same HF shapes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Box", "Piece", "TpRules", "fsdp_boxes", "vllm_tp_box", "replica_needs", "reshard", "box_numel",
           "intersect", "check_cover", "expert_groups", "expert_members", "wire_shapes", "EXPERT_GROUP_ELEMS"]

Box = tuple[tuple[int, int], ...]  # [start, stop) per dim of the global tensor


def box_numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= max(0, b - a)
    return n


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(s)) for s in shape)


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def fsdp_boxes(shape: Sequence[int], world: int) -> list[Box | None]:
    """Each rank's box under FSDP2 ``Shard(0)`` (torch.chunk: ceil-sized blocks, trailing
    ranks may hold nothing: None)."""
    if not shape:
        return [full_box(shape)] * world
    rows = int(shape[0])
    step = -(-rows // world)
    out: list[Box | None] = []
    for r in range(world):
        lo, hi = min(r * step, rows), min((r + 1) * step, rows)
        out.append(((lo, hi), *full_box(shape[1:])) if lo < hi else None)
    return out


def fsdp_owned(shapes: Mapping[str, Sequence[int]], world: int) -> dict[str, list[tuple[int, Box]]]:
    """``reshard``'s ``owned`` for a model sharded by FSDP2 ``Shard(0)`` over ``world`` ranks:
    per tensor, (rank, box) for every rank that holds part of it."""
    return {n: [(r, b) for r, b in enumerate(fsdp_boxes(s, world)) if b is not None] for n, s in shapes.items()}


@dataclass(frozen=True)
class TpRules:
    """How vLLM shards HF tensors over tensor-parallel ranks, by name (Qwen3-MoE and
    DeepSeek-V3/Kimi-K2 layers). ``num_kv_heads``: below the TP size vLLM replicates
    k/v projections; ``vocab_pad``: VocabParallelEmbedding's padding unit."""

    num_kv_heads: int | None = None
    vocab_pad: int = 64
    column: str = r"\.(q_proj|q_b_proj|kv_b_proj|gate_proj|up_proj)\.weight$"
    kv: str = r"\.(k_proj|v_proj)\.weight$"
    row: str = r"\.(o_proj|down_proj)\.weight$"
    vocab: str = r"(embed_tokens|lm_head)\.weight$"


# a wire tensor of stacked experts holds at most this many elements (8 MB in bf16); at least one expert
EXPERT_GROUP_ELEMS = 1 << 22
_EXPERT = re.compile(r"^(.+\.experts\.)(\d+)(\..+)$")
_GROUP = re.compile(r"^(.+\.experts\.)(\d+)-(\d+)(\..+)$")


def expert_groups(shapes: Mapping[str, Sequence[int]], max_elems: int = EXPERT_GROUP_ELEMS) -> dict[str, list[str]]:
    """The sharded transport's wire tensors: name -> the HF tensors it carries, in ``shapes``' order.

    Every cost of an update past the bytes (planning, reading, framing, hashing, placing,
    vLLM's weight-loader calls) is paid per tensor, and a checkpoint stores one tensor per
    expert and projection: 576 of tiny Kimi-K2's 633, 69,000 of Kimi-K2 1T's. So the
    experts of one projection (``<p>.experts.<e>.<s>`` for experts 0..E-1, one shape)
    travel as runs of consecutive experts stacked on a new dim 0, ``<p>.experts.<a>-<b>.<s>``
    for experts a..b-1, each run at most ``max_elems`` elements; a run of one expert, and
    every other tensor, travels as itself."""
    runs: dict[tuple[str, str], dict[int, str]] = {}
    for n in shapes:
        if m := _EXPERT.match(n):
            runs.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = n
    out: dict[str, list[str]] = {}
    for n, shape in shapes.items():
        m = _EXPERT.match(n)
        members = runs.get((m.group(1), m.group(3)), {}) if m else {}
        if not members or sorted(members) != list(range(len(members))) \
                or any(tuple(shapes[x]) != tuple(shape) for x in members.values()):
            out[n] = [n]
            continue
        e = int(m.group(2))
        k = max(1, max_elems // max(1, box_numel(full_box(shape))))
        if k == 1:
            out[n] = [n]
        elif e % k == 0:
            hi = min(e + k, len(members))
            out[f"{m.group(1)}{e}-{hi}{m.group(3)}"] = [members[i] for i in range(e, hi)]
    return out


def expert_members(name: str) -> list[str] | None:
    """The HF tensors a stack of experts carries, in order (None: ``name`` is not a stack)."""
    if (m := _GROUP.match(name)) is None:
        return None
    return [f"{m.group(1)}{e}{m.group(4)}" for e in range(int(m.group(2)), int(m.group(3)))]


def wire_shapes(shapes: Mapping[str, Sequence[int]], groups: Mapping[str, Sequence[str]]) -> dict[str, tuple[int, ...]]:
    """Each wire tensor's shape: a stack of experts is (experts, *one expert's shape)."""
    return {g: tuple(shapes[g]) if list(ms) == [g] else (len(ms), *shapes[ms[0]]) for g, ms in groups.items()}


def vllm_tp_box(name: str, shape: Sequence[int], tp: int, rank: int, rules: TpRules = TpRules()) -> Box:
    """The box of HF tensor ``name`` that vLLM's TP rank ``rank`` of ``tp`` loads (of each
    expert alike, for a stack of experts)."""
    if _GROUP.match(name) and len(shape) == 3:
        return ((0, int(shape[0])), *vllm_tp_box(name, shape[1:], tp, rank, rules))
    box = full_box(shape)
    if tp == 1 or len(shape) != 2:
        return box
    rows, cols = int(shape[0]), int(shape[1])

    def block(n: int, dim_box: int) -> Box:
        if n % tp:
            raise ValueError(f"{name}: dim {dim_box} of {list(shape)} does not split over TP {tp}")
        k = n // tp
        return tuple((rank * k, (rank + 1) * k) if d == dim_box else b for d, b in enumerate(box))

    if re.search(rules.vocab, name):
        padded = -(-rows // rules.vocab_pad) * rules.vocab_pad
        per = padded // tp
        lo, hi = min(rank * per, rows), min((rank + 1) * per, rows)
        return ((lo, hi), (0, cols))
    if re.search(rules.kv, name):
        if rules.num_kv_heads is not None and rules.num_kv_heads < tp:
            return box
        return block(rows, 0)
    if re.search(rules.column, name):
        return block(rows, 0)
    if re.search(rules.row, name):
        return block(cols, 1)
    return box


def replica_needs(shapes: Mapping[str, Sequence[int]], tp: int, rules: TpRules = TpRules()) -> list[dict[str, Box]]:
    """Per TP rank of one replica: name -> box it loads."""
    return [{n: vllm_tp_box(n, s, tp, r, rules) for n, s in shapes.items()} for r in range(tp)]


@dataclass(frozen=True)
class Piece:
    """``box`` of tensor ``name``, sent by trainer rank ``sender`` to ``receiver``."""

    name: str
    box: Box
    sender: int
    receiver: int

    def to_json(self) -> list:
        return [self.name, [list(b) for b in self.box], self.sender, self.receiver]

    @classmethod
    def from_json(cls, obj) -> "Piece":
        name, box, s, r = obj
        return cls(str(name), tuple((int(a), int(b)) for a, b in box), int(s), int(r))


def reshard(order: Sequence[str], owned: Mapping[str, Sequence[tuple[int, Box]]],
            needs: Sequence[Mapping[str, Box]], itemsize: Mapping[str, int] | None = None) -> list[Piece]:
    """Pieces in ``order`` (tensor order, then receiver, then box): for every receiver
    (index into ``needs``) and tensor, the needed box cut by the owners' boxes.

    ``owned[name]``: (rank, box) for every rank holding part of ``name``. Where several
    ranks hold the same bytes, the one that has sent the fewest bytes so far sends."""
    sent: dict[int, int] = {}
    out: list[Piece] = []
    for name in order:
        holders = owned.get(name, ())
        distinct: dict[Box, list[int]] = {}
        for rank, box in holders:
            distinct.setdefault(box, []).append(rank)
        for recv, need in enumerate(needs):
            if name not in need:
                continue
            for box, ranks in sorted(distinct.items()):
                cut = intersect(box, need[name])
                if cut is None:
                    continue
                rank = min(ranks, key=lambda r: (sent.get(r, 0), r))
                sent[rank] = sent.get(rank, 0) + box_numel(cut) * (itemsize or {}).get(name, 1)
                out.append(Piece(name, cut, rank, recv))
    return out


def check_cover(pieces: Sequence[Piece], need: Mapping[str, Box]) -> str | None:
    """Why ``pieces`` (for one receiver) do not tile ``need`` exactly, or None."""
    got: dict[str, int] = {}
    seen: dict[str, list[Box]] = {}
    for p in pieces:
        if p.name not in need:
            return f"{p.name}: not a tensor of the served model"
        if intersect(p.box, need[p.name]) != p.box:
            return f"{p.name}: piece {list(p.box)} lies outside this worker's box {list(need[p.name])}"
        if any(intersect(p.box, q) for q in seen.get(p.name, ())):
            return f"{p.name}: piece {list(p.box)} overlaps another"
        seen.setdefault(p.name, []).append(p.box)
        got[p.name] = got.get(p.name, 0) + box_numel(p.box)
    missing = [n for n in need if got.get(n, 0) != box_numel(need[n])]
    if missing:
        shown = "; ".join(f"{n} ({got.get(n, 0)} of {box_numel(need[n])} elements)" for n in missing[:5])
        return f"{len(missing)} tensor(s) not covered exactly: {shown}"
    return None
