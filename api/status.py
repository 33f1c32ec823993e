"""The live fleet as /api/fleet/ shows it: what this head process's placement state knows, plus the records."""

from __future__ import annotations

from typing import Any

from fleet.dispatch import queue_length
from fleet.links import registry
from nodes.models import Node


def fleet_status() -> dict[str, Any]:
    """Models served, each node with its lanes free and busy, and the queue of generations waiting for a lane."""
    slots = {slot.node_id: slot for slot in registry().placement.nodes()}
    nodes = []
    for node in Node.objects.exclude(state=Node.State.OFFLINE).order_by("identity"):
        slot = slots.get(str(node.id))
        lanes = slot.lanes if slot else node.lanes
        busy = slot.running if slot else 0
        nodes.append({"id": str(node.id), "identity": node.identity, "state": node.state,
                      "models": list(slot.models if slot else node.models_served), "lanes": lanes,
                      "lanes_busy": busy, "lanes_free": max(lanes - busy, 0) if slot and slot.schedulable else 0,
                      "linked_here": slot is not None})
    models: dict[str, dict[str, Any]] = {}
    for entry in nodes:
        for name in entry["models"]:
            row = models.setdefault(name, {"name": name, "nodes": 0, "lanes": 0, "lanes_free": 0})
            row["nodes"] += 1
            row["lanes"] += entry["lanes"]
            row["lanes_free"] += entry["lanes_free"]
    lanes_total = sum(n["lanes"] for n in nodes)
    lanes_busy = sum(n["lanes_busy"] for n in nodes)
    return {
        "models": sorted(models.values(), key=lambda m: m["name"]),
        "nodes": nodes,
        "lanes_total": lanes_total,
        "lanes_busy": lanes_busy,
        "lanes_free": sum(n["lanes_free"] for n in nodes),
        "queue_length": queue_length(),
    }
