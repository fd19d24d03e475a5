"""The update protocol's driver (vllm_ext.transport.client): every step on all replicas at once, a failing
replica dropped alone on the sharded lanes, every paused replica resumed. FakeReplica stands in for a
vLLM server's dev-mode routes and the plugin's swap route (the real servers are in
tests/integration/test_weight_sync.py)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_ext.transport.client import SWAP_ROUTE, WeightSyncError, push_fs, push_sharded


class FakeReplica:
    """Records every request; `fail` maps a route to the HTTP status it answers; `meet` is a
    barrier every replica's request to `meet_at` waits at (it breaks, and the request fails,
    unless they all arrive together); a request to `hang` waits (a hung worker)."""

    def __init__(self, meet: threading.Barrier | None = None, fail: dict[str, int] | None = None,
                 hang: str | None = None, meet_at: str = "/pause"):
        self.calls: list[tuple[str, dict]] = []
        self.release = threading.Event()  # a hung request waits for it
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"{}")
                route = self.path.split("?")[0]
                fake.calls.append((route, body))
                status = (fail or {}).get(route, 200)
                if route == hang:
                    fake.release.wait(60)
                if route == meet_at and meet is not None:
                    try:
                        meet.wait(timeout=5)
                    except threading.BrokenBarrierError:
                        status = 500
                payload = json.dumps({} if status == 200 else {"error": {"message": f"{route} refused"}}).encode()
                self.send_response(status)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def routes(self) -> list[str]:
        return [r for r, _ in self.calls]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes(request):
    made: list[FakeReplica] = []

    def make(*args, **kw) -> FakeReplica:
        made.append(FakeReplica(*args, **kw))
        return made[-1]

    yield make
    for f in made:
        f.close()


FULL = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"]
# the sharded lanes move the bytes before the pause, while the replica serves; then the server
# pauses, applies, finishes and resumes in one request
SHARDED = ["/start_weight_update", "/update_weights", SWAP_ROUTE]


def test_every_replica_is_paused_at_once_and_updated(fakes, tmp_path):
    meet = threading.Barrier(3)
    reps = [fakes(meet, meet_at=SWAP_ROUTE) for _ in range(3)]
    res = push_sharded([r.url for r in reps], [[[{"rank": 0}]]] * 3, 7)
    assert res.version == 7
    for r in reps:
        assert r.routes() == SHARDED
        assert [r.calls[k][1]["update_info"]["phase"] for k in (1, 2)] == ["receive", "apply"]
        assert r.calls[1][1]["update_info"]["version"] == r.calls[2][1]["update_info"]["version"] == 7
        assert r.calls[2][1]["weight_version"] == "7"
    meet = threading.Barrier(2)
    reps = [fakes(meet) for _ in range(2)]
    push_fs([r.url for r in reps], tmp_path, 7)
    for r in reps:
        assert r.routes() == FULL and "phase" not in r.calls[2][1]["update_info"]
        assert r.calls[3][1] == {"weight_version": "7"}


def test_on_a_sharded_lane_a_failing_replica_drops_out_alone(fakes):
    reps = [fakes(), fakes(fail={"/start_weight_update": 500}), fakes(fail={"/update_weights": 500}),
            fakes(fail={SWAP_ROUTE: 500})]
    lost: list[tuple[int, str]] = []
    with pytest.raises(WeightSyncError, match="start_weight_update: HTTP 500") as err:
        push_sharded([r.url for r in reps], [[[{}]]] * 4, 8, lost=lambda i, why: lost.append((i, why)))
    assert f"{SWAP_ROUTE}: HTTP 500: {SWAP_ROUTE} refused" in str(err.value) and err.value.hung == []
    assert sorted(i for i, _ in lost) == [1, 2, 3]
    assert reps[0].routes() == SHARDED
    assert reps[1].routes() == ["/start_weight_update"], "refused before the pause: never paused"
    assert reps[2].routes() == ["/start_weight_update", "/update_weights"]
    assert reps[3].routes() == SHARDED


def test_on_the_filesystem_lane_a_replica_that_cannot_pause_stops_the_update_for_all(fakes, tmp_path):
    reps = [fakes(), fakes(fail={"/pause": 500})]
    with pytest.raises(WeightSyncError, match=r"pause\?mode=keep: HTTP 500: /pause refused"):
        push_fs([r.url for r in reps], tmp_path, 3)
    assert reps[0].routes() == ["/pause", "/start_weight_update", "/resume"]
    assert reps[1].routes() == ["/pause"]


def test_on_a_sharded_lane_a_replica_whose_swap_hangs_is_given_up_after_the_bound(fakes):
    reps = [fakes(), fakes(hang=SWAP_ROUTE)]
    lost: list[tuple[int, str]] = []
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="no answer within 1 s") as err:
        push_sharded([r.url for r in reps], [[[{}]]] * 2, 9, lost=lambda i, why: lost.append((i, why)),
                     answer_within_s=1.0)
    assert time.monotonic() - t0 < 30, "not the HTTP timeout of 600 s"
    assert err.value.hung == [1] and [i for i, _ in lost] == [1]
    assert reps[0].routes() == SHARDED, "the other replica updates"
    assert reps[1].routes() == SHARDED


def test_a_replica_that_hangs_before_the_pause_is_given_up_unpaused(fakes):
    reps = [fakes(), fakes(hang="/update_weights")]
    lost: list[tuple[int, str]] = []
    with pytest.raises(WeightSyncError, match="no answer within 1 s") as err:
        push_sharded([r.url for r in reps], [[[{}]]] * 2, 10, lost=lambda i, why: lost.append((i, why)),
                     answer_within_s=1.0)
    assert err.value.hung == [1] and [i for i, _ in lost] == [1]
    assert reps[0].routes() == SHARDED
    assert reps[1].routes() == SHARDED[:2], "never paused"
