"""On-demand models on the head (nodes.on_demand, /api/models/<id>/, /v1's 503): where a model is loaded, what is
unloaded to make room, what idles out, and the errors a client or an operator sees."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from django.core.cache import cache
from django.db import transaction

from fleet.names import liveness_key
from nodes import on_demand
from nodes.deployments import node_deployments
from nodes.models import Deployment, LinkEvent, Model, NodeModel
from tests.api_support import FakeLink, add_fake_node, request, start, written_rows
from tests.factories import NodeFactory, UserFactory

pytest_plugins = ["tests.api_fixtures"]

GB = 1_000_000_000
# 0.1 GB of weights, 23,040 bytes of KV a token: 4 lanes x 2,048 tokens (the settings' default) need 0.34 GB free
WEIGHTS, KV = 100_000_000, 23040
NEED = WEIGHTS + 4 * 2048 * KV / 0.8


def registry_model(name: str, **fields) -> Model:
    return Model.objects.create(name=name, sha256=f"{len(name):02x}" * 32, size=WEIGHTS, architecture="llama",
                                quantization="Q8_0", context_length=8192, kv_bytes_per_token=KV,
                                on_demand=fields.pop("on_demand", True), **fields)


def node_with(identity: str, *, free: float, on_demand_ok: bool = True, models: dict | None = None, **fields):
    """A node online whose last heartbeat says `free` bytes are free for another model (and each model's figures)."""
    node = NodeFactory(identity=identity, **fields)
    cache.set(liveness_key(str(node.pk)), {"memory_free": int(free), "on_demand": on_demand_ok,
                                           "models": models or {}, "at": time.time() - 1}, 60)
    return node


@pytest.fixture(autouse=True)
def _fresh_cache():
    cache.clear()
    yield
    cache.clear()


# --- where it loads -----------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_model_loads_on_the_node_with_most_room_and_that_node_is_told_to_load_it(django_capture_on_commit_callbacks):
    registry_model("qwen")
    node_with("small", free=NEED + 1)
    roomy = node_with("roomy", free=NEED * 3)
    node_with("refuser", free=NEED * 10, on_demand_ok=False)  # node_join --no-on-demand
    with django_capture_on_commit_callbacks(execute=False) as told:
        decision = on_demand.on_demand_place(name="qwen")
    assert decision.node == "roomy" and len(told) == 1
    assert node_deployments(node_id=roomy.pk) == [{"name": "qwen", "sha256": "04" * 32, "lanes": 4, "context": 2048}]
    assert LinkEvent.objects.get(node=roomy).kind == LinkEvent.Kind.LOADED
    assert on_demand.on_demand_place(name="qwen").node is None  # loading already: the next request waits for it


@pytest.mark.django_db
def test_a_model_not_on_demand_is_left_alone():
    registry_model("fixed", on_demand=False)
    node_with("roomy", free=NEED * 3)
    assert on_demand.on_demand_place(name="fixed") is None and on_demand.on_demand_place(name="nothing") is None
    assert not NodeModel.objects.exists()


@pytest.mark.django_db
def test_a_deployments_labels_choose_the_nodes_it_may_load_on():
    model = registry_model("qwen")
    Deployment.objects.create(model=model, labels={"gpu": "a100"}, lanes=2, context=1024)
    node_with("roomy", free=NEED * 3)
    labelled = node_with("labelled", free=NEED, labels={"gpu": "a100"})
    assert on_demand.on_demand_place(name="qwen").node == "labelled"
    assert node_deployments(node_id=labelled.pk)[0]["lanes"] == 2  # the deployment's shape


@pytest.mark.django_db
def test_what_a_node_was_asked_to_load_counts_against_its_room_until_it_serves_it():
    registry_model("one")
    registry_model("two")
    node_with("only", free=NEED * 1.5)
    assert on_demand.on_demand_place(name="one").node == "only"
    with pytest.raises(on_demand.NoRoom):
        on_demand.on_demand_place(name="two")


@pytest.mark.django_db
def test_a_node_that_has_not_said_its_room_yet_is_waited_for():
    registry_model("qwen")
    node_with("full", free=0)
    NodeFactory(identity="just-joined")  # online, its first heartbeat not in yet
    assert on_demand.on_demand_place(name="qwen").node is None  # waits (no 503) for that heartbeat
    assert not NodeModel.objects.exists()


@pytest.mark.django_db
def test_no_room_anywhere_names_the_need_and_each_nodes_room():
    registry_model("big")
    node_with("gpu-1", free=0.2 * GB)
    node_with("gpu-2", free=GB, on_demand_ok=False)
    with pytest.raises(on_demand.NoRoom) as refused:
        on_demand.on_demand_place(name="big")
    message = str(refused.value)
    assert "'big' is loaded on demand, and no node has room for it: it needs 0.34 GB (0.10 GB of weights, 4 lanes " \
           "x 2,048 tokens of KV at 23,040 bytes a token" in message
    assert "gpu-1 0.20 GB free" in message and "gpu-2 takes no on-demand model" in message


# --- making room: least recently used first -------------------------------------------------------------------


@pytest.mark.django_db
def test_room_is_made_by_unloading_the_least_recently_used_idle_on_demand_model(django_capture_on_commit_callbacks):
    for name in ("old", "busy", "recent", "pinned", "new"):
        registry_model(name)
    figures = {"old": {"lanes_busy": 0, "idle_s": 300}, "busy": {"lanes_busy": 1, "idle_s": 0},
               "recent": {"lanes_busy": 0, "idle_s": 5}, "pinned": {"lanes_busy": 0, "idle_s": 900}}
    node = node_with("full", free=NEED * 0.5, models=figures)
    for name in figures:
        NodeModel.objects.create(node=node, model=name, state="serving", on_demand=True)
    Deployment.objects.create(model=Model.objects.get(name="pinned"), nodes=["full"])
    with django_capture_on_commit_callbacks(execute=False):
        decision = on_demand.on_demand_place(name="new")
    assert decision.node == "full"
    unloaded = [(c.model, c.reason) for c in decision.changes if not c.loaded]
    assert unloaded == [("old", "room")]  # the least recently used that runs nothing and no deployment pins
    wanted = {row["name"] for row in node_deployments(node_id=node.pk)}
    assert wanted == {"busy", "recent", "pinned", "new"}  # `old` leaves the node's list: it drains and unloads


@pytest.mark.django_db
def test_a_model_this_head_placed_after_the_nodes_last_heartbeat_is_not_the_one_unloaded():
    for name in ("old", "recent", "new"):
        registry_model(name)
    node = node_with("full", free=NEED * 0.5, models={"old": {"lanes_busy": 0, "idle_s": 300},
                                                       "recent": {"lanes_busy": 0, "idle_s": 5}})
    for name in ("old", "recent"):
        NodeModel.objects.create(node=node, model=name, state="serving", on_demand=True)
    with transaction.atomic():  # placed just before the beat: its idle time is since then, not the beat's 300 s
        decision = on_demand.on_demand_place(name="new", placed={(str(node.pk), "old"): time.time() - 2})
        assert [c.model for c in decision.changes if not c.loaded] == ["recent"]
        transaction.set_rollback(True)
    decision = on_demand.on_demand_place(name="new", placed={(str(node.pk), "old"): time.time()})
    assert [c.model for c in decision.changes if not c.loaded] == ["recent"]  # `old` was just asked for again


@pytest.mark.django_db
def test_when_only_models_placed_since_the_last_heartbeat_could_make_room_it_waits_for_the_next_one():
    for name in ("a", "b", "new"):
        registry_model(name)
    node = node_with("full", free=0, models={"a": {"lanes_busy": 0, "idle_s": 30}, "b": {"lanes_busy": 0, "idle_s": 9}})
    for name in ("a", "b"):
        NodeModel.objects.create(node=node, model=name, state="serving", on_demand=True)
    now = time.time()
    decision = on_demand.on_demand_place(name="new", placed={(str(node.pk), "a"): now, (str(node.pk), "b"): now})
    assert decision.node is None and not decision.changes  # no 503: its next heartbeat says whether they run
    assert not NodeModel.objects.filter(model="new").exists()


@pytest.mark.django_db
def test_nothing_is_unloaded_when_even_all_idle_ones_would_not_make_room():
    registry_model("old")
    registry_model("new")
    node = node_with("full", free=0, models={"old": {"lanes_busy": 1}})
    NodeModel.objects.create(node=node, model="old", state="serving", on_demand=True)
    with pytest.raises(on_demand.NoRoom):
        on_demand.on_demand_place(name="new")
    assert NodeModel.objects.get(model="old").on_demand


# --- idle, and scaled -----------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_replica_idle_past_its_keep_alive_unloads_down_to_the_minimum():
    registry_model("a", keep_alive_s=60)
    registry_model("b", keep_alive_s=60, min_replicas=1)
    node = node_with("n1", free=0)
    for name in ("a", "b"):
        NodeModel.objects.create(node=node, model=name, state="serving", on_demand=True)
    assert on_demand.on_demand_idle(node_id=node.pk, idle={"a": 59, "b": 600}) == []
    changes = on_demand.on_demand_idle(node_id=node.pk, idle={"a": 61, "b": 600})
    assert [(c.model, c.reason, c.why) for c in changes] == [("a", "idle", "idle for 61 s (keep-alive 60 s)")]
    assert on_demand.on_demand_keep_alive(node_id=node.pk) == {"b": 60}


@pytest.mark.django_db
def test_a_waiting_queue_adds_a_replica_elsewhere_up_to_the_maximum():
    registry_model("hot", max_replicas=2)
    first = node_with("n1", free=0)
    NodeModel.objects.create(node=first, model="hot", state="serving", on_demand=True)
    node_with("n2", free=NEED * 2)
    decision = on_demand.on_demand_scale(name="hot", why="waited")
    assert decision.node == "n2" and decision.changes[0].reason == "queue"
    NodeModel.objects.filter(model="hot").update(state="serving")
    node_with("n3", free=NEED * 2)
    assert on_demand.on_demand_scale(name="hot", why="waited") is None  # at its maximum


# --- the API and the admin -------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_patch_sets_the_on_demand_fields_and_get_shows_them(staff):
    model = registry_model("qwen", on_demand=False)
    answer = staff.patch(f"/api/models/{model.pk}/", {"on_demand": True, "min_replicas": 0, "max_replicas": 3,
                                                      "keep_alive_s": 120}, format="json")
    assert answer.status_code == 200, answer.content
    shown = staff.get(f"/api/models/{model.pk}/").json()
    assert (shown["on_demand"], shown["min_replicas"], shown["max_replicas"], shown["keep_alive_s"]) == \
        (True, 0, 3, 120)


@pytest.mark.django_db
@pytest.mark.parametrize("body, words", [
    ({"min_replicas": 3, "max_replicas": 2}, "0 <= min_replicas <= max_replicas"),
    ({"max_replicas": 0}, "greater than or equal to 1"),
    ({"keep_alive_s": 0}, "greater than or equal to 1"),
    ({"keep_alive_s": 10**9}, "keep_alive_s must be from 1"),
    ({"on_demand": "maybe"}, "valid boolean"),
    ({"name": "renamed"}, "read-only"),
])
def test_bad_on_demand_settings_are_400s_that_say_what_to_change(staff, body, words):
    model = registry_model("qwen")
    answer = staff.patch(f"/api/models/{model.pk}/", body, format="json")
    assert answer.status_code == 400 and words in answer.content.decode(), answer.content


@pytest.mark.django_db
def test_an_adapter_cannot_be_on_demand(staff):
    base = registry_model("qwen")
    adapter = Model.objects.create(name="style", sha256="cd" * 32, size=10, architecture="llama", quantization="F32",
                                   context_length=0, kv_bytes_per_token=0, kind=Model.Kind.ADAPTER, base=base)
    answer = staff.patch(f"/api/models/{adapter.pk}/", {"on_demand": True}, format="json")
    assert answer.status_code == 400 and "put the base on demand" in answer.json()["detail"]


@pytest.mark.django_db
def test_turning_on_demand_off_unloads_what_the_head_loaded(staff):
    model = registry_model("qwen")
    node = node_with("n1", free=0)
    NodeModel.objects.create(node=node, model="qwen", state="serving", on_demand=True)
    assert staff.patch(f"/api/models/{model.pk}/", {"on_demand": False}, format="json").status_code == 200
    assert node_deployments(node_id=node.pk) == []
    assert LinkEvent.objects.get(node=node).detail == "qwen: the model is no longer on demand"


@pytest.mark.django_db
def test_the_admin_edits_the_on_demand_settings_and_refuses_bad_ones(client):
    model = registry_model("qwen", on_demand=False)
    client.force_login(UserFactory(username="operator"))
    url = f"/admin/nodes/model/{model.pk}/change/"
    bad = client.post(url, {"on_demand": "on", "min_replicas": "2", "max_replicas": "1", "keep_alive_s": "60"})
    assert bad.status_code == 200 and "min_replicas" in bad.content.decode()
    good = client.post(url, {"on_demand": "on", "min_replicas": "0", "max_replicas": "2", "keep_alive_s": "60"})
    assert good.status_code == 302
    model.refresh_from_db()
    assert model.on_demand and model.max_replicas == 2


# --- what a client sees ------------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
async def test_a_model_that_fits_nowhere_is_a_503_with_the_figures_in_each_apis_shape(bearer):
    from asgiref.sync import sync_to_async

    await sync_to_async(registry_model)("big")
    await sync_to_async(node_with)("gpu-1", free=0.2 * GB)
    body = {"model": "big", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    openai_style = await request("POST", "/v1/chat/completions", key=bearer, body=body)
    assert openai_style.status == 503, openai_style.body
    error = openai_style.json()["error"]
    assert error["code"] == "model_cannot_fit" and error["type"] == "server_error"
    assert "no node has room" in error["message"] and "gpu-1 0.20 GB free" in error["message"]
    anthropic_style = await request("POST", "/v1/messages", key=bearer, body=body)
    answer = anthropic_style.json()
    assert answer["type"] == "error" and "no node has room" in answer["error"]["message"]
    assert set(answer["error"]) == {"type", "message"}


@pytest.mark.django_db(transaction=True)
async def test_v1_models_lists_an_on_demand_model_no_node_serves_and_not_a_plain_registry_one(bearer):
    """A client that picks a model from /v1/models (as agents do) finds the on-demand ones: asking loads them."""
    from asgiref.sync import sync_to_async

    await sync_to_async(registry_model)("qwen")
    await sync_to_async(registry_model)("stored-only", on_demand=False)
    listed = await request("GET", "/v1/models", key=bearer)
    assert listed.status == 200
    assert [m["id"] for m in listed.json()["data"]] == ["qwen"]
    assert (await request("GET", "/v1/models/qwen", key=bearer)).status == 200
    assert (await request("GET", "/v1/models/stored-only", key=bearer)).status == 404


@pytest.mark.django_db
def test_the_live_page_says_why_a_model_is_loading_on_demand():
    from nodes.selectors import node_models_preparing

    registry_model("qwen")
    node = node_with("roomy", free=NEED * 3)
    on_demand.on_demand_place(name="qwen")
    assert node_models_preparing()[node.pk] == [{"model": "qwen", "state": "pulling", "progress": 0.0, "percent": 0,
                                                  "why": "on demand: a request found no node serving it"}]


@pytest.mark.django_db(transaction=True)
async def test_one_more_replica_is_asked_for_when_the_p50_wait_passes_the_setting(monkeypatch, settings):
    from fleet import loading

    settings.FLEET_ON_DEMAND_SCALE_WAIT_S, settings.FLEET_ON_DEMAND_SCALE_WINDOW_S = 2.0, 30
    asked = []
    monkeypatch.setattr(loading.on_demand, "on_demand_scale", lambda **kw: asked.append(kw) or None)
    for seconds in (0.1, 0.2, 0.1):  # placed quickly over the last window
        loading.waited("hot", seconds)
    await loading.ascale("hot", 2.5)  # one waits long, but the p50 (0.15 s with it) is below 2 s
    assert asked == []
    for seconds in (3.0, 4.0, 3.5):
        loading.waited("hot", seconds)
    await loading.ascale("hot", 1.0)  # p50 is past 2 s, but this one has not waited 2 s
    assert asked == []
    await loading.ascale("hot", 2.5)
    assert [kw["name"] for kw in asked] == ["hot"] and "waited 2.5 s" in asked[0]["why"]
    await loading.ascale("hot", 9.0)  # at most once every SCALE_EVERY_S from this process
    assert len(asked) == 1


@pytest.mark.django_db(transaction=True)
async def test_a_request_waiting_for_a_load_still_ends_at_its_deadline_saying_so(bearer):
    from asgiref.sync import sync_to_async

    await sync_to_async(registry_model)("qwen")
    await sync_to_async(node_with)("roomy", free=NEED * 3)  # room, but its load never comes here (no such node)
    body = {"model": "qwen", "max_tokens": 4, "deadline_ms": 500, "messages": [{"role": "user", "content": "Hi"}]}
    answer = await request("POST", "/v1/chat/completions", key=bearer, body=body)
    assert answer.status == 503, answer.body
    error = answer.json()["error"]
    assert error["code"] == "deadline_exceeded" and "was still loading on demand on 'roomy'" in error["message"]
    assert await sync_to_async(NodeModel.objects.filter(model="qwen", on_demand=True, node__identity="roomy").exists)()


@pytest.fixture
def fast_sse(monkeypatch):
    monkeypatch.setattr("api.sse.HEADER_WAIT_S", 0.05)
    monkeypatch.setattr("api.sse.KEEPALIVE_S", 0.05)


@pytest.mark.django_db(transaction=True)
async def test_a_stream_keeps_alive_while_its_model_loads_then_runs_there_and_its_record_says_it_waited(
        bearer, fast_sse, exported):
    from asgiref.sync import sync_to_async

    from sessions.models import Generation

    await sync_to_async(registry_model)("qwen")
    node = await sync_to_async(node_with)("roomy", free=NEED * 3)
    body = {"model": "qwen", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    ex = await start("POST", "/v1/chat/completions", key=bearer, body=body)
    await ex.wait(lambda e: e.body.count(b": keep-alive") >= 2)  # waiting for the load, the client hears from us
    assert not any(c["choices"][0]["delta"].get("content") for c in ex.data() if c["choices"])  # no token yet
    add_fake_node(FakeLink(node_id=str(node.pk), identity="roomy"), model="qwen")  # the node serves it now
    await ex.wait(lambda e: e.finished)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in ex.data()[:-1] if c["choices"]) == \
        "Hello, world!"
    (record,) = await written_rows(lambda: list(Generation.objects.filter(model="qwen").values("placement",
                                                                                                "status")))
    loading = record["placement"]["queue"]["loading"]
    assert record["status"] == "done" and loading["node"] == "roomy" and loading["ms"] > 0
    queue = next(span for span in exported.get_finished_spans() if span.name == "fleet.queue")
    assert [(e.name, e.attributes["fleet.node"]) for e in queue.events][:1] == [("fleet.loading", "roomy")]

    # the node fills up; its last heartbeat (a second old) has not seen that generation: qwen is not the one to go
    from fleet import loading as head_loading

    for name in ("older", "third"):
        await sync_to_async(registry_model)(name)
    await sync_to_async(NodeModel.objects.filter(model="qwen").update)(state="serving")
    await sync_to_async(NodeModel.objects.create)(node=node, model="older", state="serving", on_demand=True)
    await sync_to_async(node_with)("full", free=0)  # a second node, full, with nothing to unload
    cache.set(liveness_key(str(node.pk)), {"memory_free": int(NEED * 0.5), "on_demand": True, "at": time.time() - 1,
                                           "models": {"qwen": {"lanes_busy": 0, "idle_s": 300},
                                                      "older": {"lanes_busy": 0, "idle_s": 100}}}, 60)
    decision = await head_loading.aload("third")
    assert [c.model for c in decision.changes if not c.loaded] == ["older"]


@pytest.mark.django_db(transaction=True)
async def test_an_anthropic_stream_pings_while_its_model_loads_and_ends_with_why_at_its_deadline(bearer, fast_sse):
    from asgiref.sync import sync_to_async

    await sync_to_async(registry_model)("qwen")
    await sync_to_async(node_with)("roomy", free=NEED * 3)
    body = {"model": "qwen", "max_tokens": 4, "stream": True, "deadline_ms": 600,
            "messages": [{"role": "user", "content": "Hi"}]}
    ex = await request("POST", "/v1/messages", key=bearer, body=body)
    names = [line[len("event: "):] for block in ex.events() for line in block.split("\n")
             if line.startswith("event: ")]
    assert "ping" in names and names[-1] == "error", names
    error = json.loads(ex.events()[-1].split("data: ", 1)[1])
    assert error["type"] == "error" and "still loading on demand on 'roomy'" in error["error"]["message"]


@pytest.mark.django_db(transaction=True)
async def test_generations_waiting_for_a_load_do_not_ask_the_database_at_every_wake(monkeypatch):
    from fleet import loading

    asked = []
    monkeypatch.setattr(loading.on_demand, "on_demand_place",
                        lambda **kw: asked.append(kw["name"]) or on_demand.Decision(node="roomy"))
    for _ in range(5):  # five waiters woken at once, or one woken five times
        assert (await loading.aload("qwen")) is not None
    assert asked == ["qwen"]
    monkeypatch.setattr(loading, "LOOK_AGAIN_S", 0.0)
    await loading.aload("qwen")
    assert asked == ["qwen", "qwen"]


@pytest.mark.django_db(transaction=True)
async def test_a_generation_sent_to_a_model_its_node_just_unloaded_waits_for_it_to_load_again(bearer):
    from asgiref.sync import sync_to_async

    from fleet.links import registry
    from sessions.models import Generation
    from tests.api_support import Script

    await sync_to_async(registry_model)("qwen")
    gone = await sync_to_async(node_with)("unloading", free=0)
    roomy = await sync_to_async(node_with)("roomy", free=NEED * 3)

    def unloaded(spec):  # the node let qwen go (made room for another) as this generation reached it
        registry().placement.node_models(str(gone.pk), ["other"], 2)
        return Script(error=("engine_unavailable", "this node unloaded 'qwen'; place it on a node serving it"))
    add_fake_node(FakeLink(node_id=str(gone.pk), identity="unloading", script=unloaded), model="qwen")
    body = {"model": "qwen", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    ex = await start("POST", "/v1/chat/completions", key=bearer, body=body)
    pair = NodeModel.objects.filter(model="qwen", node__identity="roomy", on_demand=True)
    for _ in range(100):  # it went back to qwen's queue, where a node with room is loading it
        if await sync_to_async(pair.exists)():
            break
        await asyncio.sleep(0.05)
    add_fake_node(FakeLink(node_id=str(roomy.pk), identity="roomy"), model="qwen")
    await ex.wait(lambda e: e.finished)
    assert ex.status == 200 and ex.json()["choices"][0]["message"]["content"] == "Hello, world!"
    (record,) = await written_rows(lambda: list(Generation.objects.filter(model="qwen").values("nodes_used")))
    assert record["nodes_used"] == ["unloading", "roomy"]


@pytest.mark.django_db
def test_a_generations_timeline_shows_its_wait_for_an_on_demand_load():
    from sessions.selectors import generation_timeline
    from tests.factories import GenerationFactory

    generation = GenerationFactory(model="qwen")
    start = generation.created_at.timestamp()
    generation.placement = {"node": "roomy", "placed_at": start + 3.2, "cost": 0, "ranking": [],
                            "queue": {"priority": "normal", "position": 0, "waited_ms": 3200,
                                      "loading": {"node": "roomy", "since": start + 0.01, "ms": 3190}}}
    steps = [(e["what"], e["detail"]) for e in generation_timeline(generation=generation)]
    assert ("loading", "qwen loading on demand on roomy: 3190 ms") in steps
    assert [what for what, _ in steps][:3] == ["queued", "loading", "placed"]


@pytest.mark.django_db
def test_a_nodes_claim_of_room_is_capped_by_its_gpus_and_a_node_whose_loads_failed_comes_last():
    """A token holder's heartbeat claimed a petabyte free and became the first choice for every load: the claim
    counts at most its GPUs' memory as it reported them at join, and a node whose load of any model failed lately
    is chosen after every other that fits."""
    registry_model("qwen")
    registry_model("llama3")
    gpu = {"backend": "cuda", "devices": [{"name": "RTX 4090", "total": int(NEED * 2), "free": int(NEED * 2)}]}
    node_with("liar", free=10**15, device=gpu)
    honest = node_with("honest", free=NEED * 3)
    assert on_demand.on_demand_place(name="qwen").node == "honest"
    from nodes.models import NodeModel

    failing = node_with("failing", free=NEED * 5)
    NodeModel.objects.create(node=failing, model="qwen", on_demand=True, state=NodeModel.State.LOADING)
    on_demand.on_demand_failed(node_id=honest.pk, model="qwen", detail="out of memory")  # each failed to load qwen
    on_demand.on_demand_failed(node_id=failing.pk, model="qwen", detail="out of memory")
    assert on_demand.on_demand_place(name="llama3").node == "liar"  # every node that fits but the two that failed
