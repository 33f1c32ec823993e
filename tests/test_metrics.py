"""/metrics: who may scrape it, that it parses as Prometheus' text format, that each event moves exactly its series,
the live gauges, and the counts several head processes share through Redis. (A real generation: test_metrics_e2e.)"""

import json
import os
import threading
import time
import uuid

import pytest
from django.core.cache import cache
from prometheus_client.parser import text_string_to_metric_families

from fleet import metric_store, metrics
from fleet.dispatch import Outcome
from fleet.links import registry
from fleet.names import liveness_key
from fleet.waiting import CLASSES, RANKS, Waiter
from nodes.link.codes import CloseCode
from nodes.link.placement import NodeSlot
from tests.factories import NodeFactory, UserFactory

pytestmark = pytest.mark.django_db

TOKEN = "scrape-secret-1"


@pytest.fixture
def fresh_store(settings):
    """A store of its own: in process, or (REDIS_URL set) under a Redis prefix no other test run uses."""
    settings.FLEET_REDIS_PREFIX = f"fleet-metrics-{uuid.uuid4().hex[:8]}:"
    metric_store.store_reset()
    yield metric_store.store()
    current = metric_store.store()
    if isinstance(current, metric_store.RedisStore):
        current.clear()
    metric_store.store_reset()


@pytest.fixture
def scraper(client, settings, fresh_store):
    settings.FLEET_METRICS_TOKEN = TOKEN

    def scrape() -> dict:
        response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
        assert response.status_code == 200, response.content
        assert response["Content-Type"].startswith("text/plain; version=")
        return {family.name: family for family in text_string_to_metric_families(response.content.decode())}

    return scrape


def value(families: dict, family: str, sample: str | None = None, **labels) -> float | None:
    """One sample's value (None when the series is absent)."""
    for s in families[family].samples:
        if s.name == (sample or family) and s.labels == labels:
            return s.value
    return None


# --- who may scrape ---------------------------------------------------------------------------------------------


def test_without_credentials_it_is_a_401_that_says_what_to_send(client, settings):
    settings.FLEET_METRICS_TOKEN = TOKEN
    response = client.get("/metrics")
    assert response.status_code == 401 and response["WWW-Authenticate"].startswith("Bearer")
    assert response.content.decode() == ("/metrics needs `Authorization: Bearer <FLEET_METRICS_TOKEN>` or a staff "
                                         "session (sign in at /admin/)\n")


@pytest.mark.parametrize(("header", "configured", "says"), [
    ("Bearer wrong-secret", TOKEN, "is not `Bearer <FLEET_METRICS_TOKEN>`"),
    (f"Basic {TOKEN}", TOKEN, "is not `Bearer <FLEET_METRICS_TOKEN>`"),
    (f"Bearer {TOKEN}", "", "this head has no FLEET_METRICS_TOKEN"),
])
def test_a_wrong_or_unconfigured_token_is_a_401(client, settings, header, configured, says):
    settings.FLEET_METRICS_TOKEN = configured
    response = client.get("/metrics", HTTP_AUTHORIZATION=header)
    assert response.status_code == 401 and says in response.content.decode()


def test_a_signed_in_user_who_is_not_staff_gets_a_403(client, settings):
    settings.FLEET_METRICS_TOKEN = TOKEN
    client.force_login(UserFactory(is_staff=False, is_superuser=False))
    response = client.get("/metrics")
    assert response.status_code == 403 and b"for staff users" in response.content


def test_the_bearer_token_and_a_staff_session_both_scrape(client, settings, fresh_store):
    settings.FLEET_METRICS_TOKEN = TOKEN
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
    client.force_login(UserFactory(is_staff=True))
    response = client.get("/metrics")
    assert response.status_code == 200
    names = {family.name for family in text_string_to_metric_families(response.content.decode())}
    assert {"fleet_generations", "fleet_time_to_first_token_seconds", "fleet_node_up", "fleet_lanes"} <= names


# --- what the events count ------------------------------------------------------------------------------------


def test_a_generation_moves_its_status_tokens_and_latencies(scraper):
    done = Outcome(node="node-a", prompt_tokens=20, cached_tokens=8, completion_tokens=5, started_at=100.0,
                   first_token_at=100.3)
    metrics.generation_ended(model="m", status="done", code="", outcome=done, finished_at=100.7)
    metrics.generation_ended(model="m", status="failed", code="engine_crashed", outcome=Outcome(node="node-a"),
                             finished_at=101.0)
    got = scraper()
    assert value(got, "fleet_generations", "fleet_generations_total", model="m", node="node-a", status="done",
                 code="") == 1
    assert value(got, "fleet_generations", "fleet_generations_total", model="m", node="node-a", status="failed",
                 code="engine_crashed") == 1
    for family, expected in (("fleet_prompt_tokens", 20), ("fleet_cached_tokens", 8),
                             ("fleet_completion_tokens", 5)):
        assert value(got, family, f"{family}_total", model="m", node="node-a") == expected
    ttft = "fleet_time_to_first_token_seconds"
    assert value(got, ttft, f"{ttft}_count", model="m", node="node-a") == 1  # the failed one had no first token
    assert value(got, ttft, f"{ttft}_sum", model="m", node="node-a") == pytest.approx(0.3)
    assert value(got, ttft, f"{ttft}_bucket", model="m", node="node-a", le="0.25") == 0
    assert value(got, ttft, f"{ttft}_bucket", model="m", node="node-a", le="0.5") == 1
    itl = "fleet_inter_token_latency_seconds"  # 0.4 s over the 4 tokens after the first
    assert value(got, itl, f"{itl}_sum", model="m", node="node-a") == pytest.approx(0.1)
    assert value(got, itl, f"{itl}_bucket", model="m", node="node-a", le="0.05") == 0
    assert value(got, itl, f"{itl}_bucket", model="m", node="node-a", le="0.2") == 1
    assert value(got, itl, f"{itl}_bucket", model="m", node="node-a", le="+Inf") == 1


def test_placements_by_reason_failovers_and_link_events(scraper):
    metrics.placement_made(model="m", evidence={"node": "a", "candidates": 2, "matched_tokens": 12})
    metrics.placement_made(model="m", evidence={"node": "a", "candidates": 3, "matched_tokens": 0})
    metrics.placement_made(model="m", evidence={"node": "b", "candidates": 1, "matched_tokens": 40})
    metrics.placement_made(model="m", evidence={"node": "b", "candidates": 1, "matched_tokens": 0})
    metrics.failover(model="m", node="a", code="node_lost")
    metrics.link_dropped(node="a")
    metrics.link_refused(code=CloseCode.TOKEN_REFUSED)
    metrics.link_refused(code=int(CloseCode.TOKEN_REFUSED))
    got = scraper()
    placed = "fleet_placements_total"
    assert value(got, "fleet_placements", placed, model="m", node="a", reason="prefix_hit") == 1
    assert value(got, "fleet_placements", placed, model="m", node="a", reason="load") == 1
    assert value(got, "fleet_placements", placed, model="m", node="b", reason="only_candidate") == 2
    assert value(got, "fleet_failovers", "fleet_failovers_total", model="m", node="a", code="node_lost") == 1
    assert value(got, "fleet_link_drops", "fleet_link_drops_total", node="a") == 1
    assert value(got, "fleet_link_refusals", "fleet_link_refusals_total", reason="token_refused") == 2


def test_live_gauges_come_from_placement_heartbeats_and_the_node_rows(scraper):
    NodeFactory(identity="gone", state="offline")
    placement = registry().placement
    placement.node_up(NodeSlot("n1", "node-a", ["m"], 4, 2048))
    assert placement.choose("m", []) is not None  # one generation running there
    cache.set(liveness_key("n1"), {"lanes_busy": 1, "lanes": 4, "kv_used": 300, "kv_total": 8192,
                                   "tokens_per_s": 41.5}, 30)
    got = scraper()
    assert value(got, "fleet_node_up", node="node-a") == 1 and value(got, "fleet_node_up", node="gone") == 0
    labels = {"model": "m", "node": "node-a"}
    assert value(got, "fleet_lanes", **labels) == 4 and value(got, "fleet_lanes_busy", **labels) == 1
    assert value(got, "fleet_generations_running", **labels) == 1
    assert value(got, "fleet_node_kv_cache_used_tokens", **labels) == 300
    assert value(got, "fleet_node_kv_cache_capacity_tokens", **labels) == 8192
    assert value(got, "fleet_node_decode_tokens_per_second", **labels) == 41.5
    assert value(got, "fleet_generations_waiting", model="m") == 0


def test_waiting_generations_are_counted_per_model(scraper, monkeypatch):
    from fleet.links import registry

    monkeypatch.setattr(registry().waiting, "entries", [("m", Waiter("g1", RANKS["normal"], 1.0)),
                                                           ("m", Waiter("g2", RANKS["batch"], 2.0)),
                                                           ("other", Waiter("g3", RANKS["normal"], 1.0))])
    got = scraper()
    assert value(got, "fleet_generations_waiting", model="m") == 2
    assert value(got, "fleet_generations_waiting", model="other") == 1


def test_waiting_generations_are_counted_per_priority_and_per_key(scraper, monkeypatch):
    from fleet.links import registry

    monkeypatch.setattr(registry().waiting, "entries", [
        ("m", Waiter("g1", RANKS["high"], 1.0, "k1", label="fk-one")),
        ("m", Waiter("g2", RANKS["normal"], 2.0, "k2", label="fk-two")),
        ("other", Waiter("g3", RANKS["normal"], 1.0, "k2", label="fk-two"))])
    got = scraper()
    assert [value(got, "fleet_generations_waiting_by_priority", priority=p) for p in CLASSES] == [1, 2, 0, 0]
    assert value(got, "fleet_generations_waiting_by_key", key="fk-one") == 1
    assert value(got, "fleet_generations_waiting_by_key", key="fk-two") == 2


# --- several head processes -------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_head_processes_add_to_the_same_counts_through_redis(monkeypatch):
    """Two stores on one Redis prefix are two head processes: a scrape of either shows what both counted."""
    prefix = f"fleet-metrics-{uuid.uuid4().hex[:8]}:"
    one = metric_store.RedisStore(os.environ["REDIS_URL"], prefix=prefix, process="one")
    two = metric_store.RedisStore(os.environ["REDIS_URL"], prefix=prefix, process="two")
    # Only the explicit flushes write here: a writer thread flushing later would send "one"'s waiting count after
    # the patch below made it "two"'s (in a real process the count is that process's own).
    one._writer = two._writer = threading.Thread(target=lambda: None)
    try:
        monkeypatch.setattr(metric_store, "local_waiting", lambda: {"m": 2})
        monkeypatch.setattr(metric_store, "local_waiting_classes", lambda: {"priority": {"high": 2}, "key": {"k": 2}})
        one.add({"fleet_completion_tokens": {metrics.field_name(["m", "a"]): 5.0}})
        one.flush()
        monkeypatch.setattr(metric_store, "local_waiting", lambda: {"m": 1})
        monkeypatch.setattr(metric_store, "local_waiting_classes", lambda: {"priority": {"low": 1}, "key": {"k": 1}})
        two.add({"fleet_completion_tokens": {metrics.field_name(["m", "a"]): 7.0}})
        two.flush()
        for store in (one, two):
            assert store.totals(["fleet_completion_tokens"]) == {
                "fleet_completion_tokens": {metrics.field_name(["m", "a"]): 12.0}}
            assert store.waiting() == {"m": 3}
            assert store.waiting_classes() == {"priority": {"high": 2, "low": 1}, "key": {"k": 3}}
        # A process that stops refreshing its waiting generations drops out when its key expires.
        assert 0 < one.r.ttl(f"{prefix}metrics:waiting:one") <= metric_store.WAITING_TTL_S
    finally:
        one.clear()


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_the_writer_thread_sends_counts_without_a_scrape(fresh_store):
    fresh_store.add({"fleet_link_drops": {metrics.field_name(["a"]): 1.0}})
    other = metric_store.RedisStore(os.environ["REDIS_URL"], prefix=fresh_store.p[: -len("metrics:")])
    deadline = time.monotonic() + 10
    while other.totals(["fleet_link_drops"])["fleet_link_drops"] != {metrics.field_name(["a"]): 1.0}:
        assert time.monotonic() < deadline, "the writer thread never wrote the count"
        time.sleep(0.05)


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_a_process_sends_many_events_counts_in_one_write_and_nothing_when_nothing_changed(monkeypatch):
    """The writer's tick (every FLUSH_S): whatever the number of events since the last one, one MULTI/EXEC; with no
    new count and the same waiting generations, no call at all."""
    prefix = f"fleet-metrics-{uuid.uuid4().hex[:8]}:"
    store = metric_store.RedisStore(os.environ["REDIS_URL"], prefix=prefix, process="one")
    store._writer = threading.Thread(target=lambda: None)  # only the ticks below write
    monkeypatch.setattr(metric_store, "local_waiting", lambda: {"m": 1})
    monkeypatch.setattr(metric_store, "local_waiting_classes", lambda: {"priority": {"normal": 1}, "key": {}})
    writes: list[int] = []
    pipeline = store.r.pipeline

    def counted(*args, **kwargs):  # the writes (a MULTI/EXEC), not the reads of the checks below
        pipe = pipeline(*args, **kwargs)
        if kwargs.get("transaction", True):
            execute = pipe.execute
            pipe.execute = lambda *a, **k: writes.append(len(pipe.command_stack)) or execute(*a, **k)
        return pipe

    monkeypatch.setattr(store.r, "pipeline", counted)
    try:
        for _ in range(50):
            metrics_counts = metrics.Counts().add(metrics.COMPLETION_TOKENS, ("m", "a"), 4)
            store.add(metrics_counts.deltas)
        assert writes == []  # counting sends nothing
        store.tick()
        assert len(writes) == 1
        assert store.totals(["fleet_completion_tokens"]) == {
            "fleet_completion_tokens": {metrics.field_name(["m", "a"]): 200.0}}
        assert store.waiting() == {"m": 1}
        store.tick()
        assert len(writes) == 1  # nothing new: no call
        monkeypatch.setattr(metric_store, "local_waiting", lambda: {"m": 3})
        store.tick()
        assert len(writes) == 2 and store.waiting() == {"m": 3}  # the waiting generations changed
    finally:
        store.clear()


def _every_metric_shown(scraper) -> list:
    """A sample of every metric Fleet shows, from one generation, placement, failover, link drop and refusal."""
    outcome = Outcome(node="a", prompt_tokens=3, completion_tokens=2, started_at=1.0, first_token_at=1.5)
    metrics.generation_ended(model="m", status="done", code="", outcome=outcome, finished_at=2.0)
    metrics.placement_made(model="m", evidence={"node": "a", "candidates": 1})
    metrics.failover(model="m", node="a", code="node_lost")
    metrics.link_dropped(node="a")
    metrics.link_refused(code=CloseCode.FLOOD)
    registry().placement.node_up(NodeSlot("n1", "a", ["m"], 2, 2048))
    cache.set(liveness_key("n1"), {"lanes_busy": 0, "kv_used": 0, "kv_total": 4096, "tokens_per_s": 0.0}, 30)
    return [s for family in scraper().values() for s in family.samples]


def _dashboard() -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent.parent / "docs" / "grafana-dashboard.json").read_text())


def test_the_grafana_dashboard_queries_only_what_metrics_shows(scraper):
    import re

    shown = {s.name for s in _every_metric_shown(scraper)}
    dashboard = _dashboard()
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = set(re.findall(r"\bfleet_[a-z_]+", " ".join(queries)))
    assert len(used) >= 15 and used <= shown, used - shown


def test_every_grafana_series_is_labelled_by_what_tells_it_apart(scraper):
    """A panel of per-(model, node) series names both in each legend: a node serving two models is two lines."""
    import re

    labels: dict[str, set[str]] = {}
    for sample in _every_metric_shown(scraper):
        labels.setdefault(sample.name, set()).update(sample.labels)
    unlabelled = []
    for panel in _dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr, legend = target["expr"], target.get("legendFormat", "")
            by = re.search(r"\bby \(([^)]*)\)", expr)
            if by:
                apart = {name.strip() for name in by.group(1).split(",")} - {"le"}
            elif re.search(r"\b(sum|count|avg|min|max)\b", expr):
                apart = set()  # one series
            else:
                apart = {name for metric in re.findall(r"\bfleet_[a-z_]+", expr) for name in labels[metric]}
                apart &= {"model", "node"}
            unlabelled += [(panel["title"], name) for name in apart if f"{{{{{name}}}}}" not in legend]
    assert unlabelled == []


def test_a_node_serving_several_models_shows_each_models_own_lanes_and_kv(scraper, client):
    """The heartbeat's per-model figures (each engine worker's): not the node's totals repeated for every model."""
    NodeFactory(id="00000000-0000-0000-0000-0000000000a1", identity="multi", models_served=["small", "big", "ear"],
                lanes=12, state="online")
    registry().placement.node_up(NodeSlot("00000000-0000-0000-0000-0000000000a1", "multi", ["small", "big", "ear"],
                                          12, 2048))
    cache.set(liveness_key("00000000-0000-0000-0000-0000000000a1"), {
        "lanes_busy": 4, "lanes": 12, "kv_used": 900, "kv_total": 98304, "tokens_per_s": 30.0,
        "models": {"small": {"lanes": 4, "lanes_busy": 4, "kv_used": 900, "kv_total": 32768, "tokens_per_s": 30.0},
                   "big": {"lanes": 8, "lanes_busy": 0, "kv_used": 0, "kv_total": 65536, "tokens_per_s": 0.0}}}, 30)
    got = scraper()
    small, big, ear = ({"model": m, "node": "multi"} for m in ("small", "big", "ear"))
    assert (value(got, "fleet_lanes", **small), value(got, "fleet_lanes", **big), value(got, "fleet_lanes", **ear)) \
        == (4, 8, 0)
    assert (value(got, "fleet_lanes_busy", **small), value(got, "fleet_lanes_busy", **big)) == (4, 0)
    assert value(got, "fleet_node_kv_cache_capacity_tokens", **small) == 32768
    assert value(got, "fleet_node_kv_cache_capacity_tokens", **big) == 65536
    assert value(got, "fleet_node_decode_tokens_per_second", **big) == 0
    # the fleet page and the node page read the same figures
    from fleet.selectors import fleet_overview

    served = {m["name"]: (m["lanes"], m["lanes_busy"]) for m in fleet_overview()["models"]}
    assert served == {"small": (4, 4), "big": (8, 0), "ear": (0, 0)}
    from tests.factories import UserFactory as Users

    client.force_login(Users(is_staff=True, is_superuser=True))
    page = client.get("/admin/nodes/node/00000000-0000-0000-0000-0000000000a1/change/").content.decode()
    models_table = page.split('id="node-models"')[1].split("</table>")[0]
    assert "<td>big</td>" in models_table and "0 / 65536" in models_table and "900 / 32768" in models_table
    assert "98304" not in models_table  # the node's total is for the node, not for each model
    from django.contrib.contenttypes.models import ContentType

    ContentType.objects.clear_cache()  # as it was: the admin pages' pinned query counts include its lookups


def _reset_known(monkeypatch):
    monkeypatch.setitem(metrics._known(), "at", -1e9)
    monkeypatch.setitem(metrics._known(), "names", frozenset())


def test_a_thousand_made_up_model_names_are_one_series_other(scraper, monkeypatch):
    """Any name a client sends must not become a series of its own: the scrape stays bounded."""
    from nodes.models import Model

    _reset_known(monkeypatch)
    registry().placement.node_up(NodeSlot("n1", "node-a", ["m"], 2, 2048))
    Model.objects.create(name="in-registry", sha256="ab" * 32, size=1, architecture="llama", quantization="Q8_0",
                         context_length=8, kv_bytes_per_token=1)

    async def end_all():
        for name in [*(f"made-up-{i}" for i in range(1000)), "m", "in-registry"]:
            outcome = Outcome(node="", prompt_tokens=0, completion_tokens=0, started_at=1.0)
            metrics.generation_ended(model=await metrics.amodel_label(name), status="failed", code="model_not_found",
                                     outcome=outcome, finished_at=2.0)

    from asgiref.sync import async_to_sync

    async_to_sync(end_all)()
    metric_store.store().flush()
    got = scraper()
    series = {s.labels["model"] for s in got["fleet_generations"].samples if s.name == "fleet_generations_total"}
    assert series == {"other", "m", "in-registry"}
    assert value(got, "fleet_generations", "fleet_generations_total", model="other", node="", status="failed",
                 code="model_not_found") == 1000


@pytest.mark.django_db(transaction=True)
async def test_a_request_for_an_unknown_model_counts_under_other(monkeypatch, settings):
    from asgiref.sync import sync_to_async

    from api.services import api_key_create
    from tests.api_support import add_fake_node, request

    settings.FLEET_REDIS_PREFIX = f"fleet-metrics-{uuid.uuid4().hex[:8]}:"
    metric_store.store_reset()
    _reset_known(monkeypatch)
    add_fake_node()
    _, key = await sync_to_async(api_key_create)(owner=await sync_to_async(UserFactory)(), name="k")
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}]}
    assert (await request("POST", "/v1/chat/completions", key=key, body=body)).status == 404
    current = metric_store.store()
    await sync_to_async(current.flush)()
    totals = (await sync_to_async(current.totals)(["fleet_generations"]))["fleet_generations"]
    assert [json.loads(name)[0] for name in totals] == ["other"]
    if isinstance(current, metric_store.RedisStore):
        current.clear()
    metric_store.store_reset()


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs REDIS_URL")
def test_a_head_process_that_exits_sends_what_it_counted_since_its_last_write():
    """The writer sends once a second: a process that stops before its next tick still leaves its counts in Redis."""
    import subprocess
    import sys

    prefix = f"fleet-metrics-{uuid.uuid4().hex[:8]}:"
    script = ("import django, os; django.setup()\n"
              "from fleet import metric_store\n"
              f"store = metric_store.RedisStore(os.environ['REDIS_URL'], prefix={prefix!r}, process='gone')\n"
              "store.add({'fleet_link_drops': {'x': 3.0}})\n")  # and exits at once, well before the first tick
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "fleet.settings"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    reader = metric_store.RedisStore(os.environ["REDIS_URL"], prefix=prefix, process="reader")
    try:
        assert reader.totals(["fleet_link_drops"]) == {"fleet_link_drops": {"x": 3.0}}
    finally:
        reader.clear()
