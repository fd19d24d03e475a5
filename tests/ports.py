"""Free TCP ports for the servers the tests start (vLLM replicas, the Mooncake master, the llm-d EPP).

Every server a test starts listens on a port asked for here, never on a product default, so two
test sessions, both xdist workers and a `make run` beside them never collide.

Ports come from below the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`):
a port from `bind(("", 0))` lies inside it, where any outgoing connection may take it in the
moment between our check and the server's own bind. Below the range only a listener takes a
port; each candidate is checked by binding it, and this process never hands out a port twice
(the server it went to may not have bound it yet). Two processes (xdist workers) pick from
random points of the range, so a collision between them needs the same pick within the same
second or so: unlikely, and it shows as a server that fails to bind, not as a wrong result.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000
_handed_out: set[int] = set()
_pick = random.SystemRandom()  # not the global generator, which a test may seed


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int = 1) -> int:
    """The first of `n` consecutive free ports (`moerl rl` serves replica i on `inference.base_port` + i)."""
    top = max(_ephemeral_start(), LOWEST + 1000) - n
    for _ in range(200):
        base = _pick.randrange(LOWEST, top)
        ports = range(base, base + n)
        if not _handed_out.intersection(ports) and all(_bindable(p) for p in ports):
            _handed_out.update(ports)
            return base
    raise RuntimeError(f"no {n} consecutive free TCP ports in {LOWEST}-{top + n} after 200 tries; "
                       "is something holding most of the range?")


def free_port() -> int:
    """One free port."""
    return free_ports(1)
