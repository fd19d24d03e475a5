"""The DSA indexer's selected keys: an optional section of the routing record (numpy only).

GLM-5's attention reads, for each query token and layer, only the `topk` earlier keys its
lightning indexer ranks highest. When the trainer's indexer picks other keys than the sampler's,
the attention itself differs and router replay cannot repair it; replaying the keys can
(`train.replay_indexer`). `vllm_ext.routing.record` carries them beside the expert ids, coded here.

A query at position `p` selects `min(topk, p + 1)` of the keys `0..p`, so a row is a sorted set:
rows with `p < topk` select every earlier key, carry nothing and are not stored; any other is
`K = topk` positions in `[0, p]`, coded Elias-Fano: `b = floor(log2((p + 1) / K))` low bits per
key and the high parts (`key >> b`) in unary, `K + (p >> b) + 1` bits, about `K * (b + 2)` bits in
all, a few percent above `log2 C(p + 1, K)` (`bytes_per_row`). At 131,072 positions and top-2048
that is 2,048 bytes per token and layer, against 2 * 2,048 for 16-bit positions.

Rows go in chunks of `chunk_rows` positions (so the bit scratch stays bounded): a chunk's unary
bits of every (row, layer), padded to a byte, then its low bits, padded to a byte. Every length
follows from the positions, so the section stores none; decoding checks that each unary field
holds exactly `K` ones and every key lies at or before its query.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

__all__ = ["IndexKeys", "bytes_per_row", "mean_bytes_per_token_layer"]

_PARAMS = struct.Struct("<HIIQ")  # layers, top_k, rows per chunk, body length
_CHUNK_BITS = 1 << 24  # unary + low bits of one chunk at most (about 2 MB packed, 16 MB unpacked)


def _low_bits(positions: np.ndarray, topk: int) -> np.ndarray:
    """`b` of each row (`positions >= topk`): floor(log2((p + 1) / topk))."""
    q = (positions.astype(np.int64) + 1) // topk
    return np.frexp(q.astype(np.float64))[1].astype(np.int64) - 1


def _row_bits(positions: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(low bits `b`, unary bits, low-part bits) per row of one layer, for rows `positions >= topk`."""
    b = _low_bits(positions, topk)
    return b, topk + (positions.astype(np.int64) >> b) + 1, topk * b


def bytes_per_row(position: int, topk: int) -> float:
    """Bytes one (token, layer) row at `position` takes in the section (0 below `topk`)."""
    if position < topk:
        return 0.0
    _, hi, lo = _row_bits(np.array([position]), topk)
    return float(hi[0] + lo[0]) / 8


def mean_bytes_per_token_layer(seq_len: int, topk: int) -> float:
    """Mean bytes per (token, layer) over the positions of one sequence of `seq_len` tokens."""
    p = np.arange(topk, seq_len)
    if p.size == 0:
        return 0.0
    _, hi, lo = _row_bits(p, topk)
    return float((hi + lo).sum()) / 8 / seq_len


@dataclass(frozen=True)
class IndexKeys:
    """The indexer's selection of every fed token and DSA layer of one sequence.

    `keys[i, j]` are the positions (sorted, then -1 in the unused slots) that decoder layer
    `layers[j]`'s attention read for the query at position `start + i`, where `start` is the
    routing record's. Checked against `start` by `check` (the record calls it)."""

    keys: np.ndarray  # [rows, len(layers), topk] int32
    layers: tuple[int, ...]
    topk: int

    def check(self, start: int) -> IndexKeys:
        """These keys, canonical (rows sorted, int32), or ValueError naming the first bad row."""
        a = np.asarray(self.keys)
        layers = tuple(int(x) for x in self.layers)
        if a.ndim != 3 or a.shape[1:] != (len(layers), self.topk):
            raise ValueError(f"indexer keys must be [rows, {len(layers)} layers, top_k {self.topk}], "
                             f"got shape {a.shape}")
        if a.dtype.kind not in "iu":
            raise ValueError(f"indexer keys must be integers, got dtype {a.dtype}")
        if len(set(layers)) != len(layers) or any(not 0 <= x <= 0xFFFF for x in layers):
            raise ValueError(f"indexer layers must be distinct, in [0, 65535]: {layers}")
        if not 1 <= self.topk <= 0xFFFFFFFF:
            raise ValueError(f"indexer top_k must be positive, got {self.topk}")
        keys = a.astype(np.int64)
        pos = start + np.arange(a.shape[0], dtype=np.int64)[:, None, None]
        empty = keys < 0
        keys = np.sort(np.where(empty, np.iinfo(np.int64).max, keys), axis=-1)
        picked = keys != np.iinfo(np.int64).max
        want = np.minimum(self.topk, pos[..., 0] + 1)
        count = picked.sum(-1) != want
        late = (picked & (keys > pos)).any(-1)
        repeat = (picked[..., 1:] & (keys[..., 1:] == keys[..., :-1])).any(-1)
        for what, mask in (("has a negative key other than -1 (an empty slot)", (a < -1).any(-1)),
                           ("selects a key past its own position", late),
                           ("repeats a key", repeat),
                           ("does not select min(top_k, position + 1) keys", count)):
            if mask.any():
                i, j = map(int, np.argwhere(mask)[0])
                row = [int(k) for k in keys[i, j][picked[i, j]][:8]]
                raise ValueError(f"indexer keys of layer {layers[j]} at position {start + i} {what} "
                                 f"(top_k {self.topk}; first keys {row}): the record does not fit this sequence")
        out = np.where(picked, keys, -1).astype(np.int32)
        return IndexKeys(out, layers, int(self.topk))

    def slice_from(self, cut: int) -> IndexKeys:
        return IndexKeys(self.keys[cut:], self.layers, self.topk)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IndexKeys):
            return NotImplemented
        return (self.layers == other.layers and self.topk == other.topk
                and bool(np.array_equal(self.keys, other.keys)))

    def encode(self, start: int) -> bytes:
        """The section: parameters, layer list, then the chunks (see the module docstring)."""
        rows, nl, k = self.keys.shape
        last = start + rows - 1
        b_max = int(_low_bits(np.array([last]), k)[0]) if last >= k else 0
        per_row = max(1, _CHUNK_BITS // (nl * k * (b_max + 3)))  # unary < 3K bits a row and layer
        body = b"".join(_encode_chunk(self.keys[r:r + per_row], start + r, k)
                        for r in range(0, rows, per_row))
        return (_PARAMS.pack(nl, k, per_row, len(body)) + struct.pack(f"<{nl}H", *self.layers) + body)

    @classmethod
    def decode(cls, take, rows: int, start: int) -> IndexKeys:
        """Read a section with `take(n, what) -> memoryview` (the record's bounds-checked reader)."""
        nl, k, per_row, body_len = _PARAMS.unpack(take(_PARAMS.size, "indexer key parameters"))
        if k < 1 or per_row < 1:
            raise ValueError(f"indexer key section: invalid top_k {k} or chunk of {per_row} rows")
        layers = struct.unpack(f"<{nl}H", take(2 * nl, "indexer layer list"))
        body = np.frombuffer(take(body_len, "indexer keys"), np.uint8)
        keys = np.empty((rows, nl, k), np.int32)
        at = 0
        for r in range(0, rows, per_row):
            at = _decode_chunk(body, at, keys[r:r + per_row], start + r, k)
        if at != body.size:
            raise ValueError(f"indexer key section has {body.size - at} trailing bytes")
        return cls(keys, layers, k).check(start)


def _chunk_layout(n: int, nl: int, start: int, k: int):
    """Rows of a chunk that are coded, with their b and each (row, layer)'s unary / low-bit offsets."""
    p = start + np.arange(n, dtype=np.int64)
    coded = np.flatnonzero(p >= k)
    b, hi_len, lo_len = _row_bits(p[coded], k)
    hi_len, lo_len = np.repeat(hi_len, nl), np.repeat(lo_len, nl)
    hi_at = np.cumsum(hi_len) - hi_len
    lo_at = np.cumsum(lo_len) - lo_len
    return coded, np.repeat(b, nl), hi_at, int(hi_len.sum()), lo_at, int(lo_len.sum()), p


def _encode_chunk(keys: np.ndarray, start: int, k: int) -> bytes:
    n, nl, _ = keys.shape
    coded, b, hi_at, hi_total, lo_at, lo_total, _ = _chunk_layout(n, nl, start, k)
    v = keys[coded].reshape(-1, k).astype(np.int64)
    hi_bits = np.zeros(hi_total, np.uint8)
    hi_bits[(hi_at[:, None] + (v >> b[:, None]) + np.arange(k)).reshape(-1)] = 1
    lo_bits = np.zeros(lo_total, np.uint8)
    slot = lo_at[:, None] + np.arange(k) * b[:, None]
    for t in range(int(b.max(initial=0))):
        has = b > t
        lo_bits[(slot[has] + t).reshape(-1)] = ((v[has] >> t) & 1).reshape(-1)
    return np.packbits(hi_bits, bitorder="little").tobytes() + np.packbits(lo_bits, bitorder="little").tobytes()


def _decode_chunk(body: np.ndarray, at: int, out: np.ndarray, start: int, k: int) -> int:
    n, nl, _ = out.shape
    coded, b, hi_at, hi_total, lo_at, lo_total, p = _chunk_layout(n, nl, start, k)
    hi_bytes, lo_bytes = -(-hi_total // 8), -(-lo_total // 8)
    if at + hi_bytes + lo_bytes > body.size:
        raise ValueError(f"indexer key section truncated: rows from position {start} need "
                         f"{hi_bytes + lo_bytes} bytes at offset {at}, {body.size - at} left")
    hi_bits = np.unpackbits(body[at:at + hi_bytes], bitorder="little")[:hi_total]
    lo_bits = np.unpackbits(body[at + hi_bytes:at + hi_bytes + lo_bytes], bitorder="little")[:lo_total]
    ones = np.flatnonzero(hi_bits)
    m = coded.size * nl
    if ones.size != m * k:
        raise ValueError(f"indexer key section is corrupt: {ones.size} set bits for {m} rows of {k} keys "
                         f"(rows from position {start})")
    ones = ones.reshape(m, k)
    hi_len = np.diff(np.append(hi_at, hi_total))
    if m and ((ones[:, 0] < hi_at) | (ones[:, -1] >= hi_at + hi_len)).any():
        raise ValueError(f"indexer key section is corrupt: a row's unary field does not hold {k} keys "
                         f"(rows from position {start})")
    v = (ones - hi_at[:, None] - np.arange(k)) << b[:, None]
    slot = lo_at[:, None] + np.arange(k) * b[:, None]
    for t in range(int(b.max(initial=0))):
        has = b > t
        v[has] |= lo_bits[slot[has] + t].astype(np.int64) << t
    full = np.arange(k)[None, :]
    out[:] = np.where(full <= p[:, None], full, -1)[:, None, :]  # rows below top_k: every earlier key
    out[coded] = v.reshape(coded.size, nl, k)
    return at + hi_bytes + lo_bytes
