"""Reads of the fleet: the overview (nodes with their live lanes, models served, recent generations) and a model's
context window."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.core.cache import cache
from django.db.models import Avg, Count, Sum
from django.utils import timezone

from fleet.links import registry
from nodes.models import Node
from sessions.models import Generation


@dataclass
class NodeRow:
    node: Node
    lanes_busy: int | None
    tokens_per_s: float | None
    connected_here: bool


def fleet_overview() -> dict:
    """Everything the fleet page shows, in a fixed number of queries."""
    from nodes.consumers import liveness_key

    nodes = list(Node.objects.all())
    beats = cache.get_many([liveness_key(str(n.id)) for n in nodes]) if nodes else {}
    links = registry().links
    rows = []
    for node in nodes:
        beat = beats.get(liveness_key(str(node.id))) or {}
        rows.append(NodeRow(node, beat.get("lanes_busy"), beat.get("tokens_per_s"), str(node.id) in links))
    since = timezone.now() - timedelta(hours=1)
    recent = Generation.objects.filter(created_at__gte=since)
    totals = recent.aggregate(
        count=Count("id"), completion_tokens=Sum("completion_tokens"), prompt_tokens=Sum("prompt_tokens"),
        cached_tokens=Sum("cached_tokens"), ttft_ms=Avg("ttft_ms"),
    )
    by_status = dict(recent.values_list("status").annotate(n=Count("id")).values_list("status", "n"))
    models: dict[str, dict] = {}
    for node in nodes:
        if node.state == Node.State.OFFLINE:
            continue
        for name in node.models_served:
            entry = models.setdefault(name, {"name": name, "nodes": 0, "lanes": 0})
            entry["nodes"] += 1
            entry["lanes"] += node.lanes
    from fleet.dispatch import queue_length

    return {
        "nodes": rows,
        "models": sorted(models.values(), key=lambda m: m["name"]),
        "last_hour": {**totals, "by_status": by_status},
        "queue_length": queue_length(),
        "lanes_total": sum(n.lanes for n in nodes if n.state != Node.State.OFFLINE),
        "lanes_busy": sum(r.lanes_busy or 0 for r in rows if r.node.state != Node.State.OFFLINE),
    }


def model_context_window(model: str) -> int | None:
    """The largest context window among the linked nodes serving `model`; None when none serves it or none said.

    From the placement state (Redis when set, so every head process sees every node), not the database: it holds
    the nodes that can take a generation now.
    """
    windows = [slot.context_window for slot in registry().placement.nodes()
               if model in slot.models and slot.context_window]
    return max(windows, default=None)
