"""Reads for nodes and fleet tokens."""

from django.db.models import QuerySet

from nodes.link.device import DeviceReport
from nodes.models import FleetToken, LinkEvent, Model, Node, NodeModel


def node_list_serving(*, model: str) -> list[Node]:
    """Nodes that take new generations of this model (online, not drained or cordoned)."""
    # JSON containment is not portable to SQLite; the node list is small, so filter here.
    return [n for n in Node.objects.filter(state=Node.State.ONLINE) if model in (n.models_served or [])]


def node_models_served() -> list[str]:
    """The models an online node serves: not those of nodes offline, drained or cordoned (none could take one now)."""
    names: set[str] = set()
    for served in Node.objects.filter(state=Node.State.ONLINE).values_list("models_served", flat=True):
        names.update(served or [])
    return sorted(names)


def models_on_demand() -> list[str]:
    """The registry models a request loads where there is room when no node serves them (nodes.on_demand)."""
    return sorted(Model.objects.filter(on_demand=True, kind=Model.Kind.MODEL).values_list("name", flat=True))


def node_speech_models() -> set[str]:
    """The speech models (`node_join --transcribe`) nodes not offline serve, as their capabilities name them."""
    names: set[str] = set()
    for capabilities in Node.objects.exclude(state=Node.State.OFFLINE).values_list("capabilities", flat=True):
        speech = capabilities.get("speech_models") if isinstance(capabilities, dict) else None
        names.update(m for m in speech or [] if isinstance(m, str))
    return names


def node_vision_models() -> set[str]:
    """The models served by nodes not offline whose capabilities say `vision` (a projector: `node_join --mmproj`)."""
    names: set[str] = set()
    rows = Node.objects.exclude(state=Node.State.OFFLINE).values_list("capabilities", "models_served")
    for capabilities, served in rows:
        if isinstance(capabilities, dict) and capabilities.get("vision"):
            names.update(m for m in served or [] if isinstance(m, str))
    return names


def fleet_token_list() -> QuerySet[FleetToken]:
    return FleetToken.objects.order_by("-created_at")


def node_replicas(*, node: Node) -> tuple[dict | None, list[dict]]:
    """The node's last heartbeat (None when it is offline or has not beaten yet) and its replicas with their states:
    from that heartbeat when there is one, else as the node registered them."""
    from django.core.cache import cache

    from fleet.names import liveness_key

    beat = cache.get(liveness_key(str(node.pk)))
    replicas = (beat or {}).get("replicas") or node.replicas or []
    return beat, [{**r, "state": "alive" if r.get("alive", True) else "down"} for r in replicas]


def node_device(*, node: Node, beat: dict | None) -> DeviceReport:
    """What the node runs on: its last heartbeat's report (its GPUs' memory now), else the one it registered with."""
    return DeviceReport.from_wire((beat or {}).get("device") or node.device)


def node_link_history(*, node: Node, limit: int = 50) -> list[LinkEvent]:
    """The node's newest link events: joins, drops, refusals (newest first)."""
    return list(node.link_events.order_by("-created_at")[:limit])


def node_models_preparing() -> dict:
    """Each node's deployed models on their way in (pulling or loading, as the node last reported them), in one
    query: {node id: [{"model", "state", "progress" (0..1), "percent"}]}, with "why" for one the head loads there on
    demand (nodes.on_demand)."""
    rows = NodeModel.objects.filter(state__in=(NodeModel.State.PULLING, NodeModel.State.LOADING)).values_list(
        "node_id", "model", "state", "progress", "on_demand", "why").order_by("model")
    preparing: dict = {}
    for node_id, model, state, progress, on_demand, why in rows:
        preparing.setdefault(node_id, []).append(
            {"model": model, "state": state, "progress": progress, "percent": int(progress * 100),
             **({"why": f"on demand: {why}"} if on_demand else {})})
    return preparing
