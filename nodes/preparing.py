"""Nodes on their way in: what a node pulling or loading its own model before it joins last said (`preparing` on
the link), for the live fleet page. In the cache (Redis with REDIS_URL, so every head process sees it), one map for
the fleet, each entry forgotten when its node registers or after PREPARING_STALE_S without a word."""

from __future__ import annotations

import math
import time

from django.core.cache import cache

from fleet.live import fleet_changed
from nodes import services
from nodes.link.codes import ModelPhase
from nodes.link.messages import LinkError, Preparing

PREPARING_KEY = "fleet:nodes-preparing"
PREPARING_STALE_S = 30.0
STATES = (ModelPhase.PULLING, ModelPhase.LOADING)


def _problem(msg: Preparing) -> str | None:
    if not (0 < len(msg.identity) <= 200 and 0 < len(msg.model) <= 200) or "\x00" in msg.identity + msg.model:
        return "identity and model must be names of 1 to 200 characters with no NUL character"
    if msg.state not in STATES:
        return f"state {msg.state[:20]!r} is none of {', '.join(STATES)}"
    return None if math.isfinite(msg.progress) else "progress must be a number from 0 to 1"


async def on_preparing(msg: Preparing, *, node_key: str, address: str) -> None:
    """Keep where the node stands (its key checked as a Check's is: no one shows under another node's name) and tell
    the live page; its link session closes the link then."""
    from channels.db import database_sync_to_async

    if problem := _problem(msg):
        raise LinkError(f"preparing: {problem}")
    await database_sync_to_async(services.node_key_check)(identity=msg.identity, public_key=node_key)
    entry = {"model": msg.model, "state": msg.state, "progress": max(0.0, min(msg.progress, 1.0)),
             "address": address, "at": time.time()}
    await _update(lambda entries: {**entries, msg.identity: entry})
    fleet_changed()


async def node_preparing_forget(identity: str) -> None:
    """The node registered: it is in the fleet now, no longer on its way in."""
    if identity in (await cache.aget(PREPARING_KEY) or {}):
        await _update(lambda entries: {k: v for k, v in entries.items() if k != identity})


async def _update(change) -> None:
    # Read, change, write: two nodes reporting at the same instant to two head processes may lose one report, which
    # the next (a couple of seconds later) puts back; the page is a view, and nothing else reads this.
    entries = node_preparing_fresh(await cache.aget(PREPARING_KEY) or {})
    await cache.aset(PREPARING_KEY, change(entries), PREPARING_STALE_S)


def node_preparing_fresh(entries: dict) -> dict:
    now = time.time()
    return {k: v for k, v in entries.items() if now - v.get("at", 0) < PREPARING_STALE_S}


def node_preparing_list() -> dict[str, dict]:
    """{identity: {"model", "state", "progress", "percent", "address"}} of the nodes on their way in."""
    return {identity: {**entry, "percent": int(entry["progress"] * 100)}
            for identity, entry in node_preparing_fresh(cache.get(PREPARING_KEY) or {}).items()}
