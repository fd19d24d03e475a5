"""`moerl rl`'s weight lane choice (rl_loop.weight_lane): the requested lane or one clear error; auto = the
fastest that works (shm for managed replicas, else fs) and why."""

from __future__ import annotations

import json

import pytest

from rl_loop.weight_lane import choose_lane, read_infos, sync_dir


def test_auto_is_shm_for_managed_replicas_on_this_host():
    got = choose_lane("auto", block_fp8=False, shm_problem=None)
    assert got.lane == "shm" and "measured faster" in got.why


@pytest.mark.parametrize("fp8,shm_problem,managed,why", [
    (True, None, True, "block-fp8"),
    (False, "/dev/shm is not writable", True, "/dev/shm is not writable"),
    (False, None, False, "external replicas"),
])
def test_auto_falls_back_to_the_filesystem_lane_with_the_reason(fp8, shm_problem, managed, why):
    got = choose_lane("auto", block_fp8=fp8, shm_problem=shm_problem, managed=managed)
    assert got.lane == "fs" and why in got.why


def test_a_requested_lane_that_can_work_is_taken():
    assert choose_lane("shm", block_fp8=False, shm_problem=None).lane == "shm"
    assert choose_lane("net", block_fp8=False, shm_problem="no /dev/shm").lane == "net"


def test_a_requested_lane_that_cannot_work_is_one_clear_error():
    with pytest.raises(ValueError, match="block-fp8: use 'fs'"):
        choose_lane("shm", block_fp8=True, shm_problem=None)
    with pytest.raises(ValueError, match="cannot work here"):
        choose_lane("shm", block_fp8=False, shm_problem="no /dev/shm")
    assert choose_lane("fs", block_fp8=True, shm_problem=None).lane == "fs"


def test_infos_are_read_once_every_rank_offered(tmp_path):
    d = sync_dir(tmp_path, 3)
    d.mkdir(parents=True)
    for r in range(2):
        (d / f"rank{r}.json").write_text(json.dumps([{"rank": r}]))
    assert read_infos(tmp_path, 3, 2) == [[{"rank": 0}], [{"rank": 1}]]
    with pytest.raises(TimeoutError, match="did not offer weights v4"):
        read_infos(tmp_path, 4, 2, timeout_s=0.05)
