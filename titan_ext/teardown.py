"""Ending a gloo job without an abort at interpreter exit.

On torch 2.13 a finished gloo collective is released by its process group's worker thread
after the caller has been woken, and releasing tensors that Python also holds takes the GIL.
A process group, and its worker threads, live as long as something refers to it (a
Trainer's device meshes do), so they may still be running when the interpreter finalizes:
a worker that takes the GIL then is ended by Python inside a `noexcept` destructor
(`~AsyncAllgatherWork`, or `~AsyncBarrierWork`, which holds the works queued before it), and
that is `std::terminate`: "terminate called without an active exception", SIGABRT, no Python
frame, after all work was done. A rank that goes straight from its last collective to exit
hits it (rank 1 typically, while rank 0 still saves results or sleeps the 2 s TorchTitan's
`Trainer.train` gives it). A barrier before `destroy_process_group` narrows the window but
does not close it: the barrier's own work holds the collective before it.

What closes it: destroy the groups together, then free them while the interpreter is alive.
A process group's destructor releases the GIL, lets its workers finish and joins them; it
runs once the last reference goes, so the objects that hold groups (the Trainer, its model
and meshes) must be gone first: call this after the function that used them has returned.
Some groups of a TorchTitan Trainer stay referenced after that (2 of a tiny GLM-5 EP=2 run's
keep their threads), so a script that used a Trainer ends with `exit_without_finalizing`:
no finalization, nothing for a worker thread to die in.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

import torch.distributed as dist

import patches

_destroy = dist.destroy_process_group  # torch's own


def destroy_process_group_together() -> None:
    """Barrier, `destroy_process_group()`, then collect the garbage that still holds process
    groups (joining their worker threads now, not during interpreter finalization). Nothing
    when no group is initialized."""
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    _destroy()
    gc.collect()


def exit_without_finalizing(code: int = 0) -> NoReturn:
    """End the process now, after flushing what finalization would (logging handlers, stdio).
    For the end of a script's `__main__` once its work and teardown are done, not for libraries."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_together: list[bool] = []  # non-empty inside `together_on_destroy`


def destroy_together_inside_block(stock):
    """`torch.distributed.destroy_process_group`, which inside `together_on_destroy` (and called
    without a group) is `destroy_process_group_together()`; torch's own everywhere else."""

    @functools.wraps(stock)
    def destroy_process_group(group=None):
        if group is None and _together:
            destroy_process_group_together()
        else:
            stock(group)

    return destroy_process_group


DESTROY_TOGETHER = patches.wrapper_patch(
    "torch_destroy_process_group_together", "torch.distributed:destroy_process_group", destroy_together_inside_block,
    versions="torch>=2.11,<2.14", params=["group"],
    upstream="torchtitan 0.3.0 train.main on torch 2.13 gloo (destroys the groups while workers still run)",
    symptom="a finished gloo job aborts at exit: 'terminate called without an active exception' (SIGABRT)",
)
PATCHES = (DESTROY_TOGETHER,)


@contextlib.contextmanager
def together_on_destroy() -> Iterator[None]:
    """Within the block, `torch.distributed.destroy_process_group()` (no arguments) is
    `destroy_process_group_together()`: for code we run but do not own (TorchTitan's
    `train.main`, whose Trainer is garbage by the time it destroys the groups)."""
    patches.activate([DESTROY_TOGETHER])
    _together.append(True)
    try:
        yield
    finally:
        _together.pop()
