"""Build `moerl-epp` (llm-d's endpoint picker with moerl's plugins), `fakeenvoy` and llm-d's
`pd-sidecar`, where llm-d resolves.

``python -m router_ext.epp_build --out DIR`` (entry point: :func:`main`) writes
``DIR/moerl-epp`` and ``DIR/fakeenvoy`` from ``router_ext/epp/picker``, and ``DIR/pd-sidecar``
(llm-d's own prefill/decode proxy, unchanged) from llm-d's module.

The picker needs ``github.com/llm-d/llm-d-router v0.10.0``. Where a Go module
proxy serves that module, a plain build fetches it. Some proxies refuse it (403);
then the user points ``LLMD_ROUTER_SRC`` at a checkout of the tag and the build
adds ``replace github.com/llm-d/llm-d-router => $LLMD_ROUTER_SRC``. Either way the
build works on a copy of ``go.mod``/``go.sum`` (``go build -modfile``), so the
repository's module files never change and no llm-d source enters the repository.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

LLMD_MODULE = "github.com/llm-d/llm-d-router"
LLMD_VERSION = "v0.10.0"
LLMD_COMMIT = "71f4f0999f95b96c49a9d0c4afbd18dfdb943c26"
PICKER = Path(__file__).resolve().parent / "epp" / "picker"
BINARIES = {"moerl-epp": ".", "fakeenvoy": "./fakeenvoy", "pd-sidecar": f"{LLMD_MODULE}/cmd/pd-sidecar"}


class Unresolvable(RuntimeError):
    """llm-d's module cannot be had here: the reason, and what to do."""


@dataclass(frozen=True)
class Built:
    epp: Path
    fakeenvoy: Path
    sidecar: Path
    source: str  # "LLMD_ROUTER_SRC=<dir>" or "module proxy"


def _modfile(work: Path, src: str | None) -> Path:
    """A copy of the picker's go.mod/go.sum with absolute replaces (and llm-d's source when given)."""
    work.mkdir(parents=True, exist_ok=True)
    text = (PICKER / "go.mod").read_text()
    text = re.sub(r"(?m)^replace (github\.com/moerl/moerl/router_ext/epp) => \.\./?$",
                  lambda m: f"replace {m.group(1)} => {PICKER.parent}", text)
    if src:
        text += f"\nreplace {LLMD_MODULE} => {src}\n"
    (work / "go.mod").write_text(text)
    shutil.copyfile(PICKER / "go.sum", work / "go.sum")
    return work / "go.mod"


def _go(args: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(["go", *args], cwd=PICKER, env=env, capture_output=True, text=True, timeout=timeout_s)


def _last_line(text: str) -> str:
    return next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "no output")


def resolve(work: Path, timeout_s: float = 300.0) -> tuple[Path, str]:
    """The modfile to build with and where llm-d comes from; Unresolvable (one line) when nowhere."""
    if shutil.which("go") is None:
        raise Unresolvable("no `go` on PATH (Go 1.26 builds the picker)")
    src = os.environ.get("LLMD_ROUTER_SRC")
    if src:
        mod = Path(src) / "go.mod"
        first = mod.read_text().splitlines()[0] if mod.is_file() else ""
        if first.strip() != f"module {LLMD_MODULE}":
            raise Unresolvable(f"LLMD_ROUTER_SRC={src} is not a checkout of {LLMD_MODULE} (its go.mod says "
                               f"{first.strip() or 'nothing'}); point it at tag {LLMD_VERSION} ({LLMD_COMMIT[:7]})")
        return _modfile(work, str(Path(src).resolve())), f"LLMD_ROUTER_SRC={src}"
    modfile = _modfile(work, None)
    env = {**os.environ, "GOFLAGS": "-mod=mod"}
    got = _go(["mod", "download", f"-modfile={modfile}", f"{LLMD_MODULE}@{LLMD_VERSION}"], env, timeout_s)
    if got.returncode != 0:
        raise Unresolvable(f"{LLMD_MODULE} {LLMD_VERSION} does not resolve here ({_last_line(got.stderr)}); "
                           f"set LLMD_ROUTER_SRC to a checkout of tag {LLMD_VERSION} ({LLMD_COMMIT[:7]})")
    return modfile, "module proxy"


def build(out: Path, timeout_s: float = 900.0) -> Built:
    """Build the binaries into `out` (Go's build cache makes a warm rebuild take seconds)."""
    out = out.resolve()
    modfile, source = resolve(out / "modfile")
    env = {**os.environ, "GOFLAGS": "-mod=mod"}
    for name, pkg in BINARIES.items():
        done = _go(["build", f"-modfile={modfile}", "-o", str(out / name), pkg], env, timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"go build {pkg} (llm-d from {source}) failed: {done.stderr.strip()[-2000:]}")
    return Built(out / "moerl-epp", out / "fakeenvoy", out / "pd-sidecar", source)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m router_ext.epp_build", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for moerl-epp, fakeenvoy and pd-sidecar")
    args = ap.parse_args(argv)
    try:
        built = build(args.out)
    except Unresolvable as e:
        print(f"error: {e}")
        return 2
    print(f"built {built.epp}, {built.fakeenvoy} and {built.sidecar} (llm-d {LLMD_VERSION} from {built.source})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
