"""The process a sandboxed tool call runs in (started by `sandbox.Sandbox.call`; the protocol is private).

stdin: cloudpickled `(fn, args, limits)`. stdout: one JSON object, `{"result": text}` or
`{"error": text}`, plus `isolation` (what applied). The tool's own prints go to stderr.
The tool runs as the child of the first process of fresh user/network/PID namespaces,
which dies with this one; see sandbox.py for what that isolates.
"""

from __future__ import annotations

import ctypes
import inspect
import json
import os
import resource
import signal
import socket
import sys

CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000
PR_SET_PDEATHSIG = 1


def _limit(limits: dict) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    memory = limits["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))


class _NoNetwork(socket.socket):
    def __init__(self, family=-1, *args, **kwargs):
        if family not in (-1, socket.AF_UNIX):
            raise OSError("network access is disabled in the tool sandbox")
        super().__init__(family, *args, **kwargs)


def _isolate() -> dict:
    """New user+net+PID namespaces if the kernel lets us; else a Python-level socket guard."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) == 0:
        return {"network": "namespace", "processes": "pid-namespace"}
    socket.socket = _NoNetwork  # the fallback the module doc names; native code can bypass it
    return {"network": "python-guard", "processes": "process-group"}


def _run(fn, args: dict, result_fd: int, isolation: dict) -> None:
    try:
        value = fn(**args)
        if inspect.isawaitable(value):
            import asyncio

            async def wait():
                return await value

            value = asyncio.run(wait())
        reply = {"result": value if isinstance(value, str) else str(value)}
    except BaseException as exc:  # the tool's failure is its answer
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    reply["isolation"] = isolation
    with os.fdopen(result_fd, "w") as out:
        json.dump(reply, out)


def main() -> None:
    import cloudpickle

    fn, args, limits = cloudpickle.loads(sys.stdin.buffer.read())
    result_fd = os.dup(1)
    os.dup2(2, 1)  # the tool's prints are not its answer
    isolation = _isolate()
    _limit(limits)
    if isolation["processes"] != "pid-namespace":
        _run(fn, args, result_fd, isolation)
        return
    init = os.fork()  # the first process of the new PID namespace: when it ends, all the tool's processes end
    if init == 0:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # The namespace's init ignores signals it has no handler for (SIGXCPU, SIGABRT), so the tool is its child.
        tool = os.fork()
        if tool == 0:
            _run(fn, args, result_fd, isolation)
            os._exit(0)
        os.close(result_fd)
        os._exit(_exit_code(os.waitpid(tool, 0)[1]))
    os.close(result_fd)
    code = _exit_code(os.waitpid(init, 0)[1])
    if code > 128:
        os.kill(os.getpid(), code - 128)
    sys.exit(code)


def _exit_code(status: int) -> int:
    """A wait status as a shell would report it: 128 + the signal that ended the process."""
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


if __name__ == "__main__":
    main()
