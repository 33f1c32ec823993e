"""Reads for nodes and fleet tokens."""

from django.db.models import QuerySet

from nodes.models import FleetToken, Node


def node_list_serving(*, model: str) -> list[Node]:
    """Nodes that take new generations of this model (online, not drained or cordoned)."""
    # JSON containment is not portable to SQLite; the node list is small, so filter here.
    return [n for n in Node.objects.filter(state=Node.State.ONLINE) if model in (n.models_served or [])]


def node_models_served() -> list[str]:
    names: set[str] = set()
    for served in Node.objects.exclude(state=Node.State.OFFLINE).values_list("models_served", flat=True):
        names.update(served or [])
    return sorted(names)


def fleet_token_list() -> QuerySet[FleetToken]:
    return FleetToken.objects.order_by("-created_at")
