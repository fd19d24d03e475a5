"""Why a response carries no routing record: one of a few reasons, never silence.

Capture and hand-off fail in the worker (no room in /dev/shm, a step whose
MoE layers did not all report) or in the API server (a malformed segment, a
record that does not encode); the request still completes, so its caller must
be told. The API server gives every such choice ``routed_experts: null`` and
``routed_experts_error: "<reason>: <detail>"``, and counts the reason in
``moerl:routing_missing_total{reason=...}`` (``vllm_ext.metrics``). The reasons
are a fixed set, so the counter's label set is bounded; ``moerl rl`` counts its
rejected samples by the same reason (``rl_loop.batch``).
"""

from __future__ import annotations

__all__ = ["CAPTURE_OFF", "SHM_FULL", "NO_SEGMENT", "ROWS_MISSING", "BAD_SEGMENT", "ENCODE_FAILED", "REASONS",
           "RoutingMissing"]

CAPTURE_OFF = "capture_off"  # capture could not be attached to this MoE model (an unsupported kernel, say)
SHM_FULL = "shm_full"  # the worker could not reserve the request's rows in /dev/shm
NO_SEGMENT = "no_segment"  # the request's segment does not exist: never created, or reaped unread
ROWS_MISSING = "rows_missing"  # some positions have no rows: a step's capture failed or did not fit
BAD_SEGMENT = "bad_segment"  # the segment is not a moerl rows segment of the expected size
ENCODE_FAILED = "encode_failed"  # the rows do not make a routing record for this model
REASONS = (CAPTURE_OFF, SHM_FULL, NO_SEGMENT, ROWS_MISSING, BAD_SEGMENT, ENCODE_FAILED)


class RoutingMissing(RuntimeError):
    """A request's routing cannot be returned; `reason` is one of REASONS, the message says what happened."""

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown routing-missing reason {reason!r} (one of {REASONS})")
        super().__init__(detail)
        self.reason = reason

    @property
    def field(self) -> str:
        """The response's ``routed_experts_error``: the reason first, so clients can split it off."""
        return f"{self.reason}: {self}"
