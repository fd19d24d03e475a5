"""What both transports share: the update's format, its one error type, dtypes, checksums, the layout check.

A weight update is a complete set of HF-layout tensors (name -> tensor) plus an
integer policy version, described by ``TensorMeta`` (name, dtype, shape) in the
filesystem transport's commit marker (``wire.py``) and in the streaming
transport's manifest (``stream.py``), both tagged ``FORMAT``. Both check it
against the served model with ``check_against`` before accepting any weight
bytes, hash with ``hasher``/``digest`` (xxh3-64; also the shared-memory ring's
per-slot checksum, ``shm.py``) and refuse a bad update with ``WeightUpdateError``.

Imports nothing of the package: every other module of ``vllm_ext.transport``
builds on it, and it on none of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["FORMAT", "ReceiverLost", "TensorMeta", "WeightUpdateError", "check_against", "digest", "dtype_name",
           "dtype_of", "hasher"]

FORMAT = "moerl-weights/1"


class WeightUpdateError(RuntimeError):
    """A weight update that must not be applied (incomplete, corrupted, mismatched, or lost)."""


class ReceiverLost(WeightUpdateError):
    """A sender's receiver is gone (whoever drives the replicas said why) or did not join in time."""


_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise WeightUpdateError(f"unsupported dtype {name!r}") from None


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.Size(self.shape).numel()
        return n * torch.empty((), dtype=dtype_of(self.dtype)).element_size()

    def to_json(self) -> list:
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_json(cls, obj) -> "TensorMeta":
        name, dtype, shape = obj
        return cls(str(name), str(dtype), tuple(int(s) for s in shape))

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "TensorMeta":
        return cls(name, dtype_name(t.dtype), tuple(t.shape))


def hasher():
    """(algorithm name, factory of incremental hash objects): xxh3-64, else blake2b-64."""
    try:
        import xxhash

        return "xxh3_64", lambda: xxhash.xxh3_64()
    except ImportError:  # pragma: no cover - xxhash ships with vLLM's requirements
        import hashlib

        return "blake2b", lambda: hashlib.blake2b(digest_size=8)


def digest(data, algo: str | None = None) -> str:
    name, make = hasher()
    if algo is not None and algo != name:
        if algo == "blake2b":
            import hashlib

            make = lambda: hashlib.blake2b(digest_size=8)  # noqa: E731
        else:
            raise WeightUpdateError(f"checksum algorithm {algo!r} not available here")
    h = make()
    h.update(memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data)
    return h.hexdigest()


def check_against(metas: Iterable[TensorMeta], expected: dict[str, TensorMeta] | None) -> None:
    """Raise WeightUpdateError naming missing, unexpected and mis-shaped tensors.

    Shapes must match exactly; floating dtypes may differ (vLLM casts on load,
    as it does for a checkpoint), other dtypes must match."""
    if expected is None:
        return
    got = {m.name: m for m in metas}
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    wrong = []
    for k in sorted(set(got) & set(expected)):
        g, e = got[k], expected[k]
        if g.shape != e.shape:
            wrong.append(f"{k}: update {list(g.shape)}, model {list(e.shape)}")
        elif g.dtype != e.dtype and not (dtype_of(g.dtype).is_floating_point and dtype_of(e.dtype).is_floating_point):
            wrong.append(f"{k}: update dtype {g.dtype}, model {e.dtype}")
    if missing or extra or wrong:
        parts = []
        for title, names in (("missing", missing), ("unexpected", extra), ("mismatched", wrong)):
            if names:
                shown = "; ".join(names[:8]) + (f"; ... and {len(names) - 8} more" if len(names) > 8 else "")
                parts.append(f"{len(names)} {title}: {shown}")
        raise WeightUpdateError("weight update does not match the served model: " + " | ".join(parts))
