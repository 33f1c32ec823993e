"""The live fleet as /api/fleet/ shows it: what this head process's placement state knows, plus the records."""

from __future__ import annotations

from typing import Any

from fleet.links import registry
from nodes.models import Node
from nodes.selectors import node_beats, node_figures


def fleet_status() -> dict[str, Any]:
    """Models served, each node with its lanes free and busy, and the queue of generations waiting for a lane. Lanes
    are the node's figures (nodes.selectors.node_figures: what the pages and /metrics show), busy and free lanes this
    process's placement (generations placed there, fleet-wide with Redis)."""
    slots = {slot.node_id: slot for slot in registry().placement.nodes()}
    rows = list(Node.objects.exclude(state=Node.State.OFFLINE).order_by("identity"))
    beats = node_beats(n.id for n in rows)
    nodes, models = [], {}
    for node in rows:
        slot, figures = slots.get(str(node.id)), node_figures(node=node, beat=beats.get(str(node.id)))
        lanes, busy = figures.lanes or 0, slot.running if slot else 0
        free = max(lanes - busy, 0) if slot and slot.schedulable else 0
        nodes.append({"id": str(node.id), "identity": node.identity, "state": node.state,
                      "models": list(slot.models if slot else node.models_served), "lanes": lanes,
                      "lanes_busy": busy, "lanes_free": free, "linked_here": slot is not None})
        for name in nodes[-1]["models"]:
            own = getattr(figures.models.get(name), "lanes", None) or 0
            row = models.setdefault(name, {"name": name, "nodes": 0, "lanes": 0, "lanes_free": 0})
            row["nodes"] += 1
            row["lanes"] += own
            row["lanes_free"] += min(free, own)  # the node's free lanes, at most the model's own
    return {
        "models": sorted(models.values(), key=lambda m: m["name"]),
        "nodes": nodes,
        "lanes_total": sum(n["lanes"] for n in nodes),
        "lanes_busy": sum(n["lanes_busy"] for n in nodes),
        "lanes_free": sum(n["lanes_free"] for n in nodes),
        "queue_length": len(registry().waiting),
    }
