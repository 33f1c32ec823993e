"""A node link's part in deployments (nodes.deployments): it sends a node its `deploy` list, and takes the node's
`models` (what it serves now: placement follows at once) and `model_state` (each node-model pair's state). The link
session (nodes.link_session) makes one LinkDeploy when the node registers, given what it sends through."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from fleet import loading
from fleet.links import registry
from fleet.live import fleet_changed
from fleet.names import node_group
from nodes import deployments, on_demand
from nodes.link.codes import ModelPhase
from nodes.link.messages import Deploy, LinkError, Message, Models, ModelState

log = logging.getLogger("fleet")

MAX_MODELS = 64


def _models_problem(msg: Models) -> str | None:
    rows = msg.models
    if not rows or len(rows) > MAX_MODELS or not all(isinstance(m, dict) for m in rows):
        return f"models must list 1 to {MAX_MODELS} maps"
    for m in rows:
        name, window, lanes = m.get("name"), m.get("context_window", 0), m.get("lanes", 0)
        if not (isinstance(name, str) and 0 < len(name) <= 64 and "\x00" not in name):
            return "every model needs a name of 1 to 64 characters"
        if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**31 for n in (window, lanes)):
            return "context_window and lanes must be whole numbers from 0 to 2**31-1"
    return None if 0 <= msg.lanes < 2**31 else "lanes must be from 0 to 2**31-1"


def _state_problem(msg: ModelState) -> str | None:
    if not (0 < len(msg.model) <= 64 and "\x00" not in msg.model and "\x00" not in msg.detail):
        return "model must be a name of 1 to 64 characters, detail hold no NUL character"
    if msg.state not in set(ModelPhase):
        return f"state {msg.state[:20]!r} is none of {', '.join(ModelPhase)}"
    return None if math.isfinite(msg.progress) else "progress must be a number from 0 to 1"


class LinkDeploy:
    """A registered node's deployments on its link: the names the head registered its own models as, and the
    keep-alive of each on-demand model its last `deploy` put there."""

    def __init__(self, node_id: str, identity: str, fleet_names: dict[str, str],
                 send: Callable[[Message], Awaitable[None]]) -> None:
        self.node_id, self.identity, self.send = node_id, identity, send
        self.fleet_names = fleet_names  # the node's own model names -> the names the head registered them as
        self.keep_alive: dict[str, int] = {}  # on-demand model -> its keep-alive (s), as the last `deploy` put it here

    async def send_deployments(self, *, joined: bool = False) -> None:
        """Send the node every model its deployments put there (when one changes, and when it registers: then only
        when there is something to say, a model to load or a loaded one it may have to unload)."""
        wanted, adapters, self.keep_alive = await database_sync_to_async(_deploy_lists)(self.node_id)
        own = {fleet: name for name, fleet in self.fleet_names.items()}  # a base the head renamed, as the node knows it
        adapters = {own.get(base, base): rows for base, rows in adapters.items()}
        if wanted or adapters or not joined or len(self.fleet_names) > 1:
            await self.send(Deploy(models=wanted, adapters=adapters))

    async def check_idle(self, figures: dict) -> None:
        """A heartbeat's per-model figures: an on-demand model idle past its keep-alive is unloaded
        (nodes.on_demand); the database is asked only when one is past it."""
        idle = {name: float(f.get("idle_s") or 0) for name, f in figures.items()
                if name in self.keep_alive and isinstance(f, dict) and not f.get("lanes_busy")
                and isinstance(f.get("idle_s"), int | float) and f["idle_s"] >= self.keep_alive[name]}
        if idle:
            changes = await database_sync_to_async(on_demand.on_demand_idle)(node_id=self.node_id, idle=idle)
            for change in changes:
                self.keep_alive.pop(change.model, None)  # asked once; the next `deploy` says what is left
            loading.changes_counted(changes)

    async def forget_gone(self, names: list[str]) -> None:
        """The node (re)joined serving `names`: what it reported of other models went with its last run."""
        await database_sync_to_async(deployments.node_models_forget)(node_id=self.node_id, keep=names)

    async def on_models(self, msg: Models) -> None:
        """The node loaded or unloaded a model: place by its new list now. A model it joined with keeps the name the
        head registered it as."""
        if problem := _models_problem(msg):
            raise LinkError(f"models: {problem}")
        names = list(dict.fromkeys(_fleet_name(self, m["name"]) for m in msg.models))
        capabilities = msg.capabilities or None  # sent when an adapter was loaded or unloaded
        flags = sorted(k for k, v in capabilities.items() if v is True) if capabilities else None
        await registry().aplacement.node_models(self.node_id, names, msg.lanes, flags)  # never waits on Redis
        await database_sync_to_async(deployments.node_models_set)(node_id=self.node_id, names=names, lanes=msg.lanes,
                                                                  capabilities=capabilities)
        log.info("fleet node %r serves %s (%d lanes)", self.identity, ", ".join(names), msg.lanes)
        registry().lanes.notify()
        fleet_changed()

    def fleet_figures(self, figures: dict) -> dict:
        """A heartbeat's per-model figures under the names the head serves the models as (the node names its own)."""
        return {_fleet_name(self, str(name)): f for name, f in figures.items()}

    async def on_model_state(self, msg: ModelState) -> None:
        """Keep the pair's state; once the node serves it, nodes keeping it for a deployment that moved let it go."""
        if problem := _state_problem(msg):
            raise LinkError(f"model_state: {problem}")
        others = await database_sync_to_async(deployments.node_model_record)(
            node_id=self.node_id, model=msg.model, state=msg.state, progress=msg.progress, detail=msg.detail)
        if msg.state == ModelPhase.FAILED:  # an on-demand load that failed: its waiting requests look elsewhere
            await database_sync_to_async(on_demand.on_demand_failed)(node_id=self.node_id, model=msg.model,
                                                                     detail=msg.detail)
            registry().lanes.notify()
        if msg.state != ModelPhase.PULLING:
            log.info("fleet node %r: %s %s%s", self.identity, msg.model, msg.state,
                     f": {msg.detail}" if msg.detail else "")
        layer = get_channel_layer()
        for node_id in others:
            await layer.group_send(node_group(node_id), {"type": "node.deploy"})
        fleet_changed()  # the live page shows a pull's or a load's progress (a node reports it twice a second at most)


def _deploy_lists(node_id) -> tuple[list[dict], dict[str, list[dict]], dict[str, int]]:
    return (deployments.node_deployments(node_id=node_id), deployments.node_adapters(node_id=node_id),
            on_demand.on_demand_keep_alive(node_id=node_id))


def _fleet_name(node, name: str) -> str:
    """A model the node joined with keeps the name the head registered it as; so does BASE:ADAPTER of it."""
    base, colon, adapter = name.partition(":")
    return node.fleet_names.get(name) or (f"{node.fleet_names.get(base, base)}:{adapter}" if colon else name)
