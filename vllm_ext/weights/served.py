"""The policy version of the weights this worker process's model holds, and who is told when it changes.

The API server knows a replica's version from ``/finish_weight_update`` (``api.py``),
but state that lives in the worker process and depends on the weights (the KV
pool's key namespace, ``vllm_ext.kv_pool``) must follow the weights themselves:
``engine.py`` calls ``applied`` right after an update is in the model, before the
replica resumes. A replica starts on ``MOERL_POLICY_VERSION`` (0 by default).
"""

from __future__ import annotations

from collections.abc import Callable

from ..metrics import initial_version

__all__ = ["version", "applied", "subscribe"]

_version = initial_version()
_listeners: list[Callable[[int], None]] = []


def version() -> int:
    return _version


def subscribe(listener: Callable[[int], None]) -> None:
    """Call ``listener(version)`` after every applied update (in the thread that applied it)."""
    _listeners.append(listener)


def applied(new_version: int) -> None:
    global _version
    _version = int(new_version)
    for listener in _listeners:
        listener(_version)
