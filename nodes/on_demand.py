"""On-demand models: a registry model marked `on_demand` is loaded where there is room when a generation names it and
no node serves it, scaled with its queue, and unloaded when idle.

It is a kind of deployment (nodes.deployments owns the pairs): the head writes a node-model pair with `on_demand` set
and sends the node its `deploy` list, which then lists the model; the node pulls it if it lacks it, loads it in an
engine worker beside what it serves and reports its states as for any deployed model. Clearing `on_demand` takes it
out of the list, so the node drains it (what runs there finishes) and unloads it.

Room is the node's own figure (`memory_free` in its heartbeat: its --memory-budget less what its models hold, else the
device's free memory) less what the head already asked it to load. A model needs its weights and its lanes' KV cache
with the share the node keeps for compute (nodes.agent.window: KV_SHARE), as the node checks it before it loads. A
node that lacks the room unloads, least recently used first, on-demand models it serves that run no generation; never
its own `--model` or a model a deployment pins there.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import Q

from fleet.names import liveness_key
from nodes.agent.window import KV_SHARE
from nodes.link.codes import ModelPhase
from nodes.link.device import DeviceReport
from nodes.models import Deployment, LinkEvent, Model, Node, NodeModel
from nodes.services import link_event_record
from nodes.tell import tell_nodes

PENDING = (ModelPhase.PULLING, ModelPhase.LOADING)
UNHEARD = "has sent no heartbeat yet"
FAILED_FOR_S = 60  # a node whose load of a model failed is not asked to load it again for this long


class NoRoom(Exception):
    """No node can hold the model, even after unloading idle on-demand models; the message has the figures."""


@dataclass
class Change:
    """A load or an unload the head decided, with why: counted in /metrics and kept in the node's link history."""

    node: str  # identity
    model: str
    loaded: bool
    why: str
    reason: str = "request"  # its kind, a metric label: request (none served it), room (made room), queue, idle


@dataclass
class Decision:
    """What on_demand_place did: the node loading the model (None when it was loading already), and every change."""

    node: str | None = None
    changes: list[Change] = field(default_factory=list)


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def shape(model: Model) -> tuple[int, int]:
    """(lanes, context) of an on-demand replica: its deployment's where it has one, else the settings'."""
    deployment = model.deployments.order_by("created_at").first()
    lanes = deployment.lanes if deployment else settings.FLEET_ON_DEMAND_LANES
    context = (deployment.context if deployment and deployment.context else settings.FLEET_ON_DEMAND_CONTEXT)
    return lanes, min(context, model.context_length or context)


def required_bytes(model: Model) -> int:
    """Memory a node needs free to load the model: its weights, and its lanes' KV over the share kept for KV."""
    lanes, context = shape(model)
    return model.size + math.ceil(lanes * context * model.kv_bytes_per_token / KV_SHARE)


def _needs_text(model: Model) -> str:
    lanes, context = shape(model)
    return (f"{gb(required_bytes(model))} ({gb(model.size)} of weights, {lanes} lanes x {context:,} tokens of KV at "
            f"{model.kv_bytes_per_token:,} bytes a token, {int(KV_SHARE * 100)}% of the rest for KV)")


def on_demand_model(name: str) -> Model | None:
    return Model.objects.filter(name=name, on_demand=True, kind=Model.Kind.MODEL).first()


def on_demand_place(*, name: str, why: str = "a request found no node serving it",
                    placed: dict | None = None) -> Decision | None:
    """A generation of `name` found no node serving it: load it where it fits (making room, least recently used
    first). None: not an on-demand registry model. A Decision whose node is None: a load is under way already.
    Raises NoRoom with the figures when no node can hold it. `placed`: {(node id, model): when this head process
    last placed a generation there}, fresher than the nodes' heartbeats (which may be a second old)."""
    model = on_demand_model(name)
    if model is None:
        return None
    if NodeModel.objects.filter(model=name, node__state=Node.State.ONLINE).filter(
            Q(on_demand=True, state__in=PENDING) | Q(state=ModelPhase.DRAINING)).exists():
        return Decision()  # loading, or being unloaded (loaded again once that is done)
    return _load_somewhere(model, why=why, evict=True, placed=placed or {})


def on_demand_scale(*, name: str, why: str) -> Decision | None:
    """The model's generations wait: one more replica where one fits without unloading anything, up to its
    max_replicas; None when it is not on demand, at its maximum, loading already, or nowhere fits."""
    model = on_demand_model(name)
    if model is None:
        return None
    pairs = NodeModel.objects.filter(model=name, node__state=Node.State.ONLINE).exclude(state=ModelPhase.FAILED)
    if pairs.filter(on_demand=True, state__in=PENDING).exists() or pairs.count() >= model.max_replicas:
        return None
    try:
        return _load_somewhere(model, why=why, evict=False)
    except NoRoom:
        return None


@transaction.atomic
def _load_somewhere(model: Model, *, why: str, evict: bool, placed: dict | None = None) -> Decision:
    need = required_bytes(model)
    candidates, refusals = _candidates(model)
    fits = [(free, node) for node, free in candidates if free >= need]
    if fits:
        # a node whose load of any model failed lately comes after every other: its figures are in doubt
        failing = set(cache.get_many([_node_failed_key(node.pk) for _, node in fits]))
        node = max(fits, key=lambda f: (_node_failed_key(f[1].pk) not in failing, f[0], f[1].identity))[1]
        return _load_on(node, model, why=why, kind="request" if evict else "queue", victims=[])
    plans = [(plan, node) for node, free in candidates
             if evict and (plan := _room(node, free, need, placed or {})) is not None]
    if not plans and any(r.endswith(UNHEARD) for r in refusals):
        return Decision()  # a node that just joined has not said its room yet: its first heartbeat is due at once
    if not plans and evict and any(_room(node, free, need, placed or {}, recent=True) for node, free in candidates):
        return Decision()  # room once what this process placed since a node's last heartbeat is seen to be idle
    if not plans:
        free = ", ".join(f"{node.identity} {gb(free)} free" for node, free in candidates)
        raise NoRoom(f"The model {model.name!r} is loaded on demand, and no node has room for it: it needs "
                     f"{_needs_text(model)}; {'; '.join(filter(None, [free, *refusals])) or 'no node is online'}. "
                     "Free memory on a node (unload a model, raise its --memory-budget) or start another node.")
    victims, node = min(plans, key=lambda p: (len(p[0]), -p[0][0][1], p[1].identity))
    return _load_on(node, model, why=why, kind="request", victims=[pair for pair, _ in victims])


def _candidates(model: Model) -> tuple[list[tuple[Node, int]], list[str]]:
    """(node, bytes free for another model) for every node that may take it now, and why the others may not."""
    labelled = [d for d in Deployment.objects.filter(model=model) if d.labels]
    nodes = list(Node.objects.filter(state=Node.State.ONLINE).order_by("identity"))
    beats = cache.get_many([liveness_key(str(n.pk)) for n in nodes])
    have = set(NodeModel.objects.filter(model=model.name).exclude(state=ModelPhase.FAILED)
               .values_list("node_id", flat=True))
    pending = _pending_bytes()
    out, refusals = [], []
    for node in nodes:
        beat = beats.get(liveness_key(str(node.pk))) or {}
        if node.pk in have or model.name in (node.models_served or []):
            continue
        if failed := cache.get(_failed_key(model.name, node.pk)):
            refusals.append(f"{node.identity} failed to load it: {failed}")
        elif not beat:
            refusals.append(f"{node.identity} {UNHEARD}")
        elif not beat.get("on_demand", False):
            refusals.append(f"{node.identity} takes no on-demand model (node_join --no-on-demand)")
        elif labelled and not any(d.matches(node) for d in labelled):
            refusals.append(f"{node.identity} lacks the labels its deployment asks for")
        else:
            out.append((node, _claimed_free(node, beat) - pending.get(node.pk, 0)))
    return out, refusals


def _claimed_free(node: Node, beat: dict) -> int:
    """The room a node's heartbeat claims, at most the memory of the GPUs it reported at join: a node that says
    it has a petabyte free is not the first choice for every load. A node that reported no device memory (a CPU
    node) is taken at its word."""
    claim = beat.get("memory_free", 0)
    claim = int(claim) if isinstance(claim, int | float) and not isinstance(claim, bool) and claim > 0 else 0
    total = sum(d.total for d in DeviceReport.from_wire(node.device).devices)
    return min(claim, total) if total else claim


def _pending_bytes() -> dict:
    """Per node, the bytes of on-demand models the head asked it to load that it does not serve yet (its heartbeat's
    memory_free does not count them until they are loaded)."""
    sizes = {m.name: required_bytes(m) for m in Model.objects.filter(on_demand=True)}
    pending: dict = {}
    for node_id, name in NodeModel.objects.filter(on_demand=True, state__in=PENDING).values_list("node_id", "model"):
        pending[node_id] = pending.get(node_id, 0) + sizes.get(name, 0)
    return pending


def _room(node: Node, free: int, need: int, placed: dict, *,
          recent: bool = False) -> list[tuple[NodeModel, float]] | None:
    """The on-demand models to unload from `node` so `need` fits, least recently used first (only those running no
    generation, and none a deployment pins there); None when unloading all of them would not be enough.

    A model's idle time is its heartbeat's `idle_s` aged by the beat's age, or the time since this process last placed
    a generation of it there when that is later; one placed there after the beat may be running: not unloaded
    (`recent`: counted too, to tell whether waiting for the next heartbeat may make room)."""
    beat = cache.get(liveness_key(str(node.pk))) or {}
    figures, beat_at, now = beat.get("models") or {}, float(beat.get("at", 0.0)), time.time()
    pinned = {d.model.name for d in Deployment.objects.select_related("model") if d.matches(node)}
    idle = []
    for pair in NodeModel.objects.filter(node=node, on_demand=True, state=ModelPhase.SERVING).exclude(model__in=pinned):
        own, last = figures.get(pair.model) or {}, placed.get((str(node.pk), pair.model), 0.0)
        if not own.get("lanes_busy", 0) and (last <= beat_at or recent):
            since_beat = float(own.get("idle_s", 0.0)) + max(now - beat_at, 0.0) if beat_at else 0.0
            idle.append((pair, min(since_beat, now - last) if last else since_beat))
    sizes = {m.name: required_bytes(m) for m in Model.objects.filter(name__in=[p.model for p, _ in idle])}
    chosen = []
    for pair, idle_s in sorted(idle, key=lambda p: -p[1]):
        chosen.append((pair, idle_s))
        free += sizes.get(pair.model, 0)
        if free >= need:
            return chosen
    return None


def _load_on(node: Node, model: Model, *, why: str, kind: str, victims: list[NodeModel]) -> Decision:
    decision = Decision(node=node.identity)
    for pair in victims:
        reason = f"least recently used on {node.identity}: made room for {model.name}"
        _unload_pair(pair, why=reason)
        decision.changes.append(Change(node.identity, pair.model, False, reason, "room"))
    NodeModel.objects.update_or_create(node=node, model=model.name, defaults={
        "state": ModelPhase.PULLING, "progress": 0.0, "detail": "", "on_demand": True, "why": why[:200]})
    _history(node, LinkEvent.Kind.LOADED, f"{model.name}: {why}")
    decision.changes.append(Change(node.identity, model.name, True, why, kind))
    transaction.on_commit(lambda: tell_nodes([str(node.pk)]))
    return decision


def _unload_pair(pair: NodeModel, *, why: str) -> None:
    NodeModel.objects.filter(pk=pair.pk).update(on_demand=False, why=why[:200])
    _history(pair.node, LinkEvent.Kind.UNLOADED, f"{pair.model}: {why}")


def _history(node: Node, kind: str, detail: str) -> None:
    link_event_record(kind=kind, node_id=node.pk, identity=node.identity, detail=detail)


@transaction.atomic
def on_demand_idle(*, node_id, idle: dict[str, float]) -> list[Change]:
    """A node's heartbeat says how long each model it serves has run nothing (`idle`, seconds): unload each on-demand
    replica idle past its model's keep-alive, down to the model's min_replicas."""
    changes = []
    pairs = NodeModel.objects.filter(node_id=node_id, on_demand=True, state=ModelPhase.SERVING,
                                     model__in=list(idle)).select_related("node")
    models = {m.name: m for m in Model.objects.filter(name__in=[p.model for p in pairs], on_demand=True)}
    for pair in pairs:
        model = models.get(pair.model)
        if model is None or idle[pair.model] < model.keep_alive_s:
            continue
        replicas = NodeModel.objects.filter(model=pair.model, state=ModelPhase.SERVING, on_demand=True,
                                            node__state=Node.State.ONLINE).count()
        if replicas <= model.min_replicas:
            continue
        why = f"idle for {idle[pair.model]:.0f} s (keep-alive {model.keep_alive_s} s)"
        _unload_pair(pair, why=why)
        changes.append(Change(pair.node.identity, pair.model, False, why, "idle"))
    if changes:
        transaction.on_commit(lambda: tell_nodes([str(node_id)]))
    return changes


def on_demand_keep_alive(*, node_id) -> dict[str, int]:
    """The keep-alive of each on-demand model the head loaded on this node: the link consumer checks heartbeats
    against it and asks on_demand_idle only when one is past it."""
    names = NodeModel.objects.filter(node_id=node_id, on_demand=True).values_list("model", flat=True)
    return dict(Model.objects.filter(name__in=list(names), on_demand=True).values_list("name", "keep_alive_s"))


def on_demand_failed(*, node_id, model: str, detail: str) -> None:
    """A node could not load an on-demand model: not asked again for FAILED_FOR_S, so a waiting request looks
    elsewhere or ends with why."""
    if NodeModel.objects.filter(node_id=node_id, model=model, on_demand=True).exists():
        cache.set(_failed_key(model, node_id), detail[:300] or "failed", FAILED_FOR_S)
        cache.set(_node_failed_key(node_id), model, FAILED_FOR_S)


def _failed_key(model: str, node_id) -> str:
    return f"fleet:on-demand:failed:{model}:{node_id}"


def _node_failed_key(node_id) -> str:
    return f"fleet:on-demand:node-failed:{node_id}"


def node_on_demand(*, node: Node) -> dict[str, dict]:
    """The `deploy` rows of the on-demand models the head put on `node` (nodes.deployments.node_deployments adds
    them), each with its lanes and context; a pair that failed is left out (the node forgets it)."""
    rows = {}
    names = list(NodeModel.objects.filter(node=node, on_demand=True).exclude(state=ModelPhase.FAILED)
                 .values_list("model", flat=True))
    for model in Model.objects.filter(name__in=names, on_demand=True):
        lanes, context = shape(model)
        rows[model.name] = {"name": model.name, "sha256": model.sha256, "lanes": lanes, "context": context}
    return rows



MAX_KEEP_ALIVE_S = 30 * 24 * 3600
MAX_REPLICAS = 1024


class OnDemandError(ValueError):
    """Settings that cannot be kept as asked; says what to change."""


@transaction.atomic
def model_on_demand_update(*, model: Model, **changes) -> Model:
    """Set a registry model's on_demand, min_replicas, max_replicas and keep_alive_s. Turning it off unloads the
    replicas the head loaded on demand (nodes that deployments put it on keep it)."""
    was = Model.objects.filter(pk=model.pk).values_list("on_demand", flat=True).first()
    for name, value in changes.items():
        setattr(model, name, value)
    on_demand_check(model)
    model.save()
    pairs = list(NodeModel.objects.filter(model=model.name, on_demand=True).select_related("node"))
    if was and not model.on_demand:
        for pair in pairs:
            _unload_pair(pair, why="the model is no longer on demand")
    if pairs:  # their links learn the new keep-alive (or unload it) with the `deploy` this sends
        transaction.on_commit(lambda: tell_nodes([str(p.node_id) for p in pairs]))
    return model


def on_demand_check(model: Model) -> None:
    """Raises OnDemandError unless the model's on-demand settings make sense."""
    if model.on_demand and model.is_attachment:
        raise OnDemandError(f"{model.name!r} is a {model.get_kind_display()}: it loads with its base "
                            f"{model.base.name!r}; put the base on demand")
    if not 0 <= model.min_replicas <= model.max_replicas <= MAX_REPLICAS or model.max_replicas < 1:
        raise OnDemandError(f"replicas: give 0 <= min_replicas <= max_replicas, max_replicas from 1 to {MAX_REPLICAS} "
                            f"(now {model.min_replicas} and {model.max_replicas})")
    if not 1 <= model.keep_alive_s <= MAX_KEEP_ALIVE_S:
        raise OnDemandError(f"keep_alive_s must be from 1 to {MAX_KEEP_ALIVE_S} seconds (30 days)")
