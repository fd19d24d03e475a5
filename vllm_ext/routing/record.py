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

A record of a DSA model (GLM-5) may also carry the indexer's selected keys
(``index_keys``, coded in ``index_keys.py``): a section after the ids, flagged
in the header.

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
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .index_keys import IndexKeys

__all__ = [
    "IndexKeys",
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

FLAG_INDEX_KEYS = 1  # header flags: an indexer-key section follows the ids

# Header: magic, version, scheme, flags, rows, start, layers, top_k, experts.
_HEADER = struct.Struct("<4sBBHIIHHI")
_SET_PARAMS = struct.Struct("<BBBBQQ")  # hi_kind, b, rows_per_group, group_bytes, hi_len, lo_len
_DICT_PARAMS = struct.Struct("<BQ")  # index_bytes, dictionary body length
_CRC = struct.Struct("<I")

# A hi table holds at most this many ids (entries x K): keeps decode tables
# cache-friendly (<= 8 MB) and the table build fast.
_MAX_TABLE_IDS = 1 << 22
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
    index_keys: IndexKeys | None = None
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
        if self.index_keys is not None:
            if self.index_keys.keys.shape[0] != ids.shape[0]:
                raise ValueError(f"the record has {ids.shape[0]} rows of experts but {self.index_keys.keys.shape[0]} "
                                 "rows of indexer keys")
            if not self._canonical:
                object.__setattr__(self, "index_keys", self.index_keys.check(self.start))

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
            and self.index_keys == other.index_keys
        )

    def slice_from(self, position: int) -> "RoutingRecord":
        """The rows for positions >= ``position`` (for multi-turn requests)."""
        if position < self.start:
            raise ValueError(f"position {position} is before the record's start {self.start}")
        cut = min(position - self.start, self.num_rows)
        keys = None if self.index_keys is None else self.index_keys.slice_from(cut)
        return RoutingRecord(self.expert_ids[cut:], self.moe_layers, self.num_experts,
                             self.start + cut, keys, _canonical=True)

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
    """C(i, j) for i <= n, j <= k as uint64, saturating at 2^64-1.

    Colex terms of valid sets never exceed C(n, k) (which callers keep below
    2^64), so saturated entries are never summed; they only need to stay
    monotone for the unranking search."""
    t = np.zeros((n + 1, k + 1), dtype=np.uint64)
    cap = (1 << 64) - 1
    for i in range(n + 1):
        for j in range(min(i, k) + 1):
            t[i, j] = min(math.comb(i, j), cap)
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
# A joint table (all P^r combinations of r rows) is used at decode when it has
# at most this many entries: one gather then decodes r rows.
_JOINT_MAX = 1 << 16


def _speed_class(lay: _SetLayout, p: int) -> int:
    """0: one gather per group of rows; 1: byte-padding or division first;
    2: generic bit widths or unary high parts (more numpy passes)."""
    if lay.hi_kind == HI_UNARY or lay.b not in _FAST_B:
        return 2
    if lay.group_bytes in (0, 1, 2, 4, 8) and (lay.rows_per_group == 1 or p ** lay.rows_per_group <= _JOINT_MAX):
        return 0
    return 1


@functools.lru_cache(maxsize=256)
def _choose_layout(num_experts: int, k: int) -> _SetLayout:
    """Fixed-width set code for (E, K) trading a few percent of size for speed.

    Fixed width per row (no entropy coder) keeps decoding vectorisable; sizes
    land within a few percent of log2 C(E, K). Each step of the speed class
    (see _speed_class) must buy its cost with 8% of size, so e.g. (8, 2) uses
    3 rows per 16-bit joint index (5.33 bits/row, one gather) rather than
    8 rows per 40 bits (5.0 bits/row, seven divisions).
    """
    max_b = max(0, (num_experts - 1).bit_length())
    options: list[tuple[float, _SetLayout]] = []
    for b in range(0, min(max_b, 8) + 1):
        h = -(-num_experts // (1 << b))
        if b == 0 and k > h:
            continue
        p = math.comb(h, k) if b == 0 else math.comb(h + k - 1, k)
        cands = []
        if 1 < p and p * k <= _MAX_TABLE_IDS:
            for r in range(1, 9):
                bits = math.ceil(r * math.log2(p))
                if p ** r >= (1 << 64) or bits > 64:
                    break
                cands.append(_SetLayout(HI_RANK, b, r, -(-bits // 8)))
                if bits <= 32:  # byte-aligned widths decode without padding
                    for w in (2, 4):
                        if w * 8 >= bits and w != -(-bits // 8):
                            cands.append(_SetLayout(HI_RANK, b, r, w))
        elif p == 1:
            cands.append(_SetLayout(HI_RANK, b, 1, 0))  # hi carries nothing
        if b > 0:
            cands.append(_SetLayout(HI_UNARY, b, 1, -(-(k + h) // 8)))
        for c in cands:
            options.append((c.bits_per_row(k) * (1 + 0.08 * _speed_class(c, p)), c))
    target = max(0.4 * 8 * baseline_bytes_per_token(num_experts, k, 1), 1.1 * floor_bits_per_row(num_experts, k))
    # Table-based layouts decode several times faster than unary high parts:
    # use them whenever one meets the compression target.
    eligible = [o for o in options if o[1].hi_kind == HI_RANK and o[1].bits_per_row(k) <= target]
    if not eligible:
        best = min(o[1].bits_per_row(k) for o in options)
        eligible = [o for o in options if o[1].bits_per_row(k) <= 1.08 * best]
    return min(eligible, key=lambda o: (o[0], o[1].bits_per_row(k)))[1]


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
    # Spread each byte's fields into whole bytes with wide-integer shifts and
    # one mask (contiguous SIMD passes instead of per-field strided writes).
    if b == 1:
        return np.unpackbits(raw, bitorder="little")[:n]
    if b == 2:
        x = raw.astype(np.uint32)
        y = x | (x << np.uint32(6))
        y |= y << np.uint32(12)
        y &= np.uint32(0x03030303)
        return y.view(np.uint8)[:n]
    if b == 4:
        x = raw.astype(np.uint16)
        x |= x << np.uint16(4)
        x &= np.uint16(0x0F0F)
        return x.view(np.uint8)[:n]
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
    if count == 0:
        return np.zeros(0, dtype=np.uint64)
    # unaligned 8-byte loads at a stride of `width` bytes, then mask
    padded = np.zeros(count * width + 8, dtype=np.uint8)
    padded[: count * width] = np.frombuffer(buf, dtype=np.uint8)
    words = np.ndarray((count,), dtype="<u8", buffer=padded, offset=0, strides=(width,))
    return words & np.uint64((1 << (8 * width)) - 1)


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


@functools.lru_cache(maxsize=32)
def _joint_table(h: int, k: int, multiset: bool, dtype_str: str, shift: int, r: int) -> np.ndarray:
    """All P^r combinations of r table rows, so one gather decodes r rows.

    Entry ``i0 + P*i1 + P^2*i2 ...`` is ``table[i0] ++ table[i1] ++ ...``,
    matching how the encoder combines r rows' indices.
    """
    base = _hi_table(h, k, multiset, dtype_str, shift)
    p = base.shape[0]
    codes = np.arange(p ** r, dtype=np.int64)
    parts = []
    for _ in range(r):
        parts.append(base[codes % p])
        codes //= p
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def _take_rows(table: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """table[idx] for 2-D tables, gathering whole rows as integers: one gather when
    a row is 1, 2, 4 or 8 bytes, else one gather per power-of-two slice of the row
    (e.g. 4 + 2 bytes for six uint8 ids) into a packed record; both several times
    faster than numpy's row gather (measured: 6-byte rows 86 -> 71 us per 32k)."""
    rowbytes = table.shape[1] * table.itemsize
    try:
        if rowbytes in (1, 2, 4, 8):
            flat = table.view(f"<u{rowbytes}").reshape(-1)
            return flat.take(idx).view(table.dtype).reshape(-1, table.shape[1])
        if rowbytes > 16:
            return table.take(idx, axis=0)
        dtype, columns = _table_columns(table)
        out = np.empty(len(idx), dtype)
        for name, col in columns:
            out[name] = col.take(idx)
        return out.view(table.dtype).reshape(-1, table.shape[1])
    except IndexError as exc:
        raise ValueError(f"hi index out of range (table has {table.shape[0]} entries): payload is corrupt") from exc


# Keyed by the table's id, holding the table itself (so the id stays its own); bounded like
# the two table caches together (_hi_table, _joint_table), so evicted tables are let go.
_COLUMNS: OrderedDict[int, tuple[np.ndarray, np.dtype, list[tuple[str, np.ndarray]]]] = OrderedDict()
_MAX_COLUMNS = 64


def _table_columns(table: np.ndarray) -> tuple[np.dtype, list[tuple[str, np.ndarray]]]:
    """A table's rows as a packed record of power-of-two integer fields, and each
    field as a contiguous column (built once per cached table)."""
    hit = _COLUMNS.get(id(table))
    if hit is not None and hit[0] is table:
        _COLUMNS.move_to_end(id(table))
    else:
        rowbytes = table.shape[1] * table.itemsize
        fields, off = [], 0
        for w in (8, 4, 2, 1):
            while rowbytes - off >= w:
                fields.append((f"f{off}", f"<u{w}", off))
                off += w
        dtype = np.dtype({"names": [f[0] for f in fields], "formats": [f[1] for f in fields],
                          "offsets": [f[2] for f in fields], "itemsize": rowbytes})
        rec = np.ascontiguousarray(table).view(dtype).reshape(-1)
        hit = _COLUMNS[id(table)] = (table, dtype, [(name, np.ascontiguousarray(rec[name])) for name, _, _ in fields])
        if len(_COLUMNS) > _MAX_COLUMNS:
            _COLUMNS.popitem(last=False)
    return hit[1], hit[2]


def _decode_rows(lay: _SetLayout, hi_buf: memoryview, lo_buf: memoryview, n: int, k: int,
                 num_experts: int) -> np.ndarray:
    """Inverse of _encode_rows; validates every row (range, strictly increasing).

    Validation is skipped only where the structure makes a bad row impossible:
    with b == 0 every table row is a valid set of ids < E.
    """
    dt = id_dtype(num_experts)
    b = lay.b
    h = lay.hi_universe(num_experts)
    if lay.hi_kind == HI_RANK:
        p = lay.table_size(num_experts, k)
        if p > 1:
            r = lay.rows_per_group
            groups = -(-n // r)
            gb = lay.group_bytes
            if gb in (1, 2, 4, 8):
                if len(hi_buf) != groups * gb:
                    raise ValueError(f"hi section has {len(hi_buf)} bytes, expected {groups * gb}")
                combined = np.frombuffer(hi_buf, dtype=f"<u{gb}")
            else:
                combined = _read_uint_le(hi_buf, groups, gb)
            if r == 1:
                ids = _take_rows(_hi_table(h, k, b > 0, dt.str, b), combined)
            elif p ** r <= _JOINT_MAX:
                ids = _take_rows(_joint_table(h, k, b > 0, dt.str, b, r), combined).reshape(groups * r, k)[:n]
            else:
                combined = combined.astype(np.uint64, copy=False)
                table = _hi_table(h, k, b > 0, dt.str, b)
                out = np.empty((groups, r, k), dtype=dt)
                rowbytes = k * dt.itemsize
                # write whole rows as one integer when possible (strided
                # byte-row copies are several times slower)
                dst = out.view(f"<u{rowbytes}").reshape(groups, r) if rowbytes in (1, 2, 4, 8) else out
                cast = (lambda a: a.view(f"<u{rowbytes}").reshape(-1)) if dst is not out else (lambda a: a)
                pp = np.uint64(p)
                for j in range(r - 1):
                    q = combined // pp
                    dst[:, j] = cast(_take_rows(table, combined - q * pp))
                    combined = q
                dst[:, r - 1] = cast(_take_rows(table, combined))
                ids = out.reshape(groups * r, k)[:n]
        else:
            if len(hi_buf):
                raise ValueError("unexpected hi section")
            ids = np.broadcast_to(_hi_table(h, k, b > 0, dt.str, b)[0], (n, k)).copy()
    else:
        width = lay.group_bytes
        if len(hi_buf) != n * width:
            raise ValueError(f"hi section has {len(hi_buf)} bytes, expected {n * width}")
        bits = np.unpackbits(np.frombuffer(hi_buf, dtype=np.uint8), bitorder="little").view(bool)
        pos = np.flatnonzero(bits)
        if pos.size != n * k:
            raise ValueError("unary hi section does not have top_k ones per row: payload is corrupt")
        pos = pos.reshape(n, k)
        row_start = np.arange(n, dtype=np.int64)[:, None] * (width * 8)
        if n and not ((pos[:, 0] >= row_start[:, 0]).all() and (pos[:, -1] < row_start[:, 0] + width * 8).all()):
            raise ValueError("unary hi section does not have top_k ones per row: payload is corrupt")
        hi = pos - row_start - np.arange(k)
        ids = (hi << b).astype(dt)
    if b:
        lo = _unpack_lo(lo_buf, n * k, b).reshape(n, k)
        if dt.itemsize == 1:
            ids |= lo
        else:
            ids |= lo.astype(dt)
        if num_experts % (1 << b) and ids.size and int(ids.max()) >= num_experts:
            raise ValueError(f"decoded expert id {int(ids.max())} >= num_experts {num_experts}: payload is corrupt")
        if not _strictly_increasing_rows(ids):
            raise ValueError("decoded row is not a set of distinct sorted ids: payload is corrupt")
    elif len(lo_buf):
        raise ValueError("unexpected lo section")
    return ids


def _strictly_increasing_rows(rows: np.ndarray) -> bool:
    """True when every row of [N, K] is strictly increasing.

    Flat trick (contiguous, SIMD-friendly): every within-row pair must be
    increasing, so the count of increasing adjacent pairs over the flat array
    must equal N*(K-1) plus the count of increasing pairs across row ends.
    """
    n, k = rows.shape
    if k < 2 or n == 0:
        return True
    flat = np.ascontiguousarray(rows).reshape(-1)
    total = np.count_nonzero(flat[1:] > flat[:-1])
    across = np.count_nonzero(flat[k::k] > flat[k - 1 : -1 : k]) if n > 1 else 0
    return total == n * (k - 1) + across


def _check_rows(ids: np.ndarray, num_experts: int) -> None:
    if ids.size and int(ids.max()) >= num_experts:
        raise ValueError(f"decoded expert id {int(ids.max())} >= num_experts {num_experts}: payload is corrupt")
    if not _strictly_increasing_rows(ids):
        raise ValueError("decoded row is not a set of distinct sorted ids: payload is corrupt")


# --------------------------------------------------------------------------
# record codec


def _header(rec_rows: int, start: int, layers: tuple[int, ...], k: int, e: int, scheme: int, flags: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, scheme, flags, rec_rows, start, len(layers), k, e) + struct.pack(
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
    flags, index = (0, b"") if rec.index_keys is None else (FLAG_INDEX_KEYS, rec.index_keys.encode(rec.start))
    payload = _header(t, rec.start, rec.moe_layers, k, e, scheme, flags) + body + index
    return payload + _CRC.pack(zlib.crc32(payload))


def _distinct_rows(rows: np.ndarray) -> int:
    """Number of distinct rows of [N, K]: exact when a row fits in 8 bytes, else
    of a 64-bit hash of each row (a collision only under-counts, and the caller
    uses this as a pre-check before an exact dictionary). A sort of uint64 keys
    is ~5x faster than np.unique over void rows."""
    b = np.ascontiguousarray(rows).view(np.uint8).reshape(rows.shape[0], -1)
    width = -(-b.shape[1] // 8) * 8
    if width != b.shape[1]:
        b = np.concatenate([b, np.zeros((b.shape[0], width - b.shape[1]), np.uint8)], axis=1)
    words = b.view("<u8")
    keys = words[:, 0].copy()
    for j in range(1, words.shape[1]):
        keys *= np.uint64(0x9E3779B97F4A7C15)
        keys ^= words[:, j]
    keys.sort()
    return 1 + int(np.count_nonzero(keys[1:] != keys[:-1])) if keys.size else 0


def _encode_dict(ids: np.ndarray, e: int) -> bytes | None:
    """Per-layer dictionary: worthwhile only when rows repeat a lot."""
    t, l, k = ids.shape
    if t < 16:
        return None
    # cheap pre-check on a sample of rows: a dictionary only pays when rows
    # repeat, and the full unique() below is the slowest step of encoding
    sample = ids[: min(t, 1024)].reshape(-1, k)
    distinct = _distinct_rows(sample)
    if distinct > 0.5 * sample.shape[0] or 8 * max(1, math.ceil(math.log2(max(distinct, 2)) / 8)) >= \
            _choose_layout(e, k).bits_per_row(k):
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
    magic, version, scheme, flags, t, start, l, k, e = rd.unpack(_HEADER, "header")
    if version != VERSION:
        raise ValueError(f"unsupported routing payload version {version} (this decoder reads {VERSION})")
    if flags & ~FLAG_INDEX_KEYS:
        raise ValueError(f"unknown routing payload flags {flags:#x}")
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
    keys = IndexKeys.decode(rd.take, t, start) if flags & FLAG_INDEX_KEYS else None
    if rd.pos != len(rd.buf):
        raise ValueError(f"routing payload has {len(rd.buf) - rd.pos} trailing bytes")
    return RoutingRecord(ids.reshape(t, l, k), tuple(layers), e, start, keys, _canonical=True)


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
