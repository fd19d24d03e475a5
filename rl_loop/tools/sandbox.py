"""A bounded process for tool calls: what a policy's tool call may cost, and nothing more.

A tool is a Python callable (a verifiers tool function, a built-in tool). `Sandbox.call`
ships it (cloudpickle: module-level functions by reference, closures by value) with its
arguments to a fresh `python -m rl_loop.tools.sandbox_worker`, which:

* runs in the rollout's own working directory (a temporary directory per `Sandbox`,
  removed by `close`);
* enters new user, network and PID namespaces (unprivileged `unshare`): no network
  interface but a downed loopback, and every process the tool starts lives in the PID
  namespace, which the kernel empties when its first process dies;
* sets rlimits: CPU seconds, address space, size of any file it writes.

The caller enforces the wall clock and the output cap: past either, the worker's
process group is killed (SIGKILL), its namespace init with it (parent-death signal),
and with that every process the tool started. A timeout, a crash, an oversized output
or an exception raised by the tool is the turn's answer (`ToolOutcome.text`, an error
message the policy sees), never an exception of the rollout.

What it does not isolate (docs/rl.md, "Tools and the sandbox"): the file system (the tool
runs as the same user and can read and write whatever that user can; the working
directory is a convention, not a chroot), the machine's memory beyond the address-space
limit, the number of processes, and time spent waiting on disk. Where unprivileged user
namespaces are off, the worker falls back to refusing sockets inside Python
(`network = "python-guard"`), which native code can bypass, and children that leave the
process group (setsid) are not tracked; `ToolOutcome.isolation` says which applied.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import cloudpickle


@dataclass(frozen=True)
class SandboxLimits:
    """What one tool call may use. Past a limit the call ends with a message, not the run."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 1024
    output_bytes: int = 64 * 1024  # the tool's answer, and separately what it prints
    file_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "output_bytes", "file_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")


@dataclass
class ToolOutcome:
    """One tool call's result: `text` is what the policy sees; `error` names what went wrong, if anything."""

    text: str
    error: str | None = None  # None, or one of: raised, timeout, output, crashed
    wall_s: float = 0.0
    isolation: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


async def _drain(stream: asyncio.StreamReader, cap: int, over: asyncio.Event) -> bytes:
    """Read `stream` to its end, keeping at most `cap` bytes; past the cap set `over` and stop."""
    chunks, size = [], 0
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > cap:
            over.set()
            return b"".join(chunks)
        chunks.append(chunk)


async def _reaped(proc: asyncio.subprocess.Process, grace_s: float = 5.0) -> None:
    """Wait for a killed worker's exit, for a bounded time. Its group is dead by now, but the event
    loop's child watcher may never report it (seen under pytest-xdist, where the call waited for
    ever with no child left): the call then ends anyway instead of hanging the rollout."""
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
    except asyncio.TimeoutError:
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Sandbox:
    """One rollout's tool process settings and working directory (see the module doc)."""

    def __init__(self, limits: SandboxLimits | None = None, *, root: str | Path | None = None):
        self.limits = limits or SandboxLimits()
        self.workdir = Path(tempfile.mkdtemp(prefix="moerl-tool-", dir=root))
        self.calls = 0

    async def call(self, fn: Callable[..., Any], args: dict[str, Any]) -> ToolOutcome:
        """Run `fn(**args)` in a sandboxed worker; the outcome carries its answer or the reason it has none."""
        lim = self.limits
        payload = cloudpickle.dumps((fn, dict(args), {"cpu_s": lim.cpu_s, "memory_mb": lim.memory_mb,
                                                      "file_bytes": lim.file_bytes}))
        self.calls += 1
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rl_loop.tools.sandbox_worker", cwd=self.workdir, start_new_session=True,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in sys.path)})
        over = asyncio.Event()
        try:
            proc.stdin.write(payload)
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass
        reads = asyncio.gather(_drain(proc.stdout, lim.output_bytes, over),
                               _drain(proc.stderr, lim.output_bytes, over), proc.wait())
        over_wait = asyncio.ensure_future(over.wait())
        try:
            done, _ = await asyncio.wait({reads, over_wait}, timeout=lim.wall_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            _kill_group(proc.pid)  # also every child the tool left behind, finished or not
            over_wait.cancel()
        wall = time.perf_counter() - t0
        if reads not in done:
            await _reaped(proc)
            reads.cancel()
            if over.is_set():
                return ToolOutcome(f"tool error: output exceeded {lim.output_bytes} bytes; the tool was stopped",
                                   "output", wall)
            return ToolOutcome(f"tool error: timed out after {lim.wall_s:g} s; the tool was stopped", "timeout", wall)
        out, err, code = reads.result()
        if over.is_set():
            return ToolOutcome(f"tool error: output exceeded {lim.output_bytes} bytes; the tool was stopped",
                               "output", wall)
        return _outcome(out, err, code, wall, lim)

    def close(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


def _outcome(out: bytes, err: bytes, code: int, wall: float, lim: SandboxLimits) -> ToolOutcome:
    try:
        reply = json.loads(out.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        reply = None
    if not isinstance(reply, dict):
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        if code < 0:
            how = f"killed by {signal.Signals(-code).name}"
            if -code == signal.SIGXCPU:
                how += f" (CPU limit {lim.cpu_s} s)"
            elif -code == signal.SIGXFSZ:
                how += f" (file size limit {lim.file_bytes} bytes)"
        else:
            how = f"exit code {code}"
        detail = f": {' | '.join(tail)}" if tail else ""
        return ToolOutcome(f"tool error: the tool crashed ({how}){detail}", "crashed", wall)
    iso = reply.get("isolation", {})
    if "error" in reply:
        return ToolOutcome(f"tool error: {reply['error']}", "raised", wall, iso)
    return ToolOutcome(reply["result"], None, wall, iso)
