"""moerl's RL metrics on vLLM's ``/metrics`` (API-server process; prometheus_client only).

Each metric is exported under two names, the vLLM-style ``moerl:<name>`` (read by
router_ext's ``EndpointPickerConfig``: ``router_ext.config.POLICY_VERSION_METRIC``
/ ``UPDATING_METRIC``) and the plain ``moerl_<name>``. Gauges:

* ``moerl:policy_version`` / ``moerl_policy_version``: the policy version now
  serving (an integer; ``MOERL_POLICY_VERSION`` at start, default 0);
* ``moerl:weight_update_in_progress`` / ``moerl_weight_update_in_progress``: 1
  while the replica is paused or inside a weight update (a router sends it
  nothing), else 0.

Counters (counts that only go up; Prometheus appends ``_total``):

* ``moerl:weight_update_failures_total`` / ``moerl_weight_update_failures_total``:
  failed updates (the previous weights kept serving each time);
* ``moerl:routing_missing_total{reason}`` / ``moerl_routing_missing_total{reason}``:
  responses whose routing is missing, by reason (``vllm_ext.routing.missing``;
  every reason is exported from the start, at 0);
* ``moerl:patches_skipped_total{patch}`` / ``moerl_patches_skipped_total{patch}``:
  optional upstream patches this process skipped because upstream changed under
  them (``patches.activate``); each is also named in responses
  (``vllm_ext.serving.SKIPPED_FIELD``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

POLICY_VERSION = ("moerl:policy_version", "moerl_policy_version")
UPDATE_IN_PROGRESS = ("moerl:weight_update_in_progress", "moerl_weight_update_in_progress")
UPDATE_FAILURES = ("moerl:weight_update_failures", "moerl_weight_update_failures")
ROUTING_MISSING = ("moerl:routing_missing", "moerl_routing_missing")
PATCHES_SKIPPED = ("moerl:patches_skipped", "moerl_patches_skipped")

__all__ = ["POLICY_VERSION", "UPDATE_IN_PROGRESS", "UPDATE_FAILURES", "ROUTING_MISSING", "WeightState", "state",
           "RoutingMissingCounter", "routing_missing", "PatchesSkippedCounter", "patches_skipped", "initial_version",
           "version_number"]


def _registered(kind, names: tuple[str, ...], doc: str, registry=None, **kw) -> list:
    """One metric of `kind` under each name; reused when this registry already has it (plugin loaded twice)."""
    from prometheus_client import REGISTRY

    reg = registry or REGISTRY
    out = []
    for n in names:
        try:
            out.append(kind(n, doc, registry=reg, **kw))
        except ValueError:
            out.append(reg._names_to_collectors[n])  # noqa: SLF001
    return out


def initial_version() -> int:
    return int(os.environ.get("MOERL_POLICY_VERSION", "0"))


def version_number(label: str | int | None) -> int | str | None:
    """vLLM's weight-version label -> our integer policy version ("default" is the start version)."""
    if label is None:
        return None
    if isinstance(label, int):
        return label
    if label == "default":
        return initial_version()
    try:
        return int(label)
    except ValueError:
        return label


class WeightState:
    """Policy version and update state of this replica, mirrored to Prometheus gauges and a counter."""

    def __init__(self, registry=None) -> None:
        self._lock = threading.Lock()
        self.version = initial_version()
        self.paused = False
        self.updating = False
        self.failures = 0
        self.last_error: str | None = None
        self._gauges: list = []
        self._failure_counters: list = []
        self._registry = registry
        self._made = False

    def _make(self) -> None:
        if self._made:
            return
        self._made = True
        from prometheus_client import Counter, Gauge

        docs = {
            POLICY_VERSION: "Policy version of the weights now serving",
            UPDATE_IN_PROGRESS: "1 while paused or inside a weight update, else 0",
        }
        for names, doc in docs.items():
            self._gauges.append((names, _registered(Gauge, names, doc, self._registry, multiprocess_mode="mostrecent")))
        self._failure_counters = _registered(Counter, UPDATE_FAILURES,
                                             "Weight updates that failed (previous weights kept serving)",
                                             self._registry)
        for c in self._failure_counters:
            c.inc(self.failures)
        self._publish()

    def _publish(self) -> None:
        values = {
            POLICY_VERSION: self.version if isinstance(self.version, int) else -1,
            UPDATE_IN_PROGRESS: int(self.paused or self.updating),
        }
        for names, gs in self._gauges:
            for g in gs:
                g.set(values[names])

    def install(self) -> None:
        with self._lock:
            self._make()

    def set(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, v)
            if self._made:
                self._publish()

    def fail(self, msg: str) -> None:
        with self._lock:
            self.failures += 1
            self.updating = False
            self.last_error = msg
            for c in self._failure_counters:
                c.inc()
            if self._made:
                self._publish()

    def snapshot(self) -> dict:
        with self._lock:
            return {"policy_version": self.version, "paused": self.paused, "updating": self.updating,
                    "failures": self.failures, "last_error": self.last_error}


state = WeightState()


class RoutingMissingCounter:
    """``moerl:routing_missing_total{reason}``: responses that carry no routing record, by reason."""

    def __init__(self, registry=None) -> None:
        self._registry = registry
        self._counters: list = []
        self._lock = threading.Lock()

    def install(self, reasons: Iterable[str]) -> None:
        """Register the counter with every reason at 0 (a scrape shows the label set before any failure)."""
        with self._lock:
            if self._counters:
                return
            from prometheus_client import Counter

            self._counters = _registered(Counter, ROUTING_MISSING, "Responses whose routing record is missing, "
                                         "by reason", self._registry, labelnames=("reason",))
            for c in self._counters:
                for r in reasons:
                    c.labels(reason=r)

    def inc(self, reason: str) -> None:
        for c in self._counters:
            c.labels(reason=reason).inc()


routing_missing = RoutingMissingCounter()


class PatchesSkippedCounter:
    """``moerl:patches_skipped_total{patch}``: optional patches skipped (`patches.on_skip` calls `inc`)."""

    def __init__(self, registry=None) -> None:
        self._registry = registry
        self._counters: list = []
        self._lock = threading.Lock()

    def inc(self, patch, why: str = "") -> None:
        with self._lock:
            if not self._counters:
                from prometheus_client import Counter

                self._counters = _registered(Counter, PATCHES_SKIPPED, "Optional upstream patches skipped: "
                                             "upstream changed under them", self._registry, labelnames=("patch",))
        for c in self._counters:
            c.labels(patch=patch.name).inc()


patches_skipped = PatchesSkippedCounter()
