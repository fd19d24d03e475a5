"""titan_ext.teardown on a 2-rank gloo job: no gloo worker thread outlives the teardown.

A thread left running is where the abort at interpreter exit happens (teardown.py's
docstring): a worker that still holds a finished collective's tensors takes the GIL during
finalization. The job holds its device mesh the way a Trainer does (in an object graph with
a reference cycle, garbage once the function that used it returned). The control, in the
same processes first: plain `destroy_process_group()` leaves the mesh's groups and their
threads alive.
"""

import re
import textwrap

from tests.conftest import ROOT, run_torchrun

WORKER = textwrap.dedent('''
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from torch.distributed.device_mesh import init_device_mesh
    from titan_ext.teardown import destroy_process_group_together

    def threads():
        return len(os.listdir("/proc/self/task"))

    def work():
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
        mesh.cycle = mesh
        parts = [torch.empty(4) for _ in range(2)]
        dist.all_gather(parts, torch.ones(4), group=mesh.get_group("b"))

    counts = [threads()]
    for teardown in (dist.destroy_process_group, destroy_process_group_together):
        dist.init_process_group("gloo")
        work()
        counts.append(threads())
        teardown()
        counts.append(threads())
    print("threads", *counts, flush=True)
''')


def test_no_gloo_thread_outlives_the_teardown(tmp_path):
    script = tmp_path / "teardown_worker.py"
    script.write_text(WORKER)
    r = run_torchrun(2, str(script), str(ROOT), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]  # no abort at exit
    counts = [tuple(map(int, m.split())) for m in re.findall(r"threads ([\d ]+)", r.stdout)]
    assert len(counts) == 2, r.stdout[-2000:]
    for before, running, after_plain, running_again, after_together in counts:
        assert running > before  # the groups' worker threads
        assert after_plain > before  # the control: plain destroy leaves them running
        assert running_again > before
        assert after_together == before, counts
