"""One Mooncake store that pools KV (and its routing rows) across the managed vLLM replicas.

The orchestrator owns the ``mooncake_master`` process: it starts it before the
replicas and stops it after them. Each replica runs vLLM's Mooncake store
connector with moerl's routing extension (``vllm_ext.kv_pool``) and contributes
a global segment of ``segment_gib`` to the pool. Transfers are TCP; the
transfer engines find each other by P2P handshake, so the master needs no
HTTP metadata server. The master's RPC and metrics servers listen on ``host``
(loopback by default). Mooncake's client transfer engine itself listens on all
interfaces (its TCP transport has no bind-address option in 0.3.13).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .replicas import stop_process_group

__all__ = ["MooncakePool", "MooncakeMaster", "connector_args", "LEASE_TTL_MS"]

CONNECTOR = "MoerlMooncakeStoreConnector"
WORKER_EXTENSION = "vllm_ext.kv_pool.KvPoolWorkerExtension"
PREFILL_MIDDLEWARE = "vllm_ext.prefill_handoff.PrefillHandoff"
# An object read stays leased (not evicted) this long. Mooncake's default is
# seconds; prime-rl found blocks expiring before decode reused them and raised it
# to an hour.
LEASE_TTL_MS = 3_600_000


@dataclass(frozen=True)
class MooncakePool:
    """Where the master listens and how much memory each replica lends the pool."""

    host: str = "127.0.0.1"
    rpc_port: int = 18551
    metrics_port: int = 18552
    segment_gib: float = 0.25


def connector_args(pool: MooncakePool, config_path: Path, port: int,
                   role: str = "both") -> tuple[list[str], dict[str, str]]:
    """vLLM arguments and environment of the replica serving on `port` that pools its KV in `pool`;
    a `role` "prefill" replica answers once its KV is stored (`vllm_ext.prefill_handoff`).

    vLLM names the connector's scheduler-to-worker lookup socket by host and `lookup_rpc_port`
    (default 0), so replicas on one host bound the same IPC path: the last one started took it, and
    another replica's scheduler asked that replica's worker, whose routing store then got the rows
    (test_kv_pool, CI runs 20 and 23: a pooled prefix without its routing rows). Each replica's
    lookup socket is named by its own serving port."""
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": "vllm_ext.kv_pool", "kv_role": "kv_both",
          "kv_connector_extra_config": {"lookup_rpc_port": int(port)}}
    env = {"MOONCAKE_CONFIG_PATH": str(config_path), "VLLM_HOST_IP": pool.host}
    args = ["--kv-transfer-config", json.dumps(kv), "--worker-extension-cls", WORKER_EXTENSION]
    return args + (["--middleware", PREFILL_MIDDLEWARE] if role == "prefill" else []), env


class MooncakeMaster:
    """A ``mooncake_master`` subprocess and the client config its replicas read."""

    def __init__(self, pool: MooncakePool, work_dir: Path) -> None:
        self.pool = pool
        self.work_dir = work_dir
        self.process: subprocess.Popen | None = None
        self.config_path = work_dir / "mooncake.json"
        self.log_path = work_dir / "mooncake_master.log"

    def command(self) -> list[str]:
        p = self.pool
        return [sys.executable, "-m", "mooncake.cli", f"-rpc_address={p.host}", f"-rpc_port={p.rpc_port}",
                f"-metrics_host={p.host}", f"-metrics_port={p.metrics_port}", "-enable_http_metadata_server=false",
                f"-default_kv_lease_ttl={LEASE_TTL_MS}"]

    def write_client_config(self) -> Path:
        p = self.pool
        size = f"{int(p.segment_gib * 1024)}MB"
        self.config_path.write_text(json.dumps({
            "metadata_server": "P2PHANDSHAKE", "master_server_address": f"{p.host}:{p.rpc_port}",
            "protocol": "tcp", "device_name": "", "global_segment_size": size, "local_buffer_size": size}))
        return self.config_path

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the master and wait until its metrics server answers (it starts last)."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.write_client_config()
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.time() + timeout_s
        while True:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:]
                raise RuntimeError(f"mooncake_master exited ({self.process.returncode}) at start: "
                                   f"{tail[0] if tail else 'no output'} (log: {self.log_path})")
            try:
                self.metrics()
                return
            except OSError:
                if time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"mooncake_master did not answer on {self.pool.host}:{self.pool.metrics_port} "
                                       f"within {timeout_s:.0f}s (log: {self.log_path})") from None
                time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """The master's own Prometheus samples (``master_key_count``, ...)."""
        url = f"http://{self.pool.host}:{self.pool.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.partition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def completed_puts(self) -> float:
        """Objects whose put the master has seen completed (single and batch puts, failures
        excluded); ``master_key_count`` also counts objects still being written."""
        m = self.metrics()
        return (m.get("master_put_end_requests_total", 0) - m.get("master_put_end_failures_total", 0)
                + m.get("master_batch_put_end_items_total", 0) - m.get("master_batch_put_end_failed_items_total", 0))

    def stop(self, timeout_s: float = 20.0) -> None:
        stop_process_group(self.process, timeout_s, kill_wait_s=10)
