"""The generations this head process runs: how many per model and class, and which one a waiting one may preempt.

Pure (no I/O), owned by the process's registry (`registry().running`). A generation is counted from its first
placement to its end (`count`), so batch lines keep to their share of a model's lanes while interactive ones run or
wait; while it runs on a node it is a `Holder` of a lane (`hold` / `release`), what `victim` chooses from:

- a batch line, for any interactive generation; where FLEET_PREEMPTING_CLASSES names the waiting one's class, an
  interactive one of a lower class too: the lowest class first, then the one placed last;
- else, where FLEET_SHARE_PREEMPTING_CLASSES names its class, one of its own class whose key is over its share: a key
  whose lanes, one fewer, would still be at least the waiting key's, one more, per unit of weight (so a key gives up
  a lane only to one it then holds no fewer than, and never takes it back); the key most over first.

A preempted generation continues later from the tokens it has, token for token as if never stopped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fleet.waiting import Waiter

HIGHER_CLASS = "a generation of a higher class"
UNDER_SHARE = "a generation of a key under its share"


@dataclass(eq=False)
class Holder:
    """A generation of this process running on a node: what the choice of a victim reads of it."""

    waiter: Waiter  # its class, key and weight
    batch: bool
    node_id: str
    placed_at: float
    stream: Any = field(default=None, repr=False)  # the generation itself, handed back to be preempted
    preempting: bool = False  # its lane was taken; its cancel is on the way
    preempted_at: float = 0.0
    preempted_by: str = ""  # who took it, in the record's words


class Running:
    def __init__(self) -> None:
        self._counts: Counter[tuple[str, bool]] = Counter()
        self._holders: dict[str, set[Holder]] = {}

    def count(self, model: str, batch: bool, delta: int) -> None:
        self._counts[(model, batch)] += delta

    def counted(self, model: str, batch: bool) -> int:
        return self._counts[(model, batch)]

    def hold(self, model: str, holder: Holder) -> None:
        self._holders.setdefault(model, set()).add(holder)

    def release(self, model: str, holder: Holder) -> None:
        self._holders.get(model, set()).discard(holder)

    def victim(self, model: str, me: Waiter, *, exclude: set[str], over_interactive: bool,
               share_preempting: bool) -> tuple[Holder, str] | None:
        """The holder whose lane `me` (interactive, finding none free) takes, with how the record names the taker;
        None when no rule gives it one. Holders on the nodes of `exclude` are never chosen."""
        running = [h for h in self._holders.get(model, ()) if not h.preempting]
        victims = [h for h in running if h.node_id not in exclude
                   and (h.batch or (over_interactive and h.waiter.rank > me.rank))]
        if victims:
            return max(victims, key=lambda h: (h.waiter.rank, h.placed_at)), HIGHER_CLASS
        if not share_preempting:
            return None
        mine = [h for h in running if not h.batch and h.waiter.rank == me.rank]
        held = Counter(h.waiter.key for h in mine)
        after = (held[me.key] + 1) / me.weight
        over = [h for h in mine if h.node_id not in exclude and h.waiter.key != me.key
                and (held[h.waiter.key] - 1) / h.waiter.weight >= after]
        chosen = max(over, default=None, key=lambda h: (held[h.waiter.key] / h.waiter.weight, h.placed_at))
        return (chosen, UNDER_SHARE) if chosen is not None else None
