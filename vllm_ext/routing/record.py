"""The routing record and its one codec (numpy only).

A *routing record* holds, for every token fed through the model, the top-k
expert ids chosen by every MoE layer: an array ``[rows, num_moe_layers, top_k]``
with ``rows = prompt_len + gen_len - 1`` (the last sampled token is never fed
forward). Dense layers have no rows; ``moe_layers`` lists which decoder layers
the columns are. ``start`` is the position of the first row, so a response can
carry only the rows from a position on (multi-turn requests).

Why a custom codec: the reference system ships uint8/uint16 ids in base64
(4/3 x L x K bytes per token) and stalls seconds per step decoding them. Top-k
is a *set* (its order carries nothing for replay), so a row needs only
log2 C(E, K) bits. This module encodes each row as:

* ``hi``: the multiset of the ids' high bits (``id >> b``), as its index in the
  colex enumeration of multisets (``C(H+K-1, K)`` of them, ``H = ceil(E/2^b)``),
  several rows' indices combined into one byte-aligned mixed-radix integer;
  or, when that table would be too large (many experts, large K), as a unary
  bit pattern (Elias-Fano high part);
* ``lo``: the ``b`` low bits of every id, bit-packed.

Decoding is then table lookups and byte-level bit operations, vectorised in
numpy (no per-row Python), which is what makes >= 1 GB/s of decoded ids
possible without a compiled extension. When rows repeat (skewed routing, or
the same prompt across tokens) a per-layer dictionary scheme is used instead:
distinct rows once, then a small index per row.

Every payload ends with a CRC32 and every field is checked at decode, so a
malformed, truncated or out-of-range payload raises :class:`ValueError`
saying what was wrong instead of yielding a silently wrong record.

Nothing here imports torch or vLLM: the RL loop imports this module to
decode, and the trainer's replay receives plain id arrays.
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "RoutingRecord",
    "encode_record",
    "decode_record",
    "encode_record_b64",
    "decode_record_b64",
    "baseline_bytes_per_token",
    "floor_bits_per_row",
    "canonical_ids",
    "id_dtype",
]

MAGIC = b"MoRR"
VERSION = 1

SCHEME_RAW = 0  # plain ids (fallback; never larger than the baseline)
SCHEME_SET = 1  # per-row set code: hi multiset index + lo bits
SCHEME_DICT = 2  # per-layer dictionary of distinct rows + per-row index

HI_RANK = 0  # hi multiset as index into the colex table
HI_UNARY = 1  # hi multiset as unary bits (Elias-Fano high part)

# Header: magic, version, scheme, reserved, rows, start, layers, top_k, experts.
_HEADER = struct.Struct("<4sBBHIIHHI")
_SET_PARAMS = struct.Struct("<BBBBQQ")  # hi_kind, b, rows_per_group, group_bytes, hi_len, lo_len
_DICT_PARAMS = struct.Struct("<BQ")  # index_bytes, dictionary body length
_CRC = struct.Struct("<I")

# A hi table has at most this many entries (each K ids): keeps decode tables
# cache-friendly and the table build fast.
_MAX_TABLE = 1 << 21
_MAX_EXPERTS = 1 << 16


def id_dtype(num_experts: int) -> np.dtype:
    """Smallest unsigned dtype holding ids < num_experts (the baseline's dtype)."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


def floor_bits_per_row(num_experts: int, top_k: int) -> float:
    """log2 C(E, K): bits one (token, layer) needs when choices are uniform."""
    return math.log2(math.comb(num_experts, top_k))


def baseline_bytes_per_token(num_experts: int, top_k: int, num_layers: int) -> float:
    """Bytes per token of the reference transport: uint8/uint16 ids, base64."""
    return 4.0 / 3.0 * num_layers * top_k * id_dtype(num_experts).itemsize


def canonical_ids(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Sort every row (top-k is a set) and return ids in the record's dtype.

    Raises ValueError on ids out of range or repeated within a row: a top-k
    never picks one expert twice, so a repeat means the capture is wrong.
    """
    a = np.asarray(ids)
    if a.ndim != 3:
        raise ValueError(f"expert ids must be [rows, layers, top_k], got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise ValueError(f"expert ids must be integers, got dtype {a.dtype}")
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"expert id out of range [0, {num_experts}): min {lo}, max {hi}")
    out = np.sort(a.astype(id_dtype(num_experts), copy=False), axis=-1)
    if out.shape[-1] > 1 and out.size and not _strictly_increasing_rows(out.reshape(-1, out.shape[-1])):
        raise ValueError("an expert id repeats within a row (top-k ids must be distinct)")
    return out


@dataclass(frozen=True)
class RoutingRecord:
    """Per-token top-k expert ids of every MoE layer, for one sequence.

    ``expert_ids[i, j, :]`` are the (sorted) experts chosen for the token at
    position ``start + i`` by decoder layer ``moe_layers[j]``.
    """

    expert_ids: np.ndarray
    moe_layers: tuple[int, ...]
    num_experts: int
    start: int = 0
    _canonical: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (0 < self.num_experts <= _MAX_EXPERTS):
            raise ValueError(f"num_experts must be in [1, {_MAX_EXPERTS}], got {self.num_experts}")
        layers = tuple(int(x) for x in self.moe_layers)
        object.__setattr__(self, "moe_layers", layers)
        if any(x < 0 or x > 0xFFFF for x in layers):
            raise ValueError(f"moe_layers must be in [0, 65535], got {layers}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"moe_layers repeat: {layers}")
        if self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")
        ids = self.expert_ids
        if not self._canonical:
            ids = canonical_ids(ids, self.num_experts)
            object.__setattr__(self, "expert_ids", ids)
        if ids.shape[1] != len(layers):
            raise ValueError(f"expert_ids has {ids.shape[1]} layer columns but moe_layers lists {len(layers)}")
        if not (1 <= ids.shape[2] <= min(self.num_experts, 0xFFFF)):
            raise ValueError(f"top_k must be in [1, num_experts], got {ids.shape[2]}")

    @property
    def num_rows(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[2])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingRecord):
            return NotImplemented
        return (
            self.moe_layers == other.moe_layers
            and self.num_experts == other.num_experts
            and self.start == other.start
            and self.expert_ids.shape == other.expert_ids.shape
            and bool(np.array_equal(self.expert_ids, other.expert_ids))
        )

    def slice_from(self, position: int) -> "RoutingRecord":
        """The rows for positions >= ``position`` (for multi-turn requests)."""
        if position < self.start:
            raise ValueError(f"position {position} is before the record's start {self.start}")
        cut = min(position - self.start, self.num_rows)
        return RoutingRecord(self.expert_ids[cut:], self.moe_layers, self.num_experts,
                             self.start + cut, _canonical=True)

    def encode(self) -> bytes:
        return encode_record(self)

    def to_b64(self) -> str:
        return encode_record_b64(self)

    @classmethod
    def decode(cls, payload: bytes | bytearray | memoryview) -> "RoutingRecord":
        return decode_record(payload)

    @classmethod
    def from_b64(cls, text: str | bytes) -> "RoutingRecord":
        return decode_record_b64(text)


# --------------------------------------------------------------------------
# combinatorial tables


@functools.lru_cache(maxsize=64)
def _binom_table(n: int, k: int) -> np.ndarray:
    """C(i, j) for i < n + 1, j <= k as uint64 (entries fit: callers ensure)."""
    t = np.zeros((n + 1, k + 1), dtype=np.uint64)
    for i in range(n + 1):
        for j in range(min(i, k) + 1):
            t[i, j] = math.comb(i, j)
    return t


@functools.lru_cache(maxsize=32)
def _hi_table(universe: int, k: int, multiset: bool, dtype_str: str, shift: int) -> np.ndarray:
    """All k-subsets (or multisets) of [0, universe) in colex order, as rows.

    Row r of the table is the (sorted) hi tuple whose colex index is r; values
    are pre-shifted left by ``shift`` so decode only has to OR in the lo bits.
    Built by vectorised colex unranking (once per shape, cached).
    """
    n = universe + (k - 1 if multiset else 0)
    count = math.comb(n, k)
    binom = _binom_table(n, k)
    r = np.arange(count, dtype=np.uint64)
    out = np.empty((count, k), dtype=np.int64)
    for j in range(k, 0, -1):
        col = binom[:, j]  # non-decreasing in i
        c = np.searchsorted(col, r, side="right").astype(np.int64) - 1
        out[:, j - 1] = c - ((j - 1) if multiset else 0)
        r = r - col[c]
    return (out << shift).astype(np.dtype(dtype_str))


def _colex_index(vals: np.ndarray, multiset: bool, n: int) -> np.ndarray:
    """Colex index of sorted rows ``vals`` [N, k] (inverse of _hi_table)."""
    k = vals.shape[1]
    binom = _binom_table(n, k)
    idx = np.zeros(vals.shape[0], dtype=np.uint64)
    for j in range(k):
        v = vals[:, j].astype(np.int64) + (j if multiset else 0)
        idx += binom[v, j + 1]
    return idx


# --------------------------------------------------------------------------
# set-code layout choice


@dataclass(frozen=True)
class _SetLayout:
    hi_kind: int
    b: int  # lo bits per id
    rows_per_group: int  # hi indices combined per mixed-radix integer (HI_RANK)
    group_bytes: int  # bytes per group (HI_RANK) or per row (HI_UNARY)

    def hi_universe(self, num_experts: int) -> int:
        return -(-num_experts // (1 << self.b))

    def table_size(self, num_experts: int, k: int) -> int:
        h = self.hi_universe(num_experts)
        return math.comb(h, k) if self.b == 0 else math.comb(h + k - 1, k)

    def bits_per_row(self, k: int) -> float:
        if self.hi_kind == HI_RANK:
            return 8.0 * self.group_bytes / self.rows_per_group + k * self.b
        return 8.0 * self.group_bytes + k * self.b


_FAST_B = (0, 1, 2, 4, 8)


@functools.lru_cache(maxsize=256)
def _choose_layout(num_experts: int, k: int) -> _SetLayout:
    """Smallest fixed-width set code for (E, K), preferring fast lo widths.

    Fixed width per row (no entropy coder) keeps decoding vectorisable; the
    size lands within a few percent of log2 C(E, K). Lo widths that divide a
    byte decode with byte-wide numpy ops, so they win unless another width
    saves more than 2% of the size.
    """
    max_b = max(0, (num_experts - 1).bit_length())
    options: list[_SetLayout] = []
    for b in range(0, min(max_b, 8) + 1):
        h = -(-num_experts // (1 << b))
        if b == 0 and k > h:
            continue
        p = math.comb(h, k) if b == 0 else math.comb(h + k - 1, k)
        if 1 < p <= _MAX_TABLE:
            for r in range(1, 9):
                bits = math.ceil(r * math.log2(p))
                if p ** r >= (1 << 64) or bits > 64:
                    break
                options.append(_SetLayout(HI_RANK, b, r, -(-bits // 8)))
        elif p == 1:
            options.append(_SetLayout(HI_RANK, b, 1, 0))  # hi carries nothing
        if b > 0:
            options.append(_SetLayout(HI_UNARY, b, 1, -(-(k + h) // 8)))
    best = min(o.bits_per_row(k) for o in options)
    fast = [o for o in options if o.b in _FAST_B and o.bits_per_row(k) <= 1.01 * best]
    pool = fast or [o for o in options if o.bits_per_row(k) == best]
    return min(pool, key=lambda o: (o.bits_per_row(k), o.table_size(num_experts, k) if o.hi_kind == HI_RANK else 0))


# --------------------------------------------------------------------------
# bit packing of b-bit values (b <= 8)


def _pack_lo(vals: np.ndarray, b: int) -> bytes:
    """Pack uint8 values < 2^b, little-endian bit order, 8 values per b bytes."""
    if b == 0 or vals.size == 0:
        return b""
    v = vals.reshape(-1)
    if b == 8:
        return v.tobytes()
    n = v.size
    pad = (-n) % 8
    if pad:
        v = np.concatenate([v, np.zeros(pad, dtype=np.uint8)])
    if 8 % b == 0:
        per = 8 // b
        g = v.reshape(-1, per).astype(np.uint8)
        acc = g[:, 0].copy()
        for j in range(1, per):
            acc |= g[:, j] << np.uint8(j * b)
        data = acc
    else:
        g = v.reshape(-1, 8).astype(np.uint64)
        acc = np.zeros(g.shape[0], dtype=np.uint64)
        for j in range(8):
            acc |= g[:, j] << np.uint64(j * b)
        data = acc.view(np.uint8).reshape(-1, 8)[:, :b]
    return np.ascontiguousarray(data).tobytes()[: (n * b + 7) // 8]


def _unpack_lo(buf: memoryview, n: int, b: int) -> np.ndarray:
    """Inverse of _pack_lo: n values of b bits as uint8."""
    need = (n * b + 7) // 8
    if len(buf) != need:
        raise ValueError(f"lo section has {len(buf)} bytes, expected {need}")
    if b == 0:
        return np.zeros(n, dtype=np.uint8)
    raw = np.frombuffer(buf, dtype=np.uint8)
    if b == 8:
        return raw
    if 8 % b == 0:
        per = 8 // b
        mask = np.uint8((1 << b) - 1)
        out = np.empty((raw.size, per), dtype=np.uint8)
        for j in range(per):
            np.bitwise_and(raw >> np.uint8(j * b), mask, out=out[:, j])
        return out.reshape(-1)[:n]
    groups = -(-n // 8)
    padded = np.zeros(groups * b + 8, dtype=np.uint8)
    padded[: raw.size] = raw
    words = np.lib.stride_tricks.as_strided(padded, shape=(groups, 8), strides=(b, 1))
    w64 = np.ascontiguousarray(words).view("<u8").reshape(-1)
    mask = np.uint64((1 << b) - 1)
    out = np.empty((groups, 8), dtype=np.uint8)
    for j in range(8):
        out[:, j] = (w64 >> np.uint64(j * b)) & mask
    return out.reshape(-1)[:n]


def _read_uint_le(buf: memoryview, count: int, width: int) -> np.ndarray:
    """``count`` little-endian unsigned integers of ``width`` bytes -> uint64."""
    if len(buf) != count * width:
        raise ValueError(f"section has {len(buf)} bytes, expected {count * width}")
    if width in (1, 2, 4, 8):
        return np.frombuffer(buf, dtype=f"<u{width}").astype(np.uint64, copy=False)
    raw = np.frombuffer(buf, dtype=np.uint8)
    out = np.zeros((count, 8), dtype=np.uint8)
    out[:, :width] = raw.reshape(count, width)
    return out.view("<u8").reshape(-1)


def _write_uint_le(vals: np.ndarray, width: int) -> bytes:
    v = np.ascontiguousarray(vals, dtype="<u8")
    if width == 8:
        return v.tobytes()
    return np.ascontiguousarray(v.view(np.uint8).reshape(-1, 8)[:, :width]).tobytes()


# --------------------------------------------------------------------------
# set code (rows -> bytes)


def _encode_rows(rows: np.ndarray, num_experts: int) -> tuple[_SetLayout, bytes, bytes]:
    """Encode sorted rows [N, K] with the set code; returns (layout, hi, lo)."""
    n, k = rows.shape
    lay = _choose_layout(num_experts, k)
    b = lay.b
    r16 = rows.astype(np.uint16, copy=False)
    hi = (r16 >> b) if b else r16
    lo = (r16 & ((1 << b) - 1)).astype(np.uint8) if b else None
    h = lay.hi_universe(num_experts)
    if lay.hi_kind == HI_RANK:
        p = lay.table_size(num_experts, k)
        idx = _colex_index(hi, multiset=b > 0, n=h + (k - 1 if b > 0 else 0)) if p > 1 else np.zeros(n, np.uint64)
        r = lay.rows_per_group
        groups = -(-n // r)
        padded = np.zeros(groups * r, dtype=np.uint64)
        padded[:n] = idx
        g = padded.reshape(groups, r)
        combined = np.zeros(groups, dtype=np.uint64)
        for j in range(r - 1, -1, -1):
            combined = combined * np.uint64(p) + g[:, j]
        hi_bytes = _write_uint_le(combined, lay.group_bytes) if p > 1 else b""
    else:
        width = lay.group_bytes * 8
        pos = hi.astype(np.int64) + np.arange(k, dtype=np.int64)  # unary: j-th one at hi_j + j
        bits = np.zeros((n, width), dtype=np.uint8)
        np.put_along_axis(bits, pos, 1, axis=1)
        hi_bytes = np.packbits(bits, axis=1, bitorder="little").tobytes()
    lo_bytes = _pack_lo(lo, b) if b else b""
    return lay, hi_bytes, lo_bytes


def _decode_rows(lay: _SetLayout, hi_buf: memoryview, lo_buf: memoryview, n: int, k: int,
                 num_experts: int) -> np.ndarray:
    """Inverse of _encode_rows; validates every row (range, strictly increasing)."""
    dt = id_dtype(num_experts)
    b = lay.b
    h = lay.hi_universe(num_experts)
    if lay.hi_kind == HI_RANK:
        p = lay.table_size(num_experts, k)
        table = _hi_table(h, k, b > 0, dt.str, b)
        if p > 1:
            r = lay.rows_per_group
            groups = -(-n // r)
            combined = _read_uint_le(hi_buf, groups, lay.group_bytes)
            if r == 1:
                idx = combined
            else:
                idx = np.empty((groups, r), dtype=np.uint64)
                pp = np.uint64(p)
                for j in range(r - 1):
                    q = combined // pp
                    idx[:, j] = combined - q * pp
                    combined = q
                idx[:, r - 1] = combined
                idx = idx.reshape(-1)
            if idx.size and int(idx.max()) >= p:
                raise ValueError("hi index out of range: payload is corrupt")
            ids = table.take(idx[:n].astype(np.intp), axis=0)
        else:
            if len(hi_buf):
                raise ValueError("unexpected hi section")
            ids = np.broadcast_to(table[0], (n, k)).copy()
    else:
        width = lay.group_bytes
        if len(hi_buf) != n * width:
            raise ValueError(f"hi section has {len(hi_buf)} bytes, expected {n * width}")
        raw = np.frombuffer(hi_buf, dtype=np.uint8).reshape(n, width)
        bits = np.unpackbits(raw, axis=1, bitorder="little")
        rr, cc = np.nonzero(bits)
        if rr.size != n * k or (n and not np.array_equal(rr.reshape(n, k)[:, 0], np.arange(n))) \
                or (n and not (rr.reshape(n, k) == rr.reshape(n, k)[:, :1]).all()):
            raise ValueError("unary hi section does not have top_k ones per row: payload is corrupt")
        hi = cc.reshape(n, k) - np.arange(k)
        ids = (hi << b).astype(dt)
    if b:
        lo = _unpack_lo(lo_buf, n * k, b).reshape(n, k)
        if dt.itemsize == 1:
            ids |= lo
        else:
            ids |= lo.astype(dt)
    elif len(lo_buf):
        raise ValueError("unexpected lo section")
    _check_rows(ids, num_experts)
    return ids


def _strictly_increasing_rows(rows: np.ndarray) -> bool:
    """True when every row of [N, K] is strictly increasing (vectorised flat)."""
    n, k = rows.shape
    if k < 2 or n == 0:
        return True
    flat = rows.reshape(-1)
    inc = flat[1:] > flat[:-1]
    # positions where a row ends are not compared with the next row's start
    boundary = np.zeros(flat.size - 1, dtype=bool)
    boundary[k - 1 :: k] = True
    return bool(np.logical_or(inc, boundary, out=inc).all())


def _check_rows(ids: np.ndarray, num_experts: int) -> None:
    if ids.size and int(ids.max()) >= num_experts:
        raise ValueError(f"decoded expert id {int(ids.max())} >= num_experts {num_experts}: payload is corrupt")
    if not _strictly_increasing_rows(ids):
        raise ValueError("decoded row is not a set of distinct sorted ids: payload is corrupt")


# --------------------------------------------------------------------------
# record codec


def _header(rec_rows: int, start: int, layers: tuple[int, ...], k: int, e: int, scheme: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, scheme, 0, rec_rows, start, len(layers), k, e) + struct.pack(
        f"<{len(layers)}H", *layers
    )


def encode_record(rec: RoutingRecord) -> bytes:
    """Encode a record into the compact binary payload (smallest scheme wins)."""
    t, l, k = rec.expert_ids.shape
    e = rec.num_experts
    if t > 0xFFFFFFFF or rec.start > 0xFFFFFFFF:
        raise ValueError("record too long for the format (>= 2^32 rows)")
    rows = rec.expert_ids.reshape(t * l, k)
    candidates: list[tuple[int, bytes]] = []

    lay, hi_b, lo_b = _encode_rows(rows, e)
    body = _SET_PARAMS.pack(lay.hi_kind, lay.b, lay.rows_per_group, lay.group_bytes, len(hi_b), len(lo_b)) + hi_b + lo_b
    candidates.append((SCHEME_SET, body))

    dict_body = _encode_dict(rec.expert_ids, e)
    if dict_body is not None:
        candidates.append((SCHEME_DICT, dict_body))

    raw = rows.tobytes()
    candidates.append((SCHEME_RAW, raw))
    scheme, body = min(candidates, key=lambda c: len(c[1]))
    head = _header(t, rec.start, rec.moe_layers, k, e, scheme)
    payload = head + body
    return payload + _CRC.pack(zlib.crc32(payload))


def _encode_dict(ids: np.ndarray, e: int) -> bytes | None:
    """Per-layer dictionary: worthwhile only when rows repeat a lot."""
    t, l, k = ids.shape
    if t < 16:
        return None
    # key each row by its bytes; unique per layer (layer index in the key)
    itemsize = ids.dtype.itemsize
    rowbytes = k * itemsize
    keyed = np.empty((l, t, rowbytes + 2), dtype=np.uint8)
    keyed[:, :, :2] = np.arange(l, dtype="<u2").view(np.uint8).reshape(l, 1, 2)
    keyed[:, :, 2:] = np.ascontiguousarray(ids.transpose(1, 0, 2)).view(np.uint8).reshape(l, t, rowbytes)
    void = keyed.reshape(l * t, -1).view(np.dtype((np.void, rowbytes + 2))).reshape(-1)
    uniq, inverse = np.unique(void, return_inverse=True)
    d_total = uniq.size
    # layer of each dictionary entry; uniques are sorted by layer first (layer
    # bytes are little-endian, so sort by the low byte first: compare on lstart)
    u = uniq.view(np.uint8).reshape(d_total, rowbytes + 2)
    u_layer = u[:, :2].copy().view("<u2").reshape(-1).astype(np.int64)
    order = np.argsort(u_layer, kind="stable")
    u = u[order]
    u_layer = u_layer[order]
    remap = np.empty(d_total, dtype=np.int64)
    remap[order] = np.arange(d_total)
    counts = np.bincount(u_layer, minlength=l)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    inv = remap[inverse.reshape(l, t)] - offsets[:, None]  # local index per layer
    max_d = int(counts.max())
    width = 1 if max_d <= 1 << 8 else 2 if max_d <= 1 << 16 else 3 if max_d <= 1 << 24 else 4
    est = t * l * width
    full_bits = _choose_layout(e, k).bits_per_row(k)
    if est + d_total * full_bits / 8 >= t * l * full_bits / 8 * 0.95:
        return None
    dict_rows = np.ascontiguousarray(u[:, 2:]).view(ids.dtype).reshape(d_total, k)
    lay, hi_b, lo_b = _encode_rows(dict_rows, e)
    dict_payload = (struct.pack(f"<{l}I", *counts.tolist())
                    + _SET_PARAMS.pack(lay.hi_kind, lay.b, lay.rows_per_group, lay.group_bytes, len(hi_b), len(lo_b))
                    + hi_b + lo_b)
    index = _write_uint_le(inv.T.reshape(-1).astype(np.uint64), width)  # token-major
    return _DICT_PARAMS.pack(width, len(dict_payload)) + dict_payload + index


class _Reader:
    """Bounds-checked cursor over a payload (truncation -> ValueError)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"routing payload truncated: {what} needs {n} bytes at offset {self.pos}, "
                             f"only {len(self.buf) - self.pos} left")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct, what: str) -> tuple:
        return st.unpack(self.take(st.size, what))


def _read_set_body(rd: _Reader, n: int, k: int, e: int) -> np.ndarray:
    hi_kind, b, rpg, gbytes, hi_len, lo_len = rd.unpack(_SET_PARAMS, "set-code parameters")
    expected = _choose_layout(e, k)
    lay = _SetLayout(hi_kind, b, rpg, gbytes)
    if lay != expected:
        raise ValueError(f"set-code parameters {lay} do not match the layout for E={e}, K={k} ({expected})")
    hi = rd.take(hi_len, "hi section")
    lo = rd.take(lo_len, "lo section")
    return _decode_rows(lay, hi, lo, n, k, e)


def decode_record(payload: bytes | bytearray | memoryview) -> RoutingRecord:
    """Decode a payload from :func:`encode_record`; ValueError if malformed."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ValueError(f"routing payload must be bytes, got {type(payload).__name__}")
    buf = memoryview(payload).cast("B")
    if len(buf) < _HEADER.size + _CRC.size:
        raise ValueError(f"routing payload truncated: {len(buf)} bytes is shorter than a header")
    if bytes(buf[:4]) != MAGIC:
        raise ValueError(f"not a routing payload (magic {bytes(buf[:4])!r}, expected {MAGIC!r})")
    (crc,) = _CRC.unpack(buf[-4:])
    if zlib.crc32(buf[:-4]) != crc:
        raise ValueError("routing payload checksum mismatch (truncated or corrupted)")
    rd = _Reader(buf[:-4])
    magic, version, scheme, _res, t, start, l, k, e = rd.unpack(_HEADER, "header")
    if version != VERSION:
        raise ValueError(f"unsupported routing payload version {version} (this decoder reads {VERSION})")
    if not (0 < e <= _MAX_EXPERTS) or not (1 <= k <= e):
        raise ValueError(f"invalid shape in header: num_experts={e}, top_k={k}")
    layers = struct.unpack(f"<{l}H", rd.take(2 * l, "layer list"))
    n = t * l
    dt = id_dtype(e)
    if scheme == SCHEME_RAW:
        raw = rd.take(n * k * dt.itemsize, "raw ids")
        ids = np.frombuffer(raw, dtype=dt).reshape(n, k).copy()
        _check_rows(ids, e)
    elif scheme == SCHEME_SET:
        ids = _read_set_body(rd, n, k, e)
    elif scheme == SCHEME_DICT:
        width, dlen = rd.unpack(_DICT_PARAMS, "dictionary parameters")
        if width not in (1, 2, 3, 4):
            raise ValueError(f"invalid dictionary index width {width}")
        drd = _Reader(rd.take(dlen, "dictionary"))
        counts = np.array(struct.unpack(f"<{l}I", drd.take(4 * l, "dictionary sizes")), dtype=np.int64)
        d_total = int(counts.sum())
        drows = _read_set_body(drd, d_total, k, e)
        if drd.pos != len(drd.buf):
            raise ValueError("trailing bytes in dictionary")
        index = _read_uint_le(rd.take(n * width, "dictionary index"), n, width).reshape(t, l)
        if t and (index >= counts.astype(np.uint64)[None, :]).any():
            raise ValueError("dictionary index out of range: payload is corrupt")
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.uint64)
        gidx = (index + offsets[None, :]).reshape(-1).astype(np.intp)
        if dt.itemsize * k in (1, 2, 4, 8):
            view = np.dtype(f"<u{dt.itemsize * k}")
            ids = drows.view(view).reshape(-1).take(gidx).view(dt).reshape(n, k)
        else:
            ids = drows.take(gidx, axis=0)
    else:
        raise ValueError(f"unknown routing payload scheme {scheme}")
    if rd.pos != len(rd.buf):
        raise ValueError(f"routing payload has {len(rd.buf) - rd.pos} trailing bytes")
    return RoutingRecord(ids.reshape(t, l, k), tuple(layers), e, start, _canonical=True)


def encode_record_b64(rec: RoutingRecord) -> str:
    """The payload as base64 text, the form carried in JSON responses."""
    return base64.b64encode(encode_record(rec)).decode("ascii")


def decode_record_b64(text: str | bytes) -> RoutingRecord:
    """Decode base64 text from :func:`encode_record_b64`; ValueError if malformed."""
    if isinstance(text, str):
        try:
            text = text.encode("ascii")
        except UnicodeEncodeError as exc:
            raise ValueError("routing payload text is not base64 (non-ASCII characters)") from exc
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"routing payload is not valid base64: {exc}") from exc
    return decode_record(raw)
