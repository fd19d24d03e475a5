"""router_ext.config: the EndpointPickerConfig and endpoints file it writes."""

from __future__ import annotations

import json

import pytest
import yaml

from router_ext import config
from router_ext.scorer import ScorerParams


def test_parse_endpoints_names_ports_and_resolution():
    eps = config.parse_endpoints(["a=127.0.0.1:8001,localhost:8002", "10.0.0.3:9000"])
    assert [(e.name, e.address, e.port) for e in eps] == [
        ("a", "127.0.0.1", 8001), ("vllm-1", "127.0.0.1", 8002), ("vllm-2", "10.0.0.3", 9000)]
    for bad in (["127.0.0.1"], ["127.0.0.1:0"], ["x=1.2.3.4:1,x=1.2.3.4:2"], [""]):
        with pytest.raises(ValueError):
            config.parse_endpoints(bad)


def test_main_writes_yaml_llm_d_can_read(tmp_path):
    params = {"weights": {"prefix": 4.0}, "loadFactor": 1.5}
    rc = config.main(["--endpoints", "r0=127.0.0.1:18001,r1=127.0.0.1:18002", "--out", str(tmp_path),
                      "--scorer-params", json.dumps(params), "--block-size-tokens", "32"])
    assert rc == 0
    eps = yaml.safe_load((tmp_path / "endpoints.yaml").read_text())
    assert eps == {"endpoints": [
        {"name": "r0", "address": "127.0.0.1", "port": "18001", "labels": {"llm-d.ai/engine-type": "vllm"}},
        {"name": "r1", "address": "127.0.0.1", "port": "18002", "labels": {"llm-d.ai/engine-type": "vllm"}}]}
    cfg = yaml.safe_load((tmp_path / "epp-config.yaml").read_text())
    assert cfg["apiVersion"] == "llm-d.ai/v1alpha1" and cfg["kind"] == "EndpointPickerConfig"
    plugins = {p["name"]: p for p in cfg["plugins"]}
    assert plugins["file-discovery"]["parameters"]["path"] == str((tmp_path / "endpoints.yaml").resolve())
    assert cfg["dataLayer"]["discovery"]["pluginRef"] == "file-discovery"
    scorer = plugins["rl-scorer"]
    assert scorer["type"] == "moerl-rl-scorer"
    extra = {"prefixMatchInfoProducerName", "policyVersionAttribute", "updatingAttribute", "affinityHeaders"}
    got = ScorerParams.from_plugin_parameters({k: v for k, v in scorer["parameters"].items() if k not in extra})
    assert got == ScorerParams(w_prefix=4.0, load_factor=1.5)
    assert plugins[scorer["parameters"]["prefixMatchInfoProducerName"]]["type"] == "approx-prefix-cache-producer"
    assert plugins["prefix-producer"]["parameters"]["blockSizeTokens"] == 32
    # every pluginRef resolves, and the profile filters paused replicas before scoring
    refs = [p["pluginRef"] for prof in cfg["schedulingProfiles"] for p in prof["plugins"]]
    assert all(r in plugins for r in refs)
    assert [plugins[r]["type"] for r in refs] == ["moerl-paused-filter", "moerl-rl-scorer", "max-score-picker"]
    custom = plugins["metrics-extractor"]["parameters"]["engineConfigs"][0]["customMetrics"]
    attrs = {c["attributeKey"]: c["metricSpec"] for c in custom}
    assert attrs[scorer["parameters"]["policyVersionAttribute"]] == "moerl:policy_version"
    assert attrs[plugins["paused-filter"]["parameters"]["updatingAttribute"]] == "moerl:weight_update_in_progress"


def test_to_yaml_round_trips_awkward_scalars():
    doc = {"a": ["on", "8000", 1.5, True, None, {"b": {}}], "c": {"d": [], "e": "x: y"}}
    assert yaml.safe_load(config.to_yaml(doc)) == doc


def test_kv_events_feed_llm_d_precise_prefix_producer_to_moerls_scorer(tmp_path, capsys):
    rc = config.main(["--endpoints", "r0=127.0.0.1:18001,r1=127.0.0.1:18002", "--out", str(tmp_path),
                      "--kv-events", "tcp://127.0.0.1:5557", "--model", "/m/tiny"])
    assert rc == 0
    cfg = yaml.safe_load((tmp_path / "epp-config.yaml").read_text())
    plugins = {p["name"]: p for p in cfg["plugins"]}
    assert "approx-prefix-cache-producer" not in {p["type"] for p in cfg["plugins"]}
    producer = plugins["precise-prefix"]
    assert producer["type"] == "precise-prefix-cache-producer"
    assert producer["parameters"]["kvEventsConfig"] == {"zmqEndpoint": "tcp://127.0.0.1:5557", "topicFilter": "kv@",
                                                        "discoverPods": False}
    assert producer["parameters"]["tokenProcessorConfig"] == {"blockSizeTokens": 32}
    profile = {p["pluginRef"]: p.get("weight") for p in cfg["schedulingProfiles"][0]["plugins"]}
    # moerl's scorer alone reads the match (over the prompt's complete blocks), at the formula's prefix weight
    assert profile == {"paused-filter": None, "rl-scorer": 1, "picker": None}
    assert plugins["rl-scorer"]["parameters"]["prefixMatchInfoProducerName"] == "precise-prefix"
    assert plugins["rl-scorer"]["parameters"]["weights"]["prefix"] == ScorerParams().w_prefix
    assert "prefix-cache-scorer" not in {p["type"] for p in cfg["plugins"]}
    out = capsys.readouterr().out
    assert "--allow-experimental-plugins" in out and "--enable-pprof=false" in out
    topic = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557",
             "topic": "kv@127.0.0.1:18002@/m/tiny"}
    assert f"replica r1: vllm ... --kv-events-config '{json.dumps(topic)}'" in out
    with pytest.raises(SystemExit):
        config.main(["--endpoints", "r0=127.0.0.1:1", "--out", str(tmp_path), "--kv-events", "tcp://127.0.0.1:5557"])


def test_llmd_default_profile_has_llm_ds_three_scorers_and_no_moerl_plugin(tmp_path):
    cfg_path, _ = config.write(config.parse_endpoints(["r0=127.0.0.1:18001"]), tmp_path, llmd_default=True)
    cfg = yaml.safe_load(cfg_path.read_text())
    types = {p["name"]: p["type"] for p in cfg["plugins"]}
    assert not any(t.startswith("moerl-") for t in types.values())
    profile = {p["pluginRef"]: p.get("weight") for p in cfg["schedulingProfiles"][0]["plugins"]}
    assert profile == {"queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 3, "picker": None}
    assert types["prefix-producer"] == "approx-prefix-cache-producer"


def test_prefill_endpoints_give_llm_d_its_prefill_and_decode_profiles(tmp_path, capsys):
    rc = config.main(["--endpoints", "d0=127.0.0.1:18001", "--prefill-endpoints", "p0=127.0.0.1:18002",
                      "--pd-non-cached-tokens", "96", "--out", str(tmp_path)])
    assert rc == 0
    eps = yaml.safe_load((tmp_path / "endpoints.yaml").read_text())["endpoints"]
    assert {e["name"]: e["labels"]["llm-d.ai/role"] for e in eps} == {"d0": "decode", "p0": "prefill"}
    cfg = yaml.safe_load((tmp_path / "epp-config.yaml").read_text())
    plugins = {p["name"]: p for p in cfg["plugins"]}
    handler = next(p for p in cfg["plugins"] if p["type"].endswith("profile-handler"))
    assert handler["type"] == "disagg-profile-handler"
    decider = plugins[handler["parameters"]["deciders"]["prefill"]]
    assert decider == {"name": "pd-decider", "type": "prefix-based-pd-decider", "parameters": {"nonCachedTokens": 96}}
    profiles = {p["name"]: [plugins[r["pluginRef"]]["type"] for r in p["plugins"]] for p in cfg["schedulingProfiles"]}
    assert set(profiles) == set(handler["parameters"]["profiles"].values()) == {"decode", "prefill"}
    # each role's filter first, then moerl's filter and scorer, then the picker
    assert profiles["decode"] == ["decode-filter", "moerl-paused-filter", "moerl-rl-scorer", "max-score-picker"]
    assert profiles["prefill"] == ["prefill-filter", "moerl-paused-filter", "moerl-rl-scorer", "max-score-picker"]
    # without prefill endpoints: no roles and llm-d's single profile, as before
    config.main(["--endpoints", "r0=127.0.0.1:18001", "--out", str(tmp_path / "plain")])
    assert "llm-d.ai/role" not in (tmp_path / "plain" / "endpoints.yaml").read_text()
    with pytest.raises(SystemExit):
        config.main(["--endpoints", "x=127.0.0.1:18001", "--prefill-endpoints", "x=127.0.0.1:18002", "--out",
                     str(tmp_path / "dup")])
    assert "duplicate endpoint names: ['x', 'x']" in capsys.readouterr().err
    # unnamed endpoints are named by role, so decode and prefill ones never collide
    assert [e.name for e in config.parse_endpoints(["127.0.0.1:1", "127.0.0.1:2"], "prefill")] == ["prefill-0",
                                                                                                  "prefill-1"]
