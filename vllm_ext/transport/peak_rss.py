"""Peak resident memory of this process over a stretch of work (Linux ``/proc``).

The sharded update promises bounded memory on the replica; this is how the worker
(``vllm_ext.weights.engine``) and the test that holds it to the bound (``test_weights_sharded``)
measure it: reset the kernel's high-water mark, do the work, read the mark.
Counts everything resident, shared-memory ring pages included.
"""

from __future__ import annotations

from pathlib import Path


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def reset() -> int:
    """Reset this process's peak-RSS mark; the resident bytes now."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_kb("VmRSS") * 1024


def peak() -> int:
    """The peak resident bytes since the last ``reset()``."""
    return _status_kb("VmHWM") * 1024
