"""titan_ext.teardown on a 2-rank gloo job: no gloo worker thread outlives the teardown.

A thread left running is where the abort at interpreter exit happens (teardown.py's
docstring): a worker that still holds a finished collective's tensors takes the GIL during
finalization. The job holds its device mesh the way a Trainer does (in an object graph with
a reference cycle, garbage once the function that used it returned). The control:
plain `destroy_process_group()` leaves the mesh's groups and their threads alive (that job then
exits without finalization, as teardown.py's scripts do, since the abort is not what it measures).
Each teardown runs in a torchrun job of its own: a second `init_process_group` in the same
processes would reuse the first one's store keys (it hung once in a clean-clone CI run).
"""

import re
import textwrap

from tests.conftest import run_torchrun

WORKER = textwrap.dedent('''
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from titan_ext.teardown import destroy_process_group_together, exit_without_finalizing

    def threads():
        return len(os.listdir("/proc/self/task"))

    def work():
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
        mesh.cycle = mesh
        parts = [torch.empty(4) for _ in range(2)]
        dist.all_gather(parts, torch.ones(4), group=mesh.get_group("b"))

    teardown = {"plain": dist.destroy_process_group, "together": destroy_process_group_together}[sys.argv[1]]
    counts = [threads()]
    dist.init_process_group("gloo")
    work()
    counts.append(threads())
    teardown()
    counts.append(threads())
    print("threads " + " ".join(map(str, counts)), flush=True)  # one write: both ranks share the pipe
    if sys.argv[1] == "plain":
        exit_without_finalizing()
''')


def test_no_gloo_thread_outlives_the_teardown(tmp_path):
    script = tmp_path / "teardown_worker.py"
    script.write_text(WORKER)
    counts = {}
    for teardown in ("plain", "together"):
        r = run_torchrun(2, str(script), teardown, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]  # no abort at exit
        counts[teardown] = [tuple(map(int, m.split())) for m in re.findall(r"threads ([\d ]+)", r.stdout)]
        assert len(counts[teardown]) == 2, r.stdout[-2000:]
    for before, running, after in counts["plain"]:
        assert running > before  # the groups' worker threads
        assert after > before  # the control: plain destroy leaves them running
    for before, running, after in counts["together"]:
        assert running > before
        assert after == before, counts
