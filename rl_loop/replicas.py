"""Managed vLLM replicas: start, health-check and stop `vllm.entrypoints.openai.api_server`.

On one machine `moerl rl` runs its replicas as subprocesses with the vllm_ext
plugin enabled; on a cluster it is given existing endpoints instead and starts
nothing. Each replica runs in its own process session so that stopping it also
stops vLLM's engine-core and worker children.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from patches.vllm_cpu_shm_reader_naps import ENV as SHM_NAP_ENV
from vllm_ext.routing.handoff import sweep_dead_servers

from . import placement
from .shm_segments import group_segments, remove_unused

PLUGIN = "moerl_routing"


@dataclass
class Replica:
    """One vLLM server: a base URL, and the process when we started it."""

    name: str
    base_url: str
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    up: bool = True
    updating: bool = False
    policy_version: int = 0
    in_flight: int = 0
    segments: frozenset[str] = frozenset()  # /dev/shm paths its processes mapped once healthy
    role: str = "both"  # "prefill" / "decode" under prefill/decode disaggregation (rl_loop.disagg)


class ServerStartError(RuntimeError):
    """A managed vLLM server exited, or did not answer, before it was healthy (one line: the cause and the log)."""


def checkpoint_context(model: Path | str) -> int:
    """Tokens per sequence the checkpoint supports: `max_position_embeddings` of its config.json.

    Both engines stop there: the trainer sizes its RoPE cache by it and vLLM refuses a
    longer --max-model-len.
    """
    path = Path(model) / "config.json"
    cfg = json.loads(path.read_text())
    found = cfg.get("max_position_embeddings", (cfg.get("text_config") or {}).get("max_position_embeddings"))
    if not isinstance(found, int):
        raise ValueError(f"{path}: no integer max_position_embeddings; cannot tell the checkpoint's context")
    return found


def fit_context(model: Path | str, prompt_tokens: int, max_tokens: int, flag: str) -> int:
    """The --max-model-len for sequences of `prompt_tokens` + `max_tokens`, refused before any server
    starts (ValueError naming the numbers and `flag`, the option to change) when the checkpoint's context
    is shorter."""
    context, need = checkpoint_context(model), prompt_tokens + max_tokens
    if need > context:
        fix = f"lower {flag} to at most {context - prompt_tokens}" if prompt_tokens < context else "use shorter prompts"
        raise ValueError(f"the longest prompt ({prompt_tokens} tokens) + {flag} {max_tokens} = {need} tokens exceed "
                         f"the checkpoint's context of {context} tokens (max_position_embeddings in "
                         f"{Path(model) / 'config.json'}); {fix}")
    return need


def server_command(model: Path | str, port: int, *, dtype: str, max_model_len: int, max_num_seqs: int = 64,
                   kv_cache_gib: float = 1.0, enforce_eager: bool = True, extra: list[str] | None = None) -> list[str]:
    """The vLLM command line moerl uses on CPU (docs/design.md, "Measured facts": block size a multiple of 32).

    The KV cache is sized explicitly: vllm-cpu's default takes a fraction of the
    machine's RAM per replica, which two replicas and a trainer cannot share.
    """
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
        "--kv-cache-memory-bytes", str(int(kv_cache_gib * (1 << 30))), "--block-size", "32",
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs), "--enable-prefix-caching", "--seed", "0",
        # the moerl weight-transfer backend (vllm_ext.weights) receives trainer weights
        "--weight-transfer-config", json.dumps({"backend": "moerl"}),
        *(["--enforce-eager"] if enforce_eager else []), *(extra or []),
    ]


def start_replica(name: str, model: Path | str, port: int, log_dir: Path, *, dtype: str,
                  max_model_len: int | None = None, max_num_seqs: int = 64, kv_cache_gib: float = 1.0,
                  enforce_eager: bool = True, extra: list[str] | None = None, env: dict | None = None,
                  cpus: tuple[int, ...] | None = None, tensor_parallel: int = 1) -> Replica:
    """Start one server, for sequences up to `max_model_len` tokens (default: the checkpoint's context);
    with `cpus`, the whole process tree and vLLM's OpenMP threads stay on those cores (without, its
    shared-memory queue readers nap: `patches.vllm_cpu_shm_reader_naps`). With
    `tensor_parallel` > 1 its workers split the cores (this process's, without `cpus`)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    bind = cpus or (tuple(sorted(os.sched_getaffinity(0))) if tensor_parallel > 1 else None)
    # without cores of its own, vLLM's queue readers nap instead of spinning on shared cores (the patch says why)
    naps = {} if cpus else {SHM_NAP_ENV: "1"}
    full_env = {**naps, **os.environ, "VLLM_PLUGINS": PLUGIN, "VLLM_SERVER_DEV_MODE": "1",
                **(placement.replica_env(bind, tensor_parallel) if bind else {}), **(env or {})}
    if tensor_parallel > 1:
        extra = [*(extra or []), "--tensor-parallel-size", str(tensor_parallel), "--distributed-executor-backend", "mp"]
    elif "--distributed-executor-backend" not in (extra or []):
        # The one worker runs inside the engine-core process: vllm-cpu otherwise spawns it as a third
        # process (API server, engine core, worker), each importing vLLM and torch, with a shared-memory
        # queue between the last two that spins or naps on the cores the model computes on
        # (`benchmarks.replica_startup` measures both). vllm-cpu allows the in-process executor only with
        # VLLM_ENABLE_V1_MULTIPROCESSING=0, which still gives the engine core its own process.
        extra = [*(extra or []), "--distributed-executor-backend", "uni"]
        full_env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cmd = server_command(model, port, dtype=dtype, max_model_len=max_model_len or checkpoint_context(model),
                         max_num_seqs=max_num_seqs, kv_cache_gib=kv_cache_gib, enforce_eager=enforce_eager, extra=extra)
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                                preexec_fn=placement.pin(cpus) if cpus else None)
    return Replica(name=name, base_url=f"http://127.0.0.1:{port}", process=proc, log_path=log_path)


def wait_healthy(replicas: list[Replica], timeout_s: float = 600.0) -> None:
    """Block until every replica answers /health; ServerStartError (its cause and log) for one that exits."""
    deadline = time.time() + timeout_s
    pending = list(replicas)
    while pending:
        for r in list(pending):
            if r.process is not None and r.process.poll() is not None:
                cause = last_error_line(r.log_path.read_text(errors="replace")) if r.log_path else ""
                raise ServerStartError(f"vLLM server {r.name} exited ({r.process.returncode}) before it was healthy: "
                                       f"{cause or 'no error in its log'} (log: {r.log_path})")
            try:
                with urllib.request.urlopen(r.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        pending.remove(r)
                        if r.process is not None:
                            r.segments = frozenset(group_segments(r.process.pid))
            except OSError:
                pass
        if pending and time.time() > deadline:
            logs = ", ".join(str(r.log_path) for r in pending if r.log_path)
            raise ServerStartError(f"vLLM servers {[r.name for r in pending]} not healthy after {timeout_s:.0f}s"
                                   + (f" (logs: {logs})" if logs else ""))
        if pending:
            time.sleep(1.0)


# An exception line of a Python traceback, after vLLM's "(EngineCore pid=N) " process prefix and
# "ERROR 12-01 04:54:16 [core.py:1510] " logging header, or an argparse error ("api_server.py: error: ...").
_ERROR_LINE = re.compile(r"^(?:\([^)]*\) )?(?:ERROR \S+ \S+ \[[^\]]*\] )?"
                         r"((?:[\w.]*(?:Error|Exception)\b:|[\w.-]+: error:) .*)$")


def last_error_line(log: str) -> str:
    """The line of a server log that says why it stopped: the last exception or argparse error.

    vLLM's wrappers that only point elsewhere ("See root cause above", "See stack trace for root
    cause") are passed over; a pydantic
    validation error is given by its first message line, without pydantic's `[type=...]` suffix.
    With no such line, the log's last non-empty line.
    """
    lines = log.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _ERROR_LINE.match(lines[i])
        if not m or "root cause" in lines[i]:
            continue
        if re.search(r"\d+ validation errors? for ", lines[i]) and i + 1 < len(lines):
            return f"{m.group(1)}: {lines[i + 1].strip().split(' [type=')[0]}"
        return m.group(1)
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "")


def stop_process_group(proc: subprocess.Popen | None, timeout_s: float, kill_wait_s: float) -> None:
    """SIGTERM the process group started with `proc` (a server and its workers), SIGKILL it after
    `timeout_s`; nothing when it already ended."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(kill_wait_s)
    except ProcessLookupError:
        pass


def stop_replica(replica: Replica, timeout_s: float = 60.0) -> None:
    """Stop the server (if we started it) and remove the shared-memory segments it left, also
    when it was killed before this: vLLM's, and the routing capture's of every server that is gone
    (its marker is a plain file no process maps, which a killed server never unlinks)."""
    segments = set(replica.segments)
    if replica.process is not None and replica.process.poll() is None:
        segments |= group_segments(replica.process.pid)
    stop_process_group(replica.process, timeout_s, kill_wait_s=30)
    remove_unused(segments)
    sweep_dead_servers()


def served_model_name(replica: Replica) -> str:
    with urllib.request.urlopen(replica.base_url + "/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def post_json(url: str, body: dict | None = None, timeout_s: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: HTTP {exc.code}: {exc.read().decode()[:2000]}") from None
    return json.loads(raw) if raw.strip() else {}


TTFT = "vllm:time_to_first_token_seconds"


async def ttft_totals(session, replicas: list[Replica]) -> tuple[float, float] | None:
    """(sum of seconds, requests) of vLLM's time-to-first-token histogram over `replicas`, from their
    /metrics; None if one does not answer (a replica going down mid-step is not an error here)."""
    import aiohttp

    total, count = 0.0, 0.0
    for r in replicas:
        try:
            async with session.get(r.base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith(TTFT + "_sum"):
                total += float(value.rsplit(" ", 1)[-1])
            elif name.startswith(TTFT + "_count"):
                count += float(value.rsplit(" ", 1)[-1])
    return total, count
