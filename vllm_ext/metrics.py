"""moerl's RL gauges on vLLM's ``/metrics`` (API-server process; prometheus_client only).

Each gauge is exported under two names, the vLLM-style ``moerl:<name>`` (read by
router_ext's ``EndpointPickerConfig``: ``router_ext.config.POLICY_VERSION_METRIC``
/ ``UPDATING_METRIC``) and the plain ``moerl_<name>``:

* ``moerl:policy_version`` / ``moerl_policy_version``: the policy version now
  serving (an integer; ``MOERL_POLICY_VERSION`` at start, default 0);
* ``moerl:weight_update_in_progress`` / ``moerl_weight_update_in_progress``: 1
  while the replica is paused or inside a weight update (a router sends it
  nothing), else 0;
* ``moerl:weight_update_failures`` / ``moerl_weight_update_failures``: count of
  failed updates (the previous weights kept serving each time).
"""

from __future__ import annotations

import os
import threading

POLICY_VERSION = ("moerl:policy_version", "moerl_policy_version")
UPDATE_IN_PROGRESS = ("moerl:weight_update_in_progress", "moerl_weight_update_in_progress")
UPDATE_FAILURES = ("moerl:weight_update_failures", "moerl_weight_update_failures")

__all__ = ["POLICY_VERSION", "UPDATE_IN_PROGRESS", "UPDATE_FAILURES", "WeightState", "state", "initial_version",
           "version_number"]


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
    """Policy version and update state of this replica, mirrored to Prometheus gauges."""

    def __init__(self, registry=None) -> None:
        self._lock = threading.Lock()
        self.version = initial_version()
        self.paused = False
        self.updating = False
        self.failures = 0
        self.last_error: str | None = None
        self._gauges: list = []
        self._registry = registry
        self._made = False

    def _make(self) -> None:
        if self._made:
            return
        self._made = True
        from prometheus_client import REGISTRY, Gauge

        reg = self._registry or REGISTRY
        docs = {
            POLICY_VERSION: "Policy version of the weights now serving",
            UPDATE_IN_PROGRESS: "1 while paused or inside a weight update, else 0",
            UPDATE_FAILURES: "Weight updates that failed (previous weights kept serving)",
        }
        for names, doc in docs.items():
            gs = []
            for n in names:
                try:
                    gs.append(Gauge(n, doc, registry=reg, multiprocess_mode="mostrecent"))
                except ValueError:  # already registered in this registry (plugin loaded twice)
                    gs.append(reg._names_to_collectors[n])  # noqa: SLF001
            self._gauges.append((names, gs))
        self._publish()

    def _publish(self) -> None:
        values = {
            POLICY_VERSION: self.version if isinstance(self.version, int) else -1,
            UPDATE_IN_PROGRESS: int(self.paused or self.updating),
            UPDATE_FAILURES: self.failures,
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
            if self._made:
                self._publish()

    def snapshot(self) -> dict:
        with self._lock:
            return {"policy_version": self.version, "paused": self.paused, "updating": self.updating,
                    "failures": self.failures, "last_error": self.last_error}


state = WeightState()
