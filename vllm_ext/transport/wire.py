"""The filesystem transport, both ends: ``write_fs`` / ``read_fs``.

Safetensors shards in a directory, then a commit marker (``moerl_commit.json``,
written last by atomic rename) naming every shard with its size and xxh3-64
checksum, every tensor with its dtype and shape, and the version. A reader
refuses a directory without the marker, with a shard whose size or checksum
differs, or whose tensors differ from the marker: a half-written or corrupted
version never loads. The other transport, streaming, is ``stream.py``; what both
share (``TensorMeta``, ``WeightUpdateError``, checksums) is ``format.py``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from .format import FORMAT, TensorMeta, WeightUpdateError, check_against, digest, hasher

__all__ = ["COMMIT_MARKER", "write_fs", "read_marker", "read_fs"]

COMMIT_MARKER = "moerl_commit.json"


def write_fs(
    out_dir: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    version: int,
    *,
    shard_bytes: int = 1 << 30,
    fsync: bool = True,
) -> dict:
    """Write tensors (consumed lazily, e.g. layer by layer) as shards + commit marker.

    Returns the marker. The directory must not already hold a committed version."""
    from safetensors.torch import save

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / COMMIT_MARKER).exists():
        raise FileExistsError(f"{out} already holds a committed version")
    algo, _ = hasher()
    shards: list[dict] = []
    metas: list[TensorMeta] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        name = f"model-{len(shards) + 1:05d}.safetensors"
        blob = save(pending, metadata={"format": "pt"})
        with open(out / name, "wb") as f:
            f.write(blob)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        shards.append({"file": name, "bytes": len(blob), "checksum": digest(blob), "tensors": sorted(pending)})
        pending, pending_bytes = {}, 0

    for name, t in tensors:
        t = t.detach().cpu().contiguous()
        metas.append(TensorMeta.of(name, t))
        pending[name] = t
        pending_bytes += t.numel() * t.element_size()
        if pending_bytes >= shard_bytes:
            flush()
    flush()
    if len({m.name for m in metas}) != len(metas):
        raise ValueError("duplicate tensor names in the update")
    marker = {
        "format": FORMAT,
        "version": int(version),
        "checksum": algo,
        "shards": shards,
        "tensors": [m.to_json() for m in metas],
        "created": time.time(),
    }
    tmp = out / (COMMIT_MARKER + ".tmp")
    tmp.write_text(json.dumps(marker))
    if fsync:
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    os.replace(tmp, out / COMMIT_MARKER)
    if fsync:
        dfd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return marker


def read_marker(path: str | Path) -> dict:
    p = Path(path) / COMMIT_MARKER
    if not p.is_file():
        raise WeightUpdateError(f"{path}: no commit marker ({COMMIT_MARKER}); the version is incomplete or still being written")
    try:
        marker = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise WeightUpdateError(f"{p}: unreadable commit marker: {exc}") from exc
    if marker.get("format") != FORMAT:
        raise WeightUpdateError(f"{p}: unknown format {marker.get('format')!r}")
    return marker


def read_fs(
    path: str | Path,
    *,
    version: int | None = None,
    expected: dict[str, TensorMeta] | None = None,
) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """Read and verify a committed version: (version, [(name, tensor)] in marker order)."""
    from safetensors.torch import load

    path = Path(path)
    marker = read_marker(path)
    got_version = int(marker["version"])
    if version is not None and got_version != int(version):
        raise WeightUpdateError(f"{path}: holds version {got_version}, update asked for {version}")
    metas = [TensorMeta.from_json(m) for m in marker["tensors"]]
    check_against(metas, expected)
    by_name: dict[str, torch.Tensor] = {}
    for shard in marker["shards"]:
        f = path / shard["file"]
        try:
            size = f.stat().st_size
        except OSError as exc:
            raise WeightUpdateError(f"{f}: missing shard: {exc}") from exc
        if size != shard["bytes"]:
            raise WeightUpdateError(f"{f}: {size} bytes, commit marker says {shard['bytes']} (truncated or replaced)")
        with open(f, "rb", buffering=0) as fh:
            buf = fh.read()
        if len(buf) != size:
            raise WeightUpdateError(f"{f}: short read ({len(buf)} of {size} bytes)")
        if digest(buf, marker["checksum"]) != shard["checksum"]:
            raise WeightUpdateError(f"{f}: checksum mismatch (corrupted shard)")
        try:
            tensors = load(buf)
        except Exception as exc:  # safetensors raises its own error types
            raise WeightUpdateError(f"{f}: unreadable safetensors: {exc}") from exc
        if sorted(tensors) != sorted(shard["tensors"]):
            raise WeightUpdateError(f"{f}: tensors differ from the commit marker")
        by_name.update(tensors)
    out = []
    for m in metas:
        t = by_name.get(m.name)
        if t is None or TensorMeta.of(m.name, t) != m:
            raise WeightUpdateError(f"{path}: tensor {m.name} differs from the commit marker")
        out.append((m.name, t))
    return got_version, out
