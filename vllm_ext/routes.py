"""moerl's HTTP routes on a vLLM API server, beside vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``).

* ``POST /moerl/swap_weights``: the paused half of a sharded weight update (``weights.swap``).

The patch wraps vLLM's ``register_rl_api_routers``. (A prefill replica's hand-over to the KV pool
needs no route: vLLM's own ``--middleware`` option carries it, ``vllm_ext.prefill_handoff``.)
"""

from __future__ import annotations

import functools

import patches

__all__ = ["PATCHES"]


def with_moerl_routes(register_rl_api_routers):
    """vLLM's RL routes, and moerl's beside them."""
    from .weights import swap

    @functools.wraps(register_rl_api_routers)
    def register(app) -> None:
        register_rl_api_routers(app)
        app.include_router(swap.router())

    return register


PATCHES = (patches.wrapper_patch(
    "vllm_rl_routes_moerl", "vllm.entrypoints.rl.factories:register_rl_api_routers", with_moerl_routes,
    versions="vllm>=0.32,<0.33", params=["app"],
    upstream="vLLM 0.32.0 entrypoints/rl/factories.py register_rl_api_routers",
    symptom="POST /moerl/swap_weights answers 404: sharded weight updates cannot be applied"),)
