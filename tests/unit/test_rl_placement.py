"""Core placement of the trainer and the managed replicas (rl_loop.placement)."""

import pytest

from rl_loop.placement import parse_cpus, plan, replica_env, trainer_env


def test_parse_cpus():
    assert parse_cpus("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cpus("2, 1,2") == (2, 1)
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_auto_splits_the_machine_between_trainer_and_replicas():
    p = plan("auto", "auto", 2, available=(0, 1))
    assert p.trainer == (0,) and p.replicas == ((1,), (1,))  # one inference core: both replicas share it
    p = plan("auto", "auto", 2, available=tuple(range(8)))
    assert p.trainer == (0, 1, 2, 3) and p.replicas == ((4, 5), (6, 7))
    assert not set(p.trainer) & set(sum(p.replicas, ()))


def test_explicit_side_and_auto_side():
    p = plan("0", "auto", 1, available=(0, 1, 2))
    assert p.trainer == (0,) and p.replicas == ((1, 2),)
    p = plan("auto", "2", 1, available=(0, 1, 2))
    assert p.trainer == (0, 1) and p.replicas == ((2,),)


def test_no_pinning_and_single_core():
    assert plan("", "", 2, available=(0, 1)) is None
    assert plan("auto", "auto", 2, available=(0,)) is None
    # external endpoints (no managed replicas): the trainer may use every core
    assert plan("auto", "", 0, available=(0, 1)).trainer == (0, 1)


def test_unavailable_core_is_an_error():
    with pytest.raises(ValueError, match="not available"):
        plan("0", "7", 1, available=(0, 1))


def test_envs():
    assert trainer_env((0, 1, 2, 3), 2) == {"OMP_NUM_THREADS": "2"}
    assert replica_env((4, 5)) == {"VLLM_CPU_OMP_THREADS_BIND": "4,5"}
    assert replica_env((4, 5, 6, 7), 2) == {"VLLM_CPU_OMP_THREADS_BIND": "4,5|6,7"}, "a core set per TP worker"
    assert replica_env((1,), 2) == {"VLLM_CPU_OMP_THREADS_BIND": "1|1"}, "fewer cores than workers: shared"


def test_for_config_places_only_the_trainer_beside_external_endpoints():
    from rl_loop.config import RLConfig
    from rl_loop.placement import for_config

    cfg = RLConfig()
    cfg.inference.replicas, cfg.inference.endpoints = 0, ["http://10.0.0.5:8000"]
    p = for_config(cfg)
    assert p is not None and p.trainer == tuple(sorted(__import__("os").sched_getaffinity(0)))
