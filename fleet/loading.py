"""The dispatcher's side of on-demand models (nodes.on_demand): a generation whose model no node serves asks for a load
and waits in its model's queue meanwhile; a model whose generations wait too long asks for one more replica.

The decisions are the nodes app's (database, off the event loop); this module counts them (/metrics), logs them and
keeps on the process's Registry (`registry().loading`, fleet.loading_state) the waits of this process's placed
generations that the scale rule reads (p50 over the last FLEET_ON_DEMAND_SCALE_WINDOW_S seconds above
FLEET_ON_DEMAND_SCALE_WAIT_S) and where it last placed each model.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque

from channels.db import database_sync_to_async
from django.conf import settings

from fleet import metrics
from fleet.links import registry
from nodes import on_demand

log = logging.getLogger("fleet")

WAITS_KEPT = 256  # per model: enough samples for a p50 over the window at hundreds of generations a second
SCALE_EVERY_S = 5.0  # a model asks for another replica at most this often from one process

LOOK_AGAIN_S = 1.0


class NoRoom(Exception):
    """Raised to the dispatcher: the model is on demand and fits on no node (the message has the figures)."""


def changes_counted(changes: list[on_demand.Change]) -> None:
    for change in changes:
        metrics.on_demand_change(model=change.model, node=change.node, loaded=change.loaded, reason=change.reason)
        log.info("fleet on demand: %s %s on %r: %s", "loading" if change.loaded else "unloading", change.model,
                 change.node, change.why)


async def aload(model: str) -> on_demand.Decision | None:
    """Load `model` where it fits (None: it is not an on-demand model). NoRoom when no node can hold it.

    Every generation waiting for the load asks again at each wake (a lane freed anywhere wakes them all): within
    LOOK_AGAIN_S of an answer that a load is under way, they are told so without asking the database again."""
    state = registry().loading
    if time.monotonic() - state.loading_seen.get(model, -1e9) < LOOK_AGAIN_S:
        return on_demand.Decision()
    try:
        decision = await database_sync_to_async(on_demand.on_demand_place)(name=model, placed=dict(state.placed))
    except on_demand.NoRoom as exc:
        raise NoRoom(str(exc)) from None
    if decision is not None:
        state.loading_seen[model] = time.monotonic()
        changes_counted(decision.changes)
    return decision


def placed(node_id: str, model: str) -> None:
    """A generation of `model` was placed on the node: the least-recently-used choice reads it (a node's heartbeat
    may be a second older than this)."""
    registry().loading.placed[node_id, model] = time.time()


def waited(model: str, seconds: float) -> None:
    """A generation of `model` was placed after waiting `seconds` in its queue."""
    registry().loading.waits.setdefault(model, deque(maxlen=WAITS_KEPT)).append((time.monotonic(), seconds))


async def ascale(model: str, waiting_s: float) -> None:
    """A generation of `model` has waited `waiting_s` for a lane: one more replica when the p50 of the waits of the
    last window (this one's included) is past the setting; at most once each SCALE_EVERY_S from this process."""
    limit, state = settings.FLEET_ON_DEMAND_SCALE_WAIT_S, registry().loading
    now = time.monotonic()
    if waiting_s < limit or now - state.scaled_at.get(model, -1e9) < SCALE_EVERY_S:
        return
    recent = [s for at, s in state.waits.get(model, ()) if now - at <= settings.FLEET_ON_DEMAND_SCALE_WINDOW_S]
    if statistics.median([*recent, waiting_s]) < limit:
        return
    state.scaled_at[model] = now
    why = f"its generations waited {waiting_s:.1f} s for a lane (over {limit:g} s)"
    decision = await database_sync_to_async(on_demand.on_demand_scale)(name=model, why=why)
    if decision is not None:
        changes_counted(decision.changes)
