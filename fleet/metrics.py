"""The fleet's Prometheus metrics, served at /metrics in Prometheus' text format (`prometheus_client`).

Counts (generations, tokens, latencies, placements, failovers, link drops and refusals) are added where they happen,
once per event, never per token. Gauges (lanes, running and waiting generations, node up, KV cache use, decode speed)
are read when Prometheus scrapes, from the placement state and the nodes' heartbeats in the cache.

Several head processes: with REDIS_URL the counts are shared through Redis (every process adds to the same hashes,
so any process's /metrics answers for the whole fleet); without it (the embedded default, one process) they live in
this process. The store is in `fleet.metric_store`; docs/operations.md lists every metric.
"""

from __future__ import annotations

import hmac
import json
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings
from django.core.cache import cache
from django.db import DatabaseError
from django.http import HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from fleet.links import registry
from fleet.metric_store import Totals, store
from nodes.link.device import DeviceReport


@dataclass(frozen=True)
class Family:
    """One counted metric: a counter, or a histogram when it has buckets (upper bounds, in its unit)."""

    name: str
    doc: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()


MODEL_NODE = ("model", "node")
GENERATIONS = Family("fleet_generations", "Generations that ended, by status (done, failed, cancelled, expired) and "
                     "error code (empty when none)", ("model", "node", "status", "code"))
API_GENERATIONS = Family("fleet_api_generations", "Generations that ended, by the API that asked (chat, completion, "
                         "responses, messages, ...) and status", ("api", "status"))
PROMPT_TOKENS = Family("fleet_prompt_tokens", "Prompt tokens of ended generations, cached ones included", MODEL_NODE)
CACHED_TOKENS = Family("fleet_cached_tokens", "Prompt tokens a node took from its cache instead of reading them",
                       MODEL_NODE)
COMPLETION_TOKENS = Family("fleet_completion_tokens", "Tokens generated", MODEL_NODE)
TIME_TO_FIRST_TOKEN = Family("fleet_time_to_first_token_seconds", "From the request reaching the head to its first "
                             "token there", MODEL_NODE, (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
INTER_TOKEN_LATENCY = Family("fleet_inter_token_latency_seconds", "A generation's mean time between tokens after the "
                             "first, one observation per generation", MODEL_NODE,
                             (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5))
PLACEMENTS = Family("fleet_placements", "Placement decisions by reason: prefix_hit (the node held part of the prompt), "
                    "load (chosen for its load alone), only_candidate", ("model", "node", "reason"))
FAILOVERS = Family("fleet_failovers", "Generations placed again because their node failed; node is the one that "
                   "failed", ("model", "node", "code"))
PREEMPTIONS = Family("fleet_preemptions", "Batch lines that gave their lane to an interactive generation (each "
                     "continues later from its tokens); node is where it ran", ("model", "node"))
LINK_DROPS = Family("fleet_link_drops", "Links of registered nodes that closed", ("node",))
LINK_REFUSALS = Family("fleet_link_refusals", "Node links the head refused, by close code", ("reason",))
ADMITTED = Family("fleet_generations_admitted", "Generations that took a lane from the waiting room (their first "
                  "placement), by priority class (high, normal, low, batch)", ("priority",))
BLOB_BYTES = Family("fleet_blob_bytes_served", "Bytes of blobs (registry models, media such as audio) the head sent to "
                    "nodes; a node that holds a blob fetches nothing", ())
ON_DEMAND = Family("fleet_on_demand_changes", "On-demand models loaded or unloaded (change), by reason: request (a "
                   "request found no node serving it), queue (its generations waited), room (unloaded, least recently "
                   "used, to make room), idle (past its keep-alive)", ("model", "node", "change", "reason"))
COUNTED = (GENERATIONS, API_GENERATIONS, PROMPT_TOKENS, CACHED_TOKENS, COMPLETION_TOKENS, TIME_TO_FIRST_TOKEN,
           INTER_TOKEN_LATENCY, PLACEMENTS, FAILOVERS, PREEMPTIONS, ADMITTED, LINK_DROPS, LINK_REFUSALS, BLOB_BYTES,
           ON_DEMAND)


# --- counting, at the events -----------------------------------------------------------------------------------


def field_name(labels: Sequence[str], part: str = "") -> str:
    """A series' field in the store: its label values, then "" (a counter) or a histogram's bucket/sum/count."""
    return json.dumps([*labels, part])


class Counts:
    """The counts one event adds, given to the store together."""

    def __init__(self) -> None:
        self.deltas: Totals = {}

    def add(self, family: Family, labels: Sequence[str], amount: float = 1.0) -> Counts:
        self._bump(family, field_name(labels), amount)
        return self

    def observe(self, family: Family, labels: Sequence[str], value: float) -> Counts:
        self._bump(family, field_name(labels, str(bisect_left(family.buckets, value))), 1)
        self._bump(family, field_name(labels, "sum"), value)
        self._bump(family, field_name(labels, "count"), 1)
        return self

    def _bump(self, family: Family, name: str, amount: float) -> None:
        series = self.deltas.setdefault(family.name, {})
        series[name] = series.get(name, 0.0) + amount

    def save(self) -> None:
        store().add(self.deltas)


OTHER_MODEL = "other"  # the model label of every name the fleet does not know (a client may send any name)
KNOWN_TTL_S = 5.0  # how long the known names are trusted; a miss looks again after MISS_RECHECK_S
MISS_RECHECK_S = 1.0


def _known() -> dict[str, Any]:
    """The model names the fleet knows, and when they were read (on the registry)."""
    return registry().own("known-models", lambda: {"at": -1e9, "names": frozenset()})


async def amodel_label(model: str) -> str:
    """`model` as a metric label: itself when the fleet knows it (a node serves it, or the registry holds it), else
    OTHER_MODEL, so a client naming made-up models cannot grow the scrape without bound. The known names are read
    at most every MISS_RECHECK_S however many unknown names arrive."""
    known = _known()
    age = time.monotonic() - known["at"]
    if age >= KNOWN_TTL_S or (model not in known["names"] and age >= MISS_RECHECK_S):
        known["names"], known["at"] = await _aknown_models(), time.monotonic()
    return model if model in known["names"] else OTHER_MODEL


async def _aknown_models() -> frozenset[str]:
    from asgiref.sync import sync_to_async

    from nodes.models import Model, Node

    def recorded() -> set[str]:
        names = set(Model.objects.values_list("name", flat=True))
        for served in Node.objects.values_list("models_served", flat=True):
            names.update(m for m in served or [] if isinstance(m, str))
        return names

    served = frozenset(await registry().aplacement.models())
    try:
        return served | frozenset(await sync_to_async(recorded)())
    except DatabaseError:  # the database away: the names the links serve (a stream's end never fails on it)
        return served | _known()["names"]


def generation_ended(*, model: str, status: str, code: str, outcome: Any, finished_at: float, api: str = "") -> None:
    """A generation ended (any interface, any status): its status, tokens and latencies. `outcome` is the
    dispatcher's Outcome; the tokens count for the node it ended on. `api`: the interface that asked for it."""
    labels = (model, outcome.node or "")
    counts = Counts().add(GENERATIONS, (*labels, status, code or ""))
    if api:
        counts.add(API_GENERATIONS, (api, status))
    counts.add(PROMPT_TOKENS, labels, outcome.prompt_tokens).add(CACHED_TOKENS, labels, outcome.cached_tokens)
    counts.add(COMPLETION_TOKENS, labels, outcome.completion_tokens)
    first = outcome.first_token_at
    if first is not None:
        counts.observe(TIME_TO_FIRST_TOKEN, labels, max(first - outcome.started_at, 0.0))
        if outcome.completion_tokens > 1:
            counts.observe(INTER_TOKEN_LATENCY, labels,
                           max(finished_at - first, 0.0) / (outcome.completion_tokens - 1))
    counts.save()


def placement_reason(evidence: dict) -> str:
    if evidence.get("candidates", 0) <= 1:
        return "only_candidate"
    return "prefix_hit" if evidence.get("matched_tokens", 0) > 0 else "load"


def placement_made(*, model: str, evidence: dict) -> None:
    """Placement chose a node (`Choice.evidence()`), for a generation's first attempt or a failover."""
    Counts().add(PLACEMENTS, (model, evidence.get("node", ""), placement_reason(evidence))).save()


def admitted(*, priority: str) -> None:
    Counts().add(ADMITTED, (priority,)).save()


def failover(*, model: str, node: str, code: str) -> None:
    Counts().add(FAILOVERS, (model, node, code)).save()


def preempted(*, model: str, node: str) -> None:
    Counts().add(PREEMPTIONS, (model, node)).save()


def on_demand_change(*, model: str, node: str, loaded: bool, reason: str) -> None:
    Counts().add(ON_DEMAND, (model, node, "load" if loaded else "unload", reason)).save()


def blob_served(*, size: int) -> None:
    Counts().add(BLOB_BYTES, (), size).save()


def link_dropped(*, node: str) -> None:
    Counts().add(LINK_DROPS, (node,)).save()


def link_refused(*, code: int) -> None:
    from nodes.link.codes import CloseCode

    try:
        reason = CloseCode(int(code)).name.lower()
    except ValueError:
        reason = str(code)
    Counts().add(LINK_REFUSALS, (reason,)).save()


# --- reading, at scrape time -----------------------------------------------------------------------------------


class FleetCollector:
    """What /metrics shows: the store's counts and the live gauges, read when Prometheus scrapes."""

    def collect(self) -> Iterator[Metric]:
        current = store()
        totals = current.totals([family.name for family in COUNTED])
        for family in COUNTED:
            yield exposed(family, totals.get(family.name, {}))
        yield from live_gauges(current.waiting())
        yield from waiting_gauges(current.waiting_classes())


def exposed(family: Family, series: dict[str, float]) -> Metric:
    if not family.buckets:
        metric = CounterMetricFamily(family.name, family.doc, labels=list(family.labels))
        for name, value in sorted(series.items()):
            metric.add_metric(json.loads(name)[:-1], value)
        return metric
    metric = HistogramMetricFamily(family.name, family.doc, labels=list(family.labels))
    by_labels: dict[tuple[str, ...], dict[str, float]] = {}
    for name, value in series.items():
        *labels, part = json.loads(name)
        by_labels.setdefault(tuple(labels), {})[part] = value
    bounds = [*(str(float(b)) for b in family.buckets), "+Inf"]
    for labels, parts in sorted(by_labels.items()):
        cumulative, buckets = 0.0, []
        for index, bound in enumerate(bounds):
            cumulative += parts.get(str(index), 0.0)
            buckets.append((bound, cumulative))
        metric.add_metric(list(labels), buckets, parts.get("sum", 0.0))
    return metric


def live_gauges(waiting: dict[str, int]) -> Iterator[Metric]:
    """Nodes and lanes from placement (every head process's nodes with Redis), load from the heartbeats."""
    from fleet.names import liveness_key
    from nodes.models import Node
    from nodes.selectors import lane_figures

    slots = registry().placement.nodes()
    beats = cache.get_many([liveness_key(s.node_id) for s in slots]) if slots else {}
    linked = {s.identity for s in slots}
    up = GaugeMetricFamily("fleet_node_up", "1 while the node is linked to the head, 0 for a known node that is not",
                           labels=["node"])
    registered = dict(Node.objects.values_list("identity", "device"))
    for identity in sorted(linked | set(registered)):
        up.add_metric([identity], 1.0 if identity in linked else 0.0)
    yield up
    yield from device_gauges({s.identity: DeviceReport.from_wire((beats.get(liveness_key(s.node_id)) or {}).get(
        "device") or registered.get(s.identity)) for s in slots})
    per_node = {
        "fleet_lanes": "Lanes (generations at once) of the model's engine on the node",
        "fleet_lanes_busy": "Lanes of the model's engine busy, as the node's last heartbeat said",
        "fleet_generations_running": "Generations placed on the node and not ended",
        "fleet_node_kv_cache_used_tokens": "KV cache cells in use, as the node's last heartbeat said",
        "fleet_node_kv_cache_capacity_tokens": "KV cache cells of all lanes, as the node's last heartbeat said",
        "fleet_node_decode_tokens_per_second": "Tokens a second the node generated lately, as its heartbeat said",
    }
    gauges = {name: GaugeMetricFamily(name, doc, labels=list(MODEL_NODE)) for name, doc in per_node.items()}
    for slot in sorted(slots, key=lambda s: s.identity):
        beat = beats.get(liveness_key(slot.node_id)) or {}
        figures = lane_figures(beat, models=list(slot.models), lanes=slot.lanes, context_window=slot.context_window)
        for model, own in figures.models.items():
            values = {"fleet_lanes": own.lanes, "fleet_generations_running": slot.running,
                      "fleet_lanes_busy": own.lanes_busy, "fleet_node_kv_cache_used_tokens": own.kv_used,
                      "fleet_node_kv_cache_capacity_tokens": own.kv_total,
                      "fleet_node_decode_tokens_per_second": own.tokens_per_s}
            for name, value in values.items():
                if value is not None:
                    gauges[name].add_metric([model, slot.identity], float(value))
    yield from gauges.values()
    queued = GaugeMetricFamily("fleet_generations_waiting", "Generations waiting for a free lane", labels=["model"])
    for model in sorted({m for s in slots for m in s.models} | set(waiting)):
        queued.add_metric([model], float(waiting.get(model, 0)))
    yield queued


def device_gauges(reports: dict[str, DeviceReport]) -> Iterator[Metric]:
    """What each linked node runs on (nodes.link.device): its backend, its GPUs' memory, layers offloaded, and 1 in
    fleet_node_cpu_fallback for a node on the CPU although its host has a GPU."""
    info = GaugeMetricFamily("fleet_node_info", "1 for each linked node, labelled with the backend its engines run "
                             "on (cpu, cuda, rocm, vulkan, metal; unknown when the node does not say)",
                             labels=["node", "backend"])
    memory = GaugeMetricFamily("fleet_node_device_memory_bytes", "Memory of each GPU a node's engines use, by kind "
                               "(total, free), as its last heartbeat said", labels=["node", "index", "device", "kind"])
    layers = GaugeMetricFamily("fleet_node_layers_offloaded", "Model layers the node offloads to its GPUs",
                               labels=["node"])
    total = GaugeMetricFamily("fleet_node_layers", "Model layers of the node's model (with the output layer)",
                              labels=["node"])
    fallback = GaugeMetricFamily("fleet_node_cpu_fallback", "1 while the node runs on the CPU although its host "
                                 "has a GPU (node_join --cpu)", labels=["node"])
    for node, report in sorted(reports.items()):
        info.add_metric([node, report.backend], 1.0)
        fallback.add_metric([node], 1.0 if report.cpu_fallback else 0.0)
        if report.layers_total:
            layers.add_metric([node], float(report.layers))
            total.add_metric([node], float(report.layers_total))
        for index, device in enumerate(report.devices):
            for kind, value in (("total", device.total), ("free", device.free)):
                if value:
                    memory.add_metric([node, str(index), device.name, kind], float(value))
    yield from (info, memory, layers, total, fallback)


def waiting_gauges(classes: dict[str, dict[str, int]]) -> Iterator[Metric]:
    """The waiting room per priority class (every class, 0 included) and per API key (by prefix: only keys with
    generations waiting, so the series are bounded by the keys staff made)."""
    from fleet.waiting import CLASSES

    by_priority = GaugeMetricFamily("fleet_generations_waiting_by_priority", "Generations waiting for a free lane, "
                                    "by priority class", labels=["priority"])
    for name in CLASSES:
        by_priority.add_metric([name], float(classes.get("priority", {}).get(name, 0)))
    yield by_priority
    by_key = GaugeMetricFamily("fleet_generations_waiting_by_key", "Generations waiting for a free lane, by API key "
                               "(its prefix); keys with none waiting are left out", labels=["key"])
    for name, n in sorted(classes.get("key", {}).items()):
        by_key.add_metric([name], float(n))
    yield by_key


# --- the scrape ----------------------------------------------------------------------------------------------------


def scrape_refusal(request) -> tuple[int, str] | None:
    """Why this request may not read /metrics (status, one line), or None: a bearer token equal to
    FLEET_METRICS_TOKEN, or a staff session."""
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, given = header.partition(" ")
        if not settings.FLEET_METRICS_TOKEN:
            return 401, ("this head has no FLEET_METRICS_TOKEN: set it in the head's environment and scrape with "
                         "`Authorization: Bearer <it>`, or sign in to /admin/ as staff")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                  settings.FLEET_METRICS_TOKEN.encode()):
            return 401, "the Authorization header is not `Bearer <FLEET_METRICS_TOKEN>` of this head"
        return None
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return None if user.is_staff else (403, "/metrics is for staff users or scrapers with FLEET_METRICS_TOKEN")
    return 401, "/metrics needs `Authorization: Bearer <FLEET_METRICS_TOKEN>` or a staff session (sign in at /admin/)"


def metrics_view(request) -> HttpResponse:
    """/metrics: the fleet's figures in Prometheus' text format."""
    refusal = scrape_refusal(request)
    if refusal is not None:
        status, line = refusal
        response = HttpResponse(line + "\n", status=status, content_type="text/plain; charset=utf-8")
        if status == 401:
            response["WWW-Authenticate"] = 'Bearer realm="fleet metrics"'
        return response
    current = store()
    scrape = CollectorRegistry(auto_describe=False)
    scrape.register(FleetCollector())
    try:
        current.flush()  # this process's latest counts first, then everyone's
        body = generate_latest(scrape)
    except redis.RedisError as exc:
        return HttpResponse(f"the metrics store (Redis) did not answer: {exc}; retry\n", status=503,
                            content_type="text/plain; charset=utf-8")
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
