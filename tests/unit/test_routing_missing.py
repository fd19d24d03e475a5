"""Lost routing is said, not silent: the fault hook, the reasons, the response fields and the counters."""

from __future__ import annotations

import errno
import glob
import os
import secrets
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from vllm_ext import api, metrics
from vllm_ext.routing import handoff
from vllm_ext.routing.missing import CAPTURE_OFF, ENCODE_FAILED, REASONS, SHM_FULL, RoutingMissing
from vllm_ext.routing.store import RoutingStore


@pytest.fixture
def counter(monkeypatch):
    """The API's routing-missing counter on a registry of its own; returns a reader of its samples."""
    reg = CollectorRegistry()
    c = metrics.RoutingMissingCounter(registry=reg)
    c.install(REASONS)
    monkeypatch.setattr(api, "routing_missing", c)
    return lambda name, reason: reg.get_sample_value(name, {"reason": reason})


def test_fault_spec_is_checked_at_load():
    assert handoff._fault_every("") == 0 and handoff._fault_every("shm_full:3") == 3
    for bad in ("shm_full", "shm_full:0", "shm_full:x", "disk_full:2"):
        with pytest.raises(ValueError, match="MOERL_ROUTING_FAULT"):
            handoff._fault_every(bad)


def test_injected_fault_fails_every_nth_reservation_like_a_full_shm(monkeypatch):
    token = f"{os.getpid():x}{secrets.token_hex(4)}"
    store = RoutingStore(2, 3, np.uint8, 4, token)
    monkeypatch.setattr(handoff, "_FAULT_EVERY", 2)
    monkeypatch.setattr(handoff, "_reserved", 0)
    failed = []
    try:
        for rid in "abcd":
            try:
                store.open(rid, 0, 8)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC and "injected by MOERL_ROUTING_FAULT" in str(exc)
                failed.append(rid)
        assert failed == ["b", "d"]
        with pytest.raises(RoutingMissing) as exc:
            handoff.read_rows(token, "b", 4)
        assert exc.value.reason == SHM_FULL
        store.write("a", 0, np.ones((4, 2, 3), np.uint8))
        assert handoff.read_rows(token, "a", 4)[1].shape == (4, 2, 3)
    finally:
        store.reaper.unlink_all()
    assert not glob.glob(f"{handoff.SHM_DIR}/moerl-r3-{token}-*")


def test_capture_off_reason_reaches_the_api_server():
    token = f"{os.getpid():x}{secrets.token_hex(4)}"
    assert handoff.capture_off_reason(token) is None
    handoff.capture_failed(token, "routing capture is off on this server: fused monolithic kernels")
    try:
        assert handoff.capture_off_reason(token) == "routing capture is off on this server: fused monolithic kernels"
        assert not handoff.capture_on(token)
    finally:
        handoff.unlink(f"moerl-r3-{token}-capture-off")


def test_unknown_reason_is_refused():
    with pytest.raises(ValueError, match="unknown routing-missing reason"):
        RoutingMissing("oops", "x")


def test_missing_routing_becomes_the_choice_field_and_a_count(counter):
    out = SimpleNamespace(index=0, routed_experts=None, finish_reason="length")
    api.mark_missing(out, RoutingMissing(SHM_FULL, "request r: no room"))
    api.mark_missing(SimpleNamespace(routed_experts=None), RoutingMissing(CAPTURE_OFF, "off"))
    assert out.routed_experts is None and out.routed_experts_error == "shm_full: request r: no room"
    # streaming n > 1: a sample that finishes before its siblings comes in a result not finished yet
    running = SimpleNamespace(index=1, routed_experts=None, finish_reason=None)
    res = SimpleNamespace(finished=False, prompt_token_ids=[1, 2], outputs=[out, running])
    assert api.encode_request_output(res, None, None) == {0: {"routed_experts_error": "shm_full: request r: no room"}}
    for name in ("moerl:routing_missing_total", "moerl_routing_missing_total"):
        assert counter(name, SHM_FULL) == 1 and counter(name, CAPTURE_OFF) == 1
        assert all(counter(name, r) == 0 for r in REASONS if r not in (SHM_FULL, CAPTURE_OFF))

    # rows that do not make a record for this model: encode_failed, not a silent null
    cfg = SimpleNamespace(num_hidden_layers=2, mlp_only_layers=[], decoder_sparse_step=1, num_experts=4)
    bad = SimpleNamespace(index=1, routed_experts=np.full((3, 2, 2), 7, np.uint8), finish_reason="stop")
    fields = api.encode_request_output(SimpleNamespace(finished=True, prompt_token_ids=[1, 2], outputs=[bad]),
                                        None, cfg)
    assert fields[1]["routed_experts_error"].startswith("encode_failed: cannot encode the routing record: expert id")
    assert bad.routed_experts is None and counter("moerl:routing_missing_total", ENCODE_FAILED) == 1

    # the non-streaming response: the error field only on the choice that lost its routing
    good = SimpleNamespace(index=2, routed_experts=None)
    choices = [SimpleNamespace(), SimpleNamespace(), SimpleNamespace()]
    api.annotate_errors(choices, [out, bad, good])
    assert choices[0].routed_experts_error.startswith("shm_full") and not hasattr(choices[2], "routed_experts_error")


def test_weight_update_failures_is_a_counter():
    reg = CollectorRegistry()
    st = metrics.WeightState(registry=reg)
    st.fail("before the plugin installed its metrics")
    st.install()
    st.fail("checksum mismatch")
    st.set(version=3)
    for name in ("moerl:weight_update_failures_total", "moerl_weight_update_failures_total"):
        assert reg.get_sample_value(name) == 2
    assert reg.get_sample_value("moerl:policy_version") == 3 and st.snapshot()["failures"] == 2
