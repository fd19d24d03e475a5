"""One layout's plan, and the search over layouts when none is given."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .comm import CommVolume, comm_volume
from .layout import AC_MODES, Layout, PlanError, Workload, check_layout
from .memory import MemoryBreakdown, memory_per_gpu
from .model import load_arch, param_counts
from .rates import Rates
from .step_time import StepTime, step_time


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: MemoryBreakdown
    comm: CommVolume
    time: StepTime

    def fits(self, work: Workload) -> bool:
        return self.memory.total <= work.gpu_bytes


def make_plan(layout: Layout, work: Workload, rates: Rates) -> Plan:
    """The plan of one layout (PlanError if the layout cannot run; fitting is checked apart)."""
    arch = load_arch(work.model)
    check_layout(layout, work, arch.num_experts)
    counts = param_counts(arch)
    comm = comm_volume(arch, counts, layout, work)
    return Plan(layout=layout, memory=memory_per_gpu(arch, counts, layout, work), comm=comm,
                time=step_time(arch, load_arch("glm5"), counts, layout, work, comm, rates))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(work: Workload, num_experts: int, *, cp: int | None = None, ep: int | None = None,
                      fsdp: int | None = None, fp8: bool | None = None, ac: str | None = None,
                      ac_modes: tuple[str, ...] = AC_MODES) -> list[Layout]:
    """Every layout that passes `check_layout`, with the given choices fixed (FSDP over all ranks a
    CP group leaves, unless `fsdp` is given; AC over `ac_modes` unless `ac` is given)."""
    out = []
    cps = [cp] if cp else [c for c in _divisors(work.trainer_gpus) if work.seq_len % c == 0]
    for c, e, f8, a in itertools.product(cps, [ep] if ep else _divisors(num_experts),
                                         [fp8] if fp8 is not None else [True, False], [ac] if ac else ac_modes):
        layout = Layout(cp=c, ep=e, fsdp=fsdp or work.trainer_gpus // c, fp8=f8, ac=a)
        try:
            check_layout(layout, work, num_experts)
        except PlanError:
            continue
        out.append(layout)
    return out


def search(work: Workload, rates: Rates, top: int = 5, **fixed) -> tuple[list[Plan], int]:
    """The `top` fastest plans that fit in memory, and how many layouts were tried."""
    layouts = candidate_layouts(work, load_arch(work.model).num_experts, **fixed)
    plans = [make_plan(layout, work, rates) for layout in layouts]
    fitting = sorted((p for p in plans if p.fits(work)), key=lambda p: p.time.total)
    return fitting[:top], len(layouts)
