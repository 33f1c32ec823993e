"""The waiting room's order: which generation waiting for a lane of a model takes the next one that frees up.

Classes first: `high`, `normal`, `low` (an API key's priority, or a lower one its request asked for), then batch
lines. Within a class the keys take turns (start-time fair queueing, each generation costing one): a key's waiting
generations hold virtual start slots 1/weight apart, from where its last placed one ended; a key that starts waiting
starts at the class's virtual clock (the start slot of the last generation placed), so a key with one generation
waiting gets the next free lane or the one after however many another key has waiting, a key gathers no credit
while it waits for nothing, and a key of weight 3 gets three lanes for each of a weight-1 key's. Within a key,
deadline order. FLEET_WAITING_ORDER=deadline keeps the order from before fair shares (classes, then deadline
alone): bench/fairness.py measures both.

The order is per head process (as the waiting room is): with several processes each orders its own waiters, and a
lane freed anywhere wakes every process's first waiters (fleet.links.LaneSignal), so the shares hold within a
process, not across processes.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PRIORITIES = ("high", "normal", "low")  # best first; an API key's field and a request's `priority`
DEFAULT_PRIORITY = "normal"
BATCH = "batch"  # batch lines: below every interactive class
RANKS = {**{name: rank for rank, name in enumerate(PRIORITIES)}, BATCH: len(PRIORITIES)}
CLASSES = (*PRIORITIES, BATCH)


@dataclass(frozen=True)
class Share:
    """What the waiting room knows of a generation's key: who it is, its class, weight and bound on waiting."""

    key: str = ""  # the API key's id ("" for the playground's staff session): fairness is between these
    label: str = ""  # how metrics and the live page name the key (its prefix: shown, not secret)
    priority: str = DEFAULT_PRIORITY
    weight: int = 1
    max_waiting: int = 0  # this key's generations waiting here at most (0: unbounded)


@dataclass(frozen=True)
class Waiter:
    """One generation waiting for a lane of a model."""

    gen_id: str
    rank: int  # RANKS of its class: 0 (high) goes first
    deadline: float
    key: str = ""
    weight: int = 1
    label: str = field(default="", compare=False)

    @property
    def priority(self) -> str:
        return CLASSES[self.rank]


class ModelQueue:
    """The waiters of one model in the order lanes go to them. The order is rebuilt (a sort) after each change
    and read many times between changes: every waiter woken reads its place."""

    def __init__(self, fair: bool = True) -> None:
        self.fair = fair
        self._by_key: dict[tuple[int, str], list[tuple[float, str, Waiter]]] = {}  # deadline order within a key
        self._finish: dict[tuple[int, str], float] = {}  # per class and key: where its last placed slot ended
        self._clock: dict[int, float] = {}  # per class: the start slot of the last generation placed
        self._order: list[Waiter] | None = None
        self._index: dict[Waiter, int] = {}

    def __len__(self) -> int:
        return sum(len(waiting) for waiting in self._by_key.values())

    def add(self, w: Waiter) -> None:
        flow = (w.rank, w.key)
        waiting = self._by_key.setdefault(flow, [])
        if not waiting:  # the key starts waiting: its slots start at the class's clock, not where it left off
            self._finish[flow] = max(self._clock.get(w.rank, 0.0), self._finish.get(flow, 0.0))
        bisect.insort(waiting, (w.deadline, w.gen_id, w))
        self._order = None

    def remove(self, w: Waiter, *, placed: bool = False) -> None:
        """`placed`: it took a lane (its key's next slot is used, the class's clock moves on); else it left
        unserved (expired, cancelled, refused) and its key keeps its slots."""
        flow = (w.rank, w.key)
        waiting = self._by_key.get(flow, [])
        at = bisect.bisect_left(waiting, (w.deadline, w.gen_id, w))
        if at >= len(waiting) or waiting[at][2] != w:
            return
        if placed:
            slot = self._finish[flow] + at * _step(w)
            self._finish[flow] += _step(w)
            self._clock[w.rank] = max(self._clock.get(w.rank, 0.0), slot)
        del waiting[at]
        if not waiting:
            del self._by_key[flow]
            if self._finish.get(flow, 0.0) <= self._clock.get(w.rank, 0.0):
                self._finish.pop(flow, None)  # nothing to remember: it would start at the clock anyway
        self._order = None

    def ahead(self, w: Waiter) -> int:
        """How many waiters go before `w` (it must be waiting)."""
        self._sorted()
        return self._index[w]

    def first(self, n: int) -> list[Waiter]:
        return self._sorted()[:n]

    def above(self, rank: int) -> int:
        """How many waiters are of a class better than `rank`'s."""
        return sum(len(waiting) for (r, _), waiting in self._by_key.items() if r < rank)

    def _sorted(self) -> list[Waiter]:
        if self._order is None:
            rows = []
            for flow, waiting in self._by_key.items():
                base = self._finish[flow]
                for at, (deadline, gen_id, w) in enumerate(waiting):
                    slot = base + at * _step(w) if self.fair else 0.0
                    rows.append((w.rank, slot, deadline, gen_id, w))
            rows.sort(key=lambda row: row[:4])
            self._order = [row[4] for row in rows]
            self._index = {w: at for at, w in enumerate(self._order)}
        return self._order


def _step(w: Waiter) -> float:
    """The virtual time one generation of its key takes: a key of weight 2 moves half as fast (twice the turns)."""
    return 1 / max(w.weight, 1)


DRAIN_WINDOW_S = 60  # the rate at which waiting generations took lanes is measured over this many seconds


class WaitingRoom:
    """Who waits in this process, for the counts (the live page, /metrics, /api/status, a key's bound), and when
    waiting generations took a lane (the drain rate a Retry-After is told from). The order and the waking are the
    registry's LaneSignal (fleet.links); one WaitingRoom a process, on its registry."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.entries: list[tuple[str, Waiter]] = []  # (model, waiter), in arrival order
        self._drained: dict[str, list[float]] = {}
        self._clock = clock

    def join(self, model: str, waiter: Waiter) -> tuple[str, Waiter]:
        entry = (model, waiter)
        self.entries.append(entry)
        return entry

    def leave(self, entry: tuple[str, Waiter], *, placed: bool) -> None:
        self.entries.remove(entry)
        if placed:
            times = self._drained.setdefault(entry[0], [])
            times.append(self._clock())
            del times[:-4096]

    def __len__(self) -> int:
        return len(self.entries)

    def of_key(self, key: str) -> int:
        """This key's interactive generations waiting here, every model's."""
        return sum(1 for _, w in self.entries if w.key == key and w.rank != RANKS[BATCH])

    def by_model(self) -> dict[str, int]:
        """This process's generations waiting for a lane, per model (the live fleet page sums every process's)."""
        counts: dict[str, int] = {}
        for model, _ in self.entries:
            counts[model] = counts.get(model, 0) + 1
        return counts

    def by_class(self) -> dict[str, dict[str, int]]:
        """This process's waiting generations per priority class and per API key (by its prefix)."""
        counts: dict[str, dict[str, int]] = {"priority": {}, "key": {}}
        for _, w in self.entries:
            counts["priority"][w.priority] = counts["priority"].get(w.priority, 0) + 1
            if w.label:
                counts["key"][w.label] = counts["key"].get(w.label, 0) + 1
        return counts

    def retry_after_s(self, model: str, ahead: int) -> int:
        """Seconds until the lanes, at the rate they took this process's waiting generations of `model` over the
        last DRAIN_WINDOW_S, would have served `ahead` more (DRAIN_WINDOW_S when they took fewer than two)."""
        now = self._clock()
        times = [t for t in self._drained.get(model, ()) if now - t <= DRAIN_WINDOW_S]
        self._drained[model] = times
        if len(times) < 2:
            return DRAIN_WINDOW_S
        rate = len(times) / max(now - times[0], 1e-3)
        return min(max(math.ceil((ahead + 1) / rate), 1), 10 * DRAIN_WINDOW_S)
