"""The tool sandbox: a tool that hangs, forks, floods its output, reaches for the network or crashes
ends its own call with a message within its limit, leaves no process behind, and the next call works."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rl_loop.tools.sandbox import Sandbox, SandboxLimits


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def sleep_forever() -> str:
    while True:
        time.sleep(1)


def fork_sleepers(marker: str) -> str:
    """Two detached grandchildren (one leaves the process group) that would outlive the tool."""
    code = f"import time; time.sleep(1000)  # {marker}"
    subprocess.Popen([sys.executable, "-c", code])
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    return "forked"


def flood() -> str:
    chunk = "x" * (1 << 20)
    for _ in range(1024):  # 1 GiB
        sys.stdout.write(chunk)
    return "done"


def huge_answer() -> str:
    return "y" * (200 << 20)  # within the address-space limit: the output cap stops it


def connect(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        return "connected"


def write_file(name: str, text: str) -> str:
    Path(name).write_text(text)
    return os.getcwd()


def crash() -> str:
    os.abort()


def burn_cpu() -> str:
    while True:
        pass


def add(a: int, b: int) -> int:
    return a + b


def _call(box: Sandbox, fn, **args):
    return asyncio.run(box.call(fn, args))


@pytest.fixture
def box(tmp_path):
    b = Sandbox(SandboxLimits(wall_s=3.0, cpu_s=2, output_bytes=1 << 16), root=tmp_path)
    yield b
    b.close()


def test_a_tool_answers_in_its_own_directory(box):
    out = _call(box, add, a=2, b=3)
    assert out.ok and out.text == "5"
    where = _call(box, write_file, name="note.txt", text="hi")
    assert Path(where.text) == box.workdir and (box.workdir / "note.txt").read_text() == "hi"


def test_a_tool_that_sleeps_forever_is_stopped_at_the_wall_clock(box):
    out = _call(box, sleep_forever)
    assert out.error == "timeout" and "timed out after 3 s" in out.text
    assert out.wall_s >= 3.0, "the tool was given its whole wall-clock allowance"
    assert _call(box, add, a=1, b=1).text == "2"


def test_a_tool_that_forks_leaves_no_process_behind(box):
    marker = f"moerl-sandbox-{uuid.uuid4().hex}"
    out = _call(box, fork_sleepers, marker=marker)
    assert out.ok and out.text == "forked"
    deadline = time.monotonic() + 5
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker) == []
    assert out.isolation.get("processes") == "pid-namespace", out.isolation


def test_a_tool_that_writes_1_gib_is_stopped_at_the_output_cap(box):
    out = _call(box, flood)
    assert out.error == "output" and f"exceeded {1 << 16} bytes" in out.text
    big = _call(box, huge_answer)
    assert big.error == "output", big


def test_a_tool_cannot_open_a_network_socket(box):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        out = _call(box, connect, port=server.getsockname()[1])
    assert out.error == "raised" and out.text.startswith("tool error: ") and "connected" not in out.text
    assert out.isolation.get("network") == "namespace", out.isolation


def test_crashes_and_cpu_burners_end_their_turn_with_the_reason(box, tmp_path):
    crashed = _call(box, crash)
    assert crashed.error == "crashed" and "SIGABRT" in crashed.text
    cpu_box = Sandbox(SandboxLimits(wall_s=30.0, cpu_s=1), root=tmp_path)  # the wall clock is generous on a busy host
    try:
        burner = _call(cpu_box, burn_cpu)
    finally:
        cpu_box.close()
    assert burner.error == "crashed" and "CPU limit 1 s" in burner.text
    assert _call(box, add, a=2, b=2).text == "4"


def test_close_removes_the_working_directory(tmp_path):
    b = Sandbox(root=tmp_path)
    assert b.workdir.is_dir()
    b.close()
    assert not b.workdir.exists()


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="wall_s must be > 0"):
        SandboxLimits(wall_s=0)
