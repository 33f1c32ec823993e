"""Reads for nodes and fleet tokens, and a node's figures (lanes, busy lanes, KV, tokens/s, each model's window)."""

from dataclasses import asdict, dataclass, field

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


FIGURES = ("lanes", "lanes_busy", "kv_used", "kv_total", "tokens_per_s")


@dataclass(frozen=True)
class LaneFigures:
    """A node's or one of its models' lanes as every page, API and /metrics shows them: what the node's last heartbeat
    said (`lanes_busy` and the rest None before its first), and the context window its lanes run with."""

    lanes: int | None
    lanes_busy: int | None = None
    kv_used: int | None = None
    kv_total: int | None = None
    tokens_per_s: float | None = None
    context_window: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class NodeFigures(LaneFigures):
    """The node's totals (every engine's summed, as the node sums them) and each model it serves, by fleet name."""

    models: dict[str, LaneFigures] = field(default_factory=dict)


def node_figures(*, node: Node, beat: dict | None) -> NodeFigures:
    """The one computation of a node's figures: the live page, the node's page, /api/nodes/, /api/fleet/ and /metrics
    read them here, so they agree. `beat`: its last heartbeat (None when there is none)."""
    return lane_figures(beat, models=node.models_served or [], lanes=node.lanes, context_window=node.context_window)


def lane_figures(beat: dict | None, *, models: list[str], lanes: int, context_window: int) -> NodeFigures:
    """node_figures from a node's parts (/metrics has the placement's slot, not the row). The heartbeat's totals and
    its `models` (each engine's own figures); without a heartbeat the node's registered lanes and nothing busy."""
    beat = beat or {}
    per_model = beat.get("models") if isinstance(beat.get("models"), dict) else {}
    shown = {name: _model_figures(beat, per_model, name, lanes=lanes if len(models) == 1 else None,
                                  context_window=context_window) for name in models}
    if not beat:
        return NodeFigures(lanes, context_window=context_window, models=shown)
    return NodeFigures(**{key: beat.get(key) for key in FIGURES[1:]}, lanes=beat.get("lanes", lanes),
                       context_window=context_window, models=shown)


def _model_figures(beat: dict, per_model: dict, name: str, *, lanes: int | None, context_window: int) -> LaneFigures:
    """A model's own engine's figures. One with no engine of its own there (a LoRA adapter BASE:ADAPTER, a speech model
    beside the text model) has zeros: its work counts under its engine's model, whose window it shares. A heartbeat
    without `models` (a node serving one model) gives the node's totals; no heartbeat, the lanes the node registered
    when it serves one model, else none known yet."""
    if not per_model:
        figures = {key: beat.get(key) for key in FIGURES[1:]} if beat else {}
        return LaneFigures(beat.get("lanes", lanes) if beat else lanes, **figures, context_window=context_window)
    own = per_model.get(name) or {}
    window = own.get("context_window") or (per_model.get(name.partition(":")[0]) or {}).get("context_window")
    return LaneFigures(**{key: own.get(key, 0) for key in FIGURES}, context_window=window or context_window)


def node_beats(node_ids) -> dict[str, dict]:
    """Each node's last heartbeat (kept in the cache with a TTL), in one read: {node id: beat}, none for a node
    without one."""
    from django.core.cache import cache

    from fleet.names import liveness_key

    ids = [str(i) for i in node_ids]
    beats = cache.get_many([liveness_key(i) for i in ids]) if ids else {}
    return {i: beats[liveness_key(i)] for i in ids if beats.get(liveness_key(i))}
