"""vLLM 0.32: a failed collective RPC leaves the other workers' answers queued (TP > 1).

`MultiprocExecutor.collective_rpc` reads the workers' answers in rank order and
raises at the first error answer, so the answers of the workers after it stay in
their response queues. The next call on that replica then reads those stale
answers as its own: after a weight update that failed on both workers of a TP=2
replica, the next `/pause` failed with the previous update's error, and every
later call was one answer behind on worker 1 (the replica never took another
update; senders waited for it until their timeout).

The patch keeps upstream's RPC (same request, same answers, same error text) and
only changes when it raises: every worker's answer to the call is read first.
That is smaller and holds for every RPC, unlike the alternative of making moerl's
weight-update RPC never raise inside a worker: vLLM's worker code around it
(`update_weights` resets its "update active" flag only when the engine raises) and
the API route (which reports failure only on an exception) would both need
changes to carry a structured error back, and any other RPC that fails on one
worker would still desync the queues.

`needed()` imports vLLM's executor only in a process that already runs vLLM, and
decides by behaviour: it runs the unpatched `collective_rpc` on a stand-in
executor of two workers whose first answers with an error (`leaves_answers_unread`),
so an upstream fix turns the patch off by itself. The vllm_ext plugin applies it in
every vLLM process (`register()`), before the engine builds its executor.
"""

from __future__ import annotations

import functools
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from . import Patch, probe_target

_MOD = "vllm.v1.executor.multiproc_executor"
_MARK = "_moerl_reads_every_answer"
_PARAMS = ["self", "method", "timeout", "args", "kwargs", "non_block", "unique_reply_rank",
           "kv_output_aggregator", "ec_output_aggregator"]


class FakeAnswerQueue:
    """A worker's response queue holding given answers (for the probe and the unit test)."""

    def __init__(self, answers: list[tuple[Any, Any]]) -> None:
        self.answers = deque(answers)

    def dequeue(self, timeout: float | None = None) -> tuple[Any, Any]:
        if not self.answers:
            raise TimeoutError("no answer queued")
        return self.answers.popleft()

    def enqueue(self, obj: Any) -> None:
        pass


def fake_executor(answers: Sequence[list[tuple[Any, Any]]]) -> SimpleNamespace:
    """A stand-in `MultiprocExecutor` whose worker i has `answers[i]` queued."""
    return SimpleNamespace(rpc_broadcast_mq=FakeAnswerQueue([]), response_mqs=[FakeAnswerQueue(a) for a in answers],
                           futures_queue=deque(), is_failed=False)


def _executor_module():
    import importlib

    return importlib.import_module(_MOD)


def leaves_answers_unread(collective_rpc: Callable | None = None) -> bool:
    """True when `collective_rpc` (default: the executor's current one) raises at worker 0's
    error answer with worker 1's answer to the same call still queued."""
    m = _executor_module()
    status = m.WorkerProc.ResponseStatus
    ex = fake_executor([[(status.FAILURE, "probe")], [(status.SUCCESS, None)]])
    try:
        (collective_rpc or m.MultiprocExecutor.collective_rpc)(ex, "probe")
    except RuntimeError:
        pass
    else:
        raise AssertionError("vLLM changed MultiprocExecutor.collective_rpc: a worker's error answer did not raise")
    return bool(ex.response_mqs[1].answers)


def read_every_answer(mqs: Sequence[Any], deadline: float | None, method: Any, success: Any) -> list[Any]:
    """Every worker's answer to one call, then upstream's error for the failed ones, if any."""
    answers, errors = [], []
    for mq in mqs:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            status, result = mq.dequeue(timeout=wait)
        except TimeoutError as e:
            raise TimeoutError(f"RPC call to {method} timed out.") from e
        if status != success:
            errors.append(str(result))
        answers.append(result)
    if errors:
        raise RuntimeError(f"Worker failed with error '{'; '.join(dict.fromkeys(errors))}', please check the"
                           " stack trace above for the root cause")
    return answers


def _needed() -> bool:
    if "vllm" not in sys.modules:
        return False  # not a vLLM process: no executor here
    m = _executor_module()
    if getattr(m.MultiprocExecutor.collective_rpc, _MARK, False):
        return False
    return leaves_answers_unread()


def _apply() -> None:
    m = _executor_module()
    cls = m.MultiprocExecutor
    orig = cls.collective_rpc
    if getattr(orig, _MARK, False):
        return
    success = m.WorkerProc.ResponseStatus.SUCCESS

    @functools.wraps(orig)
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, unique_reply_rank=None,
                       kv_output_aggregator=None, ec_output_aggregator=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        future = orig(self, method, timeout, args, kwargs, True, unique_reply_rank, kv_output_aggregator,
                      ec_output_aggregator)
        if unique_reply_rank is None or kv_output_aggregator is not None or ec_output_aggregator is not None:
            # every worker answers this call (upstream's output_rank is None)
            future.get_response = functools.partial(read_every_answer, list(self.response_mqs), deadline, method,
                                                    success)
        return future if non_block else future.result()

    setattr(collective_rpc, _MARK, True)
    cls.collective_rpc = collective_rpc


PATCH = Patch(
    name="vllm_executor_reads_every_answer",
    target=f"{_MOD}:MultiprocExecutor.collective_rpc",
    versions="vllm>=0.32,<0.33",
    upstream="vLLM 0.32.0 (v1/executor/multiproc_executor.py MultiprocExecutor.collective_rpc)",
    symptom="TP > 1: after an RPC fails on one worker (a refused weight update), the later workers' answers stay "
            "queued and every following call on that replica reads the previous call's answer",
    probe=probe_target(f"{_MOD}:MultiprocExecutor.collective_rpc", _PARAMS),
    needed=_needed,
    apply=_apply,
)
PATCHES = (PATCH,)
