"""Control channel of the streaming transport: the sender's TCPStore plus gloo
groups between the sender (rank 0) and its receivers, kept across updates.

Why keep them: here a gloo group costs 1-2 ms to build and 10-20 ms to destroy
(measured), and a gloo round trip 0.3-0.7 ms, while the shared-memory lane
moves 100 MB in about 8 ms; groups built per update cost a small update more
than its bytes. So each update starts with a handshake through the store (a
few 50 us round trips) instead of new groups:

1. the sender puts the manifest under ``{session}/manifest``;
2. every receiver puts ``{"gen": generation of the groups it holds or -1, "lane": ..., "ask": {...}}``
   under ``{session}/r{rank}`` and reads ``{session}/gen`` (``ask``: what the receiver wants
   the sender to know for this update, e.g. that it takes a sharded update in one pass);
3. the sender reads every report, keeps its groups if every receiver holds
   the same generation, else builds the next generation (a receiver restarted,
   a side dropped its groups after a failure, or this is the first update), and
   puts ``{"gen": ..., "lanes": [lane per rank]}`` under ``{session}/gen``;
   everyone holding another generation then builds that one together.

A side that sees a gloo operation fail drops its groups (``drop()``); the next
update rebuilds them everywhere. Step 3 may wait long (a replica joins when its
driver gets to it), so the sender can poll ``gone()`` meanwhile: whoever drives the
replicas knows first that one died or refused, and the sender stops waiting for it
then instead of at the store's timeout. Network-lane groups are built per set of
network receivers and kept likewise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from .format import ReceiverLost

__all__ = ["Groups", "SenderChannel", "ReceiverChannel", "CONNECT_TIMEOUT_S"]

# The longest sleep between two looks for a receiver's report: half of it is, on average, added to
# the update once the receiver has joined (its pause already started), and one look (a store round
# trip, 50-100 us) costs the waiting sender 1-2% of a core. (`store.wait` with a short timeout would
# wake at once, but c10d logs two warnings on every timeout.)
_POLL_MAX_S = 0.005
# A sender's store listens before its join info is handed out, so a receiver that cannot connect
# within this long will not (the sender died, or its host is unreachable), instead of retrying
# for the whole operation timeout.
CONNECT_TIMEOUT_S = 5.0


@dataclass
class Groups:
    """One generation of gloo groups: ``ctl`` carries the trailer, ``done`` the closing
    barrier (apart, so that each side can keep one of them posted for the whole data
    phase, see ``shm.py``), ``net`` the network lane's groups per set of network ranks."""

    gen: int
    ctl: object
    done: object
    net: dict[tuple, list] = field(default_factory=dict)


class _Channel:
    def __init__(self, store, rank: int, world_size: int, timeout_s: float):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.groups: Groups | None = None

    def _group(self, rank: int, size: int, prefix: str):
        import torch.distributed as dist

        return dist.ProcessGroupGloo(dist.PrefixStore(f"moerl-weights/{prefix}", self.store), rank, size,
                                     timedelta(seconds=self.timeout_s))

    def _build(self, gen: int) -> None:
        self.groups = None  # destroy the old generation first (its connections are dead or unused)
        self.groups = Groups(gen, self._group(self.rank, self.world_size, f"g{gen}/ctl"),
                             self._group(self.rank, self.world_size, f"g{gen}/done"))

    def net(self, net_ranks: list[int], streams: int, kind: str = "net") -> list:
        """``streams`` groups among the sender and ``net_ranks``, for a lane (``kind``: the
        network lane's broadcasts, or the TE lane's descriptors and acknowledgements)."""
        key = (kind, *net_ranks)
        if key not in self.groups.net:
            sub = 0 if self.rank == 0 else 1 + net_ranks.index(self.rank)
            tag = "-".join(map(str, net_ranks))
            self.groups.net[key] = [self._group(sub, 1 + len(net_ranks), f"g{self.groups.gen}/{kind}{i}/{tag}")
                                    for i in range(streams)]
        return self.groups.net[key]

    def drop(self) -> None:
        """Forget the groups after a failure; the next update rebuilds them everywhere."""
        self.groups = None


class SenderChannel(_Channel):
    def __init__(self, addr: str, port: int, world_size: int, timeout_s: float):
        import torch.distributed as dist

        store = dist.TCPStore(addr, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        super().__init__(store, 0, world_size, timeout_s)
        self.port = store.port
        self._gen = 0
        self.asks: list[dict] = []  # per rank, what its receiver asked for in the last handshake

    def open(self, session: str, manifest: bytes, gone: Callable[[], str | None] | None = None,
             join_timeout_s: float | None = None) -> list[int]:
        """The update's handshake (sender side): every rank's lane (0 for the sender). Waits for
        each receiver's report until ``gone()`` gives a reason it will not come or
        ``join_timeout_s`` (default: the store's timeout) passes: ``ReceiverLost``."""
        self.store.set(f"{session}/manifest", manifest)
        reports = [json.loads(self._report(f"{session}/r{r}", r, gone, join_timeout_s))
                   for r in range(1, self.world_size)]
        held = {rep["gen"] for rep in reports}
        rebuild = self.groups is None or held != {self.groups.gen}
        if rebuild:
            self._gen += 1
        lanes = [0] + [int(rep["lane"]) for rep in reports]
        self.asks = [{}] + [rep.get("ask") or {} for rep in reports]
        self.store.set(f"{session}/gen", json.dumps({"gen": self._gen, "lanes": lanes}))
        if rebuild:
            self._build(self._gen)
        return lanes

    def _report(self, key: str, rank: int, gone: Callable[[], str | None] | None, limit: float | None) -> bytes:
        if gone is None and limit is None:
            return self.store.get(key)
        limit = self.timeout_s if limit is None else limit
        deadline, pause = time.monotonic() + limit, 0.001
        who = "the receiver" if self.world_size == 2 else f"receiver rank {rank}"
        while not self.store.check([key]):
            if gone is not None and (why := gone()):
                raise ReceiverLost(f"{who} will not join: {why}")
            if time.monotonic() > deadline:
                raise ReceiverLost(f"{who} did not join within {limit:.0f} s")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)
        return self.store.get(key)

    def forget(self, session: str) -> None:
        """Delete the update's keys (every receiver has read them once the update closed)."""
        for key in ["manifest", "gen", *(f"r{r}" for r in range(1, self.world_size))]:
            self.store.delete_key(f"{session}/{key}")


class ReceiverChannel(_Channel):
    def __init__(self, addr: str, port: int, rank: int, world_size: int, timeout_s: float):
        import torch.distributed as dist

        store = dist.TCPStore(addr, port, world_size, is_master=False,
                              timeout=timedelta(seconds=min(timeout_s, CONNECT_TIMEOUT_S)))
        store.set_timeout(timedelta(seconds=timeout_s))
        super().__init__(store, rank, world_size, timeout_s)

    def open(self, session: str, lane: int, ask: dict | None = None) -> tuple[list[int], bytes]:
        """The update's handshake (receiver side): (every rank's lane, manifest bytes)."""
        held = self.groups.gen if self.groups is not None else -1
        self.store.set(f"{session}/r{self.rank}", json.dumps({"gen": held, "lane": lane, "ask": ask or {}}))
        got = json.loads(self.store.get(f"{session}/gen"))
        if got["gen"] != held:
            self._build(got["gen"])
        return [int(x) for x in got["lanes"]], self.store.get(f"{session}/manifest")
