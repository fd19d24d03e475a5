"""`moerl rl`'s weight lane choice (rl_loop.weight_lane): fastest that works, with the reason."""

from __future__ import annotations

import json

import pytest

from rl_loop.weight_lane import choose_lane, read_infos, sync_dir


@pytest.mark.parametrize("local,fp8,shm_problem,lane,why", [
    (True, False, None, "shm", "on this host"),
    (False, False, None, "net", "endpoints"),
    (True, False, "/dev/shm is not writable", "net", "no shared memory"),
    (True, True, None, "fs", "block-fp8"),
])
def test_auto_picks_the_fastest_lane_that_works(local, fp8, shm_problem, lane, why):
    got = choose_lane("auto", local_replicas=local, block_fp8=fp8, shm_problem=shm_problem)
    assert got.lane == lane and why in got.why


def test_a_requested_lane_that_cannot_work_is_one_clear_error():
    with pytest.raises(ValueError, match="block-fp8: use 'fs'"):
        choose_lane("shm", local_replicas=True, block_fp8=True, shm_problem=None)
    with pytest.raises(ValueError, match="cannot work here"):
        choose_lane("shm", local_replicas=True, block_fp8=False, shm_problem="no /dev/shm")
    assert choose_lane("fs", local_replicas=True, block_fp8=True, shm_problem=None).lane == "fs"


def test_infos_are_read_once_every_rank_offered(tmp_path):
    d = sync_dir(tmp_path, 3)
    d.mkdir(parents=True)
    for r in range(2):
        (d / f"rank{r}.json").write_text(json.dumps([{"rank": r}]))
    assert read_infos(tmp_path, 3, 2) == [[{"rank": 0}], [{"rank": 1}]]
    with pytest.raises(TimeoutError, match="did not offer weights v4"):
        read_infos(tmp_path, 4, 2, timeout_s=0.05)
