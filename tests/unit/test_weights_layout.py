"""Weight sync's two packages, module by module: the transport (``vllm_ext.transport``, no vLLM)
and the receiver's vLLM adapter (``vllm_ext.weights``) on top of it.

The whole tree's graph is acyclic and the transport free of vLLM (``test_import_graph``);
here, which module of the two packages builds on which, so a new dependency between them
is a decision made in this file, not an accident.
"""

from __future__ import annotations

import subprocess
import sys

from tests.unit.test_import_graph import ROOT, import_graph

TRANSPORT = "vllm_ext.transport"
WEIGHTS = "vllm_ext.weights"


def short(module: str) -> str:
    return module.removeprefix("vllm_ext.")


def layout(package: str) -> dict[str, set[str]]:
    inside, _ = import_graph(ROOT, ("vllm_ext",))
    return {short(m): {short(t) for t in ts} for m, ts in inside.items() if m == package or m.startswith(package + ".")}


def test_transport_layout():
    t = {m.removeprefix("transport."): {d.removeprefix("transport.") for d in ds} for m, ds in layout(TRANSPORT).items()}
    # one leaf of shared primitives, one module per lane, orchestration on top
    assert t["format"] == set() and t["channel"] == {"format"}
    assert t["wire"] == {"format"} and t["shm"] == {"format"}
    assert t["te"] == {"format", "shm"}  # the Mooncake Transfer Engine lane: slots, hashes as the ring's
    assert t["stream"] == {"format", "shm", "te", "channel"}
    assert t["plan"] == set()  # the resharding plan: shapes and layouts only
    assert t["sharded"] == {"format", "plan", "shm", "stream"}
    assert t["peak_rss"] == set()  # peak memory over an update, read from /proc
    assert t["client"] == {"wire", "stream", "shm"}  # function-level imports: seen
    assert t["transport"] == set()


def test_receiver_adapter_layout():
    w = layout(WEIGHTS)
    tr = {f"transport.{m}" for m in ("format", "plan", "sharded", "stream", "wire", "peak_rss")}
    assert w["weights.served"] == {"metrics"}  # the served policy version: told to subscribers, knows no lane
    assert w["weights.reload"] == {"transport.format", "transport.plan"}  # experts stacked, names from the wire
    assert w["weights.engine"] == tr | {"weights.served", "weights.reload"}
    assert w["weights.swap"] == {"metrics", "transport.client"}  # the route the trainer's client calls (vllm_ext.routes adds it)
    assert w["weights.api"] == {"metrics"}  # the AsyncLLM hooks; the serving wrappers are vllm_ext.serving's
    assert w["weights"] == {"metrics", "weights.api"}  # register() activates its patches


def test_filesystem_transport_imports_without_the_streaming_modules():
    """``import vllm_ext.transport.wire`` (what the trainer does to publish a version) loads the
    shared primitives and nothing of the streaming transport."""
    out = subprocess.run(
        [sys.executable, "-c", "import sys, vllm_ext.transport.wire; "
         "print(' '.join(sorted(m for m in sys.modules if m.startswith('vllm_ext'))))"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["vllm_ext", TRANSPORT, f"{TRANSPORT}.format", f"{TRANSPORT}.wire"]
