"""Reads of the fleet: the overview (nodes with their live lanes, models served, recent generations), the live
page's pushed snapshot, and a model's context window."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from django.db.models import Avg, Count, Sum
from django.urls import reverse
from django.utils import timezone

from fleet.links import registry
from nodes.link.device import DeviceReport
from nodes.models import Node
from nodes.preparing import node_preparing_list
from nodes.selectors import NodeFigures, node_beats, node_device, node_figures, node_models_preparing
from sessions.models import Generation


@dataclass
class NodeRow:
    node: Node
    connected_here: bool
    beat: dict = field(default_factory=dict)  # the last heartbeat: KV use, tokens/s history, replicas
    preparing: list[dict] = field(default_factory=list)  # models it is pulling or loading, with progress
    joining: bool = False  # not joined yet: pulling or loading its own model (nodes.preparing), no record yet
    device: DeviceReport = field(default_factory=DeviceReport)  # what it runs on (nodes.selectors.node_device)
    figures: NodeFigures = field(default_factory=lambda: NodeFigures(0))  # nodes.selectors.node_figures

    @property
    def context(self) -> str:
        """The window its lanes run with: one figure, or each model's where its models' engines differ."""
        windows = {name: f.context_window for name, f in self.figures.models.items() if f.lanes}
        if len(set(windows.values())) > 1:
            return ", ".join(f"{name} {window}" for name, window in windows.items())
        return str(next(iter(windows.values()), self.node.context_window))


def fleet_overview() -> dict:
    """Everything the fleet page shows, in a fixed number of queries."""
    nodes = list(Node.objects.all())
    beats = node_beats(n.id for n in nodes)
    links = registry().links
    preparing = node_models_preparing() if nodes else {}
    rows = []
    for node in nodes:
        beat = beats.get(str(node.id)) or {}
        rows.append(NodeRow(node, str(node.id) in links, beat, preparing.get(node.id, []),
                            device=node_device(node=node, beat=beat), figures=node_figures(node=node, beat=beat)))
    rows += _rows_joining(rows)
    since = timezone.now() - timedelta(hours=1)
    recent = Generation.objects.filter(created_at__gte=since)
    totals = recent.aggregate(
        count=Count("id"), completion_tokens=Sum("completion_tokens"), prompt_tokens=Sum("prompt_tokens"),
        cached_tokens=Sum("cached_tokens"), ttft_ms=Avg("ttft_ms"),
    )
    by_status = dict(recent.values_list("status").annotate(n=Count("id")).values_list("status", "n"))
    serving = [row for row in rows if row.node.state != Node.State.OFFLINE]
    return {
        "nodes": rows,
        "models": _models_served(serving),
        "last_hour": {**totals, "by_status": by_status},
        "queue_length": len(registry().waiting),
        "lanes_total": sum(row.figures.lanes or 0 for row in serving),
        "lanes_busy": sum(row.figures.lanes_busy or 0 for row in serving),
    }


def _models_served(rows: list[NodeRow]) -> list[dict]:
    """Each model's nodes, lanes and busy lanes: its own engines' on each node (node_figures), summed."""
    models: dict[str, dict] = {}
    for row in rows:
        for name, figures in row.figures.models.items():
            entry = models.setdefault(name, {"name": name, "nodes": 0, "lanes": 0, "lanes_busy": 0})
            entry["nodes"] += 1
            entry["lanes"] += figures.lanes or 0
            entry["lanes_busy"] += figures.lanes_busy or 0
    return sorted(models.values(), key=lambda m: m["name"])


def _rows_joining(rows: list[NodeRow]) -> list[NodeRow]:
    """Nodes pulling or loading their own model before they join: a known node's row lists it with its deployed
    models on their way in; one the fleet has never seen gets a row of its own (no record yet)."""
    joining = node_preparing_list()
    known = {row.node.identity: row for row in rows}
    new = []
    for identity, entry in sorted(joining.items()):
        shown = {key: entry[key] for key in ("model", "state", "progress", "percent")}
        if identity in known:  # an online node has joined: what it said before is stale (a report that raced it)
            if known[identity].node.state == Node.State.OFFLINE:
                known[identity].preparing = [shown, *known[identity].preparing]
        else:
            node = Node(identity=identity, state="joining", address=entry["address"], lanes=0, context_window=0)
            new.append(NodeRow(node, False, {}, [shown], joining=True))
    return new


def fleet_live(*, waiting: dict[str, int], classes: dict[str, dict[str, int]] | None = None) -> dict:
    """The live fleet page's snapshot as JSON: the overview's figures, each node's KV use, generations placed there
    and tokens/s over the last minutes, and each model's lanes busy and generations waiting (`waiting`: summed
    over every head process by the page's socket; `classes`: the same per priority class and per API key prefix).
    Placement is read where it lives (Redis with REDIS_URL)."""
    overview = fleet_overview()
    placed = {slot.node_id: slot.running for slot in registry().placement.nodes()}
    nodes = [_live_node(row, placed.get(str(row.node.id))) for row in overview["nodes"]]
    models = [{"name": m["name"], "nodes": m["nodes"], "lanes": m["lanes"], "busy": m["lanes_busy"],
               "waiting": waiting.get(m["name"], 0)} for m in overview["models"]]
    hour = overview["last_hour"]
    return {
        "nodes": nodes, "models": models,
        "totals": {"nodes": len(nodes), "online": sum(n["state"] != "offline" for n in nodes),
                   "lanes_busy": overview["lanes_busy"], "lanes_total": overview["lanes_total"],
                   "waiting": sum(waiting.values()), "generations": hour["count"] or 0,
                   "completion_tokens": hour["completion_tokens"] or 0, "ttft_ms": hour["ttft_ms"],
                   "by_status": hour["by_status"],
                   "waiting_by_priority": (classes or {}).get("priority", {}),
                   "waiting_by_key": (classes or {}).get("key", {})},
    }


def _live_node(row: NodeRow, placed: int | None) -> dict:
    node, beat, figures = row.node, row.beat, row.figures
    return {
        "id": f"joining-{node.identity}" if row.joining else str(node.id), "identity": node.identity,
        "state": node.state, "models": node.models_served,
        "url": "" if row.joining else reverse("admin:nodes_node_change", args=[node.id]), "lanes": figures.lanes,
        "lanes_busy": figures.lanes_busy,
        "placed": placed, "tokens_per_s": figures.tokens_per_s, "kv_used": figures.kv_used,
        "kv_total": figures.kv_total, "history": beat.get("history") or [], "context_window": node.context_window,
        "context": row.context,
        "address": node.address, "engine": node.engine,
        "device": row.device.line(), "device_backend": row.device.backend, "cpu_fallback": row.device.cpu_fallback,
        "per_model": {name: f.as_dict() for name, f in figures.models.items()},
        "preparing": row.preparing,
        "last_seen": node.last_seen_at.isoformat() if node.last_seen_at else None,
    }


def model_context_window(model: str) -> int | None:
    """The largest context window among the linked nodes serving `model`; None when none serves it or none said.

    From the placement state (Redis when set, so every head process sees every node), not the database: it holds
    the nodes that can take a generation now.
    """
    return context_windows(registry().placement.nodes()).get(model)


async def acontext_windows() -> dict[str, int]:
    """context_windows of the placement's nodes, read without blocking the event loop."""
    return context_windows(await registry().aplacement.nodes())


def context_windows(slots) -> dict[str, int]:
    """Each model's largest context window among these placement slots (a model none gave a window is absent)."""
    windows: dict[str, int] = {}
    for slot in slots:
        for model in slot.models if slot.context_window else ():
            windows[model] = max(windows.get(model, 0), slot.context_window)
    return windows
