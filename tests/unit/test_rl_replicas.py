"""Managed vLLM servers: limits read from the checkpoint, why a server did not start, in one line, and
the shared-memory segments a stopped server leaves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from multiprocessing import shared_memory

import pytest

from rl_loop.replicas import checkpoint_context, fit_context, last_error_line, server_command
from rl_loop.shm_segments import group_segments, remove_unused
from vllm_ext.transport.shm import SHM_DIR


def _checkpoint(tmp_path, **cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_context_is_the_checkpoints_max_position_embeddings(tmp_path):
    assert checkpoint_context(_checkpoint(tmp_path, max_position_embeddings=256)) == 256
    assert checkpoint_context(_checkpoint(tmp_path, text_config={"max_position_embeddings": 512})) == 512
    with pytest.raises(ValueError, match="no integer max_position_embeddings"):
        checkpoint_context(_checkpoint(tmp_path, hidden_size=8))


def test_fit_context_sizes_the_server_or_names_the_numbers_and_flag(tmp_path):
    ckpt = _checkpoint(tmp_path, max_position_embeddings=256)
    assert fit_context(ckpt, 10, 246, "--max-tokens") == 256
    with pytest.raises(ValueError) as e:
        fit_context(ckpt, 10, 247, "--max-tokens")
    assert str(e.value) == (f"the longest prompt (10 tokens) + --max-tokens 247 = 257 tokens exceed the checkpoint's "
                            f"context of 256 tokens (max_position_embeddings in {ckpt / 'config.json'}); "
                            f"lower --max-tokens to at most 246")
    with pytest.raises(ValueError,
                       match=r"\(256 tokens\) \+ --max-tokens 1 = 257 tokens exceed .*; use shorter prompts$"):
        fit_context(ckpt, 256, 1, "--max-tokens")


def test_server_command_carries_the_given_length():
    cmd = server_command("m", 1, dtype="bfloat16", max_model_len=300)
    assert cmd[cmd.index("--max-model-len") + 1] == "300"


VALIDATION_LOG = """\
(APIServer pid=1) WARNING 12-01 [system_utils.py:255] failed with error current limit `OSError: [Errno 24] Too many`
Traceback (most recent call last):
  File "x.py", line 1, in <module>
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (9000) is greater than 8192. [type=value_error, input_value=ArgsKwargs(())]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""

# the shape of a vLLM log whose weights file is truncated: the cause is logged by the worker,
# then wrapped twice
ENGINE_LOG = """\
(Worker pid=9) ERROR 12-01 04:54:16 [multiproc_executor.py:953] Traceback (most recent call last):
(Worker pid=9) ERROR 12-01 04:54:16 [multiproc_executor.py:953] safetensors._safetensors_rust.SafetensorError: \
Error while deserializing header: incomplete metadata
(EngineCore pid=7) ERROR 12-01 04:54:18 [core.py:1510] Exception: WorkerProc initialization failed due to an \
exception in a background process. See stack trace for root cause.
Exception: WorkerProc initialization failed due to an exception in a background process. \
See stack trace for root cause.
(APIServer pid=1) Traceback (most recent call last):
(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


@pytest.mark.parametrize("log, line", [
    (VALIDATION_LOG, "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: "
                     "Value error, User-specified max_model_len (9000) is greater than 8192."),
    (ENGINE_LOG, "safetensors._safetensors_rust.SafetensorError: Error while deserializing header: incomplete metadata"),
    ("usage: api_server.py [-h]\napi_server.py: error: unrecognized arguments: --bogus\n",
     "api_server.py: error: unrecognized arguments: --bogus"),
    ("INFO starting\nKilled\n\n", "Killed"),
])
def test_last_error_line_finds_the_cause(log, line):
    assert last_error_line(log) == line


_HOLDER = """
import sys, time
from multiprocessing import shared_memory
seg = shared_memory.SharedMemory(create=True, size=1 << 20)
print(seg.name, flush=True)
time.sleep(600)
"""


def test_a_killed_groups_segments_are_removed_and_a_segment_still_mapped_is_kept():
    """A server killed by a signal leaves its /dev/shm segments (vLLM's message queues): read while
    its group lives, they are unlinked after it died; one that a live process maps stays."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    kept = shared_memory.SharedMemory(create=True, size=4096)
    try:
        theirs = str(SHM_DIR / proc.stdout.readline().strip())
        found = group_segments(proc.pid)
        assert theirs in found and f"{SHM_DIR}/{kept.name}" not in found, found
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert os.path.exists(theirs)  # a killed process unlinks nothing
        mine = f"{SHM_DIR}/{kept.name}"
        assert remove_unused([theirs, mine]) == [theirs]
        assert not os.path.exists(theirs) and os.path.exists(mine)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kept.close()
        kept.unlink()


def test_only_servers_without_cores_of_their_own_nap(monkeypatch, tmp_path):
    """`rl_loop.replicas` asks for the naps where a server shares its cores, never for a pinned one."""
    from patches.vllm_cpu_shm_reader_naps import ENV
    from rl_loop import replicas

    started = []
    monkeypatch.setattr(replicas.subprocess, "Popen", lambda cmd, **kw: started.append(kw["env"]))
    monkeypatch.setattr(replicas, "checkpoint_context", lambda model: 256)
    monkeypatch.delenv(ENV, raising=False)
    replicas.start_replica("shared", tmp_path, 1, tmp_path, dtype="float32")
    replicas.start_replica("pinned", tmp_path, 2, tmp_path, dtype="float32", cpus=(0,))
    assert started[0][ENV] == "1" and ENV not in started[1]
    monkeypatch.setenv(ENV, "0")  # the user's word wins
    replicas.start_replica("shared", tmp_path, 3, tmp_path, dtype="float32")
    assert started[2][ENV] == "0"
