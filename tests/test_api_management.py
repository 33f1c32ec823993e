"""The management API under /api/: credentials, nodes, sessions, handles, generations, fleet status, schema."""

import json

import pytest
from rest_framework.test import APIClient

from api.models import ApiKey
from api.services import api_key_create
from nodes.models import FleetToken, Node
from sessions.models import GrammarHandle, InferenceSession, LogitBiasHandle, Message
from tests.api_support import FakeLink, Script, add_fake_node, request
from tests.factories import GenerationFactory, NodeFactory, SessionFactory, UserFactory

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db


@pytest.fixture
def person():
    return UserFactory(is_staff=False, is_superuser=False)


@pytest.fixture
def client(person):
    """A client authenticated as an application developer would be: with their API key."""
    _, key = api_key_create(owner=person, name="dev")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return api


@pytest.fixture
def staff():
    api = APIClient()
    api.force_authenticate(UserFactory(username="operator"))
    return api


def test_the_api_needs_a_valid_key():
    assert APIClient().get("/api/sessions/").status_code in (401, 403)
    bad = APIClient()
    bad.credentials(HTTP_AUTHORIZATION="Bearer fk-0000.wrong")
    response = bad.get("/api/sessions/")
    assert response.status_code == 401 and "wrong or revoked" in response.json()["detail"]


def test_only_staff_mint_api_keys(client, person):
    """A key staff limited cannot mint another one (at the defaults, or at its own limits: quotas are per key)."""
    ApiKey.objects.filter(owner=person).update(requests_per_minute=1)
    refused = client.post("/api/keys/", {"name": "escape"}, format="json")
    assert refused.status_code == 403 and "staff" in refused.json()["detail"]
    assert ApiKey.objects.filter(owner=person).count() == 1


def test_api_keys_are_shown_once_and_revoking_one_locks_it_out(client, person, staff):
    created = staff.post("/api/keys/", {"name": "ci"}, format="json")
    assert created.status_code == 201 and created.json()["key"].startswith(created.json()["prefix"] + ".")
    ApiKey.objects.filter(pk=created.json()["id"]).update(owner=person)  # staff made it for the person
    listed = client.get("/api/keys/").json()["results"]
    assert {k["name"] for k in listed} == {"dev", "ci"} and all("key" not in k for k in listed)
    other = UserFactory(is_staff=False)
    api_key_create(owner=other, name="not mine")
    assert ApiKey.objects.count() == 3 and len(listed) == 2
    new = APIClient()
    new.credentials(HTTP_AUTHORIZATION=f"Bearer {created.json()['key']}")
    assert new.get("/api/keys/").status_code == 200
    assert client.delete(f"/api/keys/{created.json()['id']}/").status_code == 204
    assert new.get("/api/keys/").status_code == 401
    assert client.get(f"/api/keys/{created.json()['id']}/").status_code == 404  # gone from /api once revoked
    assert {k["name"] for k in client.get("/api/keys/").json()["results"]} == {"dev"}


def test_fleet_tokens_are_for_staff_and_show_their_secret_once(client, staff):
    assert client.get("/api/fleet-tokens/").status_code == 403
    assert client.post("/api/fleet-tokens/", {"name": "x"}, format="json").status_code == 403
    created = staff.post("/api/fleet-tokens/", {"name": "rack 4"}, format="json").json()
    assert created["token"].startswith(created["public_id"] + ".")
    assert "token" not in staff.get(f"/api/fleet-tokens/{created['id']}/").json()
    revoked = staff.post(f"/api/fleet-tokens/{created['id']}/revoke/").json()
    assert revoked["is_active"] is False and FleetToken.objects.get().revoked_at is not None
    assert staff.post(f"/api/fleet-tokens/{created['id']}/revoke/").json()["is_active"] is False  # twice: harmless
    assert staff.get(f"/api/fleet-tokens/{created['id']}/").status_code == 404  # gone from /api once revoked
    assert staff.get("/api/fleet-tokens/").json()["results"] == []
    assert staff.post("/api/fleet-tokens/", {"name": ""}, format="json").status_code == 400


def test_nodes_are_listed_and_operators_drain_cordon_and_uncordon_them(client, staff):
    node = NodeFactory(identity="gpu-7")
    listed = staff.get("/api/nodes/").json()["results"]
    assert [n["identity"] for n in listed] == ["gpu-7"] and listed[0]["state"] == "online"
    assert client.get("/api/nodes/").status_code == 403  # nodes are the operators' business
    assert client.post(f"/api/nodes/{node.id}/drain/").status_code == 403
    for verb, state in (("drain", "draining"), ("cordon", "cordoned"), ("uncordon", "online")):
        response = staff.post(f"/api/nodes/{node.id}/{verb}/")
        assert response.status_code == 200 and response.json()["state"] == state
        node.refresh_from_db()
        assert node.state == state
    assert staff.get(f"/api/nodes/{node.id}/").json()["identity"] == "gpu-7"


def test_sessions_are_created_read_listed_and_deleted_by_their_owner(client, person):
    created = client.post("/api/sessions/", {"model": "smollm2", "title": "Trip", "system_prompt": "Be brief.",
                                            "messages": [{"role": "user", "content": "Hi"},
                                                         {"role": "assistant", "content": "Hello"}]}, format="json")
    assert created.status_code == 201
    sid = created.json()["id"]
    SessionFactory()  # someone else's
    listed = client.get("/api/sessions/").json()["results"]
    assert [s["id"] for s in listed] == [sid] and listed[0]["message_count"] == 2
    detail = client.get(f"/api/sessions/{sid}/").json()
    assert [(m["role"], m["content"]) for m in detail["history"]] == [("user", "Hi"), ("assistant", "Hello")]
    assert client.get(f"/api/sessions/{sid}/messages/").json()["count"] == 2
    assert client.post("/api/sessions/", {"title": "no model"}, format="json").status_code == 400
    assert client.delete(f"/api/sessions/{sid}/").status_code == 204
    assert not InferenceSession.objects.filter(pk=sid).exists() and Message.objects.count() == 0


@pytest.mark.django_db(transaction=True)  # the record is written on a writer thread's connection: commit what it reads
def test_posting_a_message_continues_the_session(client, person):
    link = add_fake_node(FakeLink(script=lambda spec: Script(tokens=[f"turn {len(spec['messages'])}"])))
    session = InferenceSession.objects.create(model="smollm2", owner=person, system_prompt="Be brief.")
    first = client.post(f"/api/sessions/{session.id}/messages/", {"content": "Hi", "max_tokens": 5}, format="json")
    assert first.status_code == 200, first.content
    assert first.json()["message"] == {"role": "assistant", "content": "turn 2"}
    assert first.json()["node"] == "fake-node" and first.json()["finish_reason"] == "stop"
    second = client.post(f"/api/sessions/{session.id}/messages/", {"messages": [{"role": "user", "content": "And?"}]},
                         format="json")
    assert second.json()["message"]["content"] == "turn 4"
    assert link.specs[1]["max_tokens"] == 512 and link.specs[0]["max_tokens"] == 5
    stored = list(Message.objects.filter(session=session).values_list("role", "content"))
    assert stored == [("user", "Hi"), ("assistant", "turn 2"), ("user", "And?"), ("assistant", "turn 4")]
    assert client.post(f"/api/sessions/{session.id}/messages/", {}, format="json").status_code == 400
    wrong = client.post(f"/api/sessions/{session.id}/messages/", {"content": "x", "model": "gpt-x"}, format="json")
    assert wrong.status_code == 404 and wrong.json()["code"] == "model_not_found"


def test_grammar_handles_are_created_read_and_freed(client, person):
    made = client.post("/api/grammars/", {"kind": "json_schema", "name": "answer",
                                          "source": {"type": "object", "properties": {"ok": {"type": "boolean"}}}},
                       format="json")
    assert made.status_code == 201 and made.json()["source"]["type"] == "object"
    gbnf = client.post("/api/grammars/", {"kind": "gbnf", "source": 'root ::= "a"'}, format="json").json()
    bad = client.post("/api/grammars/", {"kind": "json_schema", "source": {"type": 12}}, format="json")
    assert bad.status_code == 400 and "schema" in bad.json()["detail"]
    assert client.post("/api/grammars/", {"kind": "gbnf", "source": "x ::= y"}, format="json").status_code == 400
    assert len(client.get("/api/grammars/").json()["results"]) == 2
    assert client.delete(f"/api/grammars/{gbnf['id']}/").status_code == 204
    assert client.get(f"/api/grammars/{gbnf['id']}/").status_code == 404  # gone from /api once freed
    assert client.delete(f"/api/grammars/{gbnf['id']}/").status_code == 404
    assert len(client.get("/api/grammars/").json()["results"]) == 1
    assert GrammarHandle.objects.get(pk=gbnf["id"]).freed_at is not None  # the record stays for the admin


def test_logit_bias_handles_are_created_checked_and_freed(client):
    made = client.post("/api/logit-biases/", {"bias": {"42": -100, "7": 2.5}}, format="json")
    assert made.status_code == 201 and made.json()["bias"] == {"42": -100.0, "7": 2.5}
    assert client.post("/api/logit-biases/", {"bias": {"x": 1}}, format="json").status_code == 400
    assert client.post("/api/logit-biases/", {"bias": {"1": 101}}, format="json").status_code == 400
    assert client.delete(f"/api/logit-biases/{made.json()['id']}/").status_code == 204
    assert client.get(f"/api/logit-biases/{made.json()['id']}/").status_code == 404  # gone from /api once freed
    assert LogitBiasHandle.objects.get().freed_at is not None


@pytest.mark.parametrize("body", [{}, {"name": "no bias"}, {"bias": None}, {"bias": [1, 2]}])
def test_a_logit_bias_handle_without_a_bias_map_is_a_400_naming_it(client, body):
    response = client.post("/api/logit-biases/", body, format="json")
    assert response.status_code == 400 and "bias" in response.json()
    assert not LogitBiasHandle.objects.exists()


def test_generations_are_listed_with_filters(client, person, staff):
    mine = InferenceSession.objects.create(model="smollm2", owner=person)
    a = GenerationFactory(session=mine, node=NodeFactory(identity="gpu-a"))
    GenerationFactory(session=mine, node=NodeFactory(identity="gpu-b"), status="failed", model="other")
    GenerationFactory()  # someone else's
    ids = lambda query: [g["id"] for g in client.get(f"/api/generations/{query}").json()["results"]]  # noqa: E731
    assert len(ids("")) == 2
    assert ids("?node=gpu-a") == [str(a.id)] == ids(f"?node={a.node_id}")
    assert ids("?status=done") == [str(a.id)] == ids("?model=smollm2")
    assert len(ids(f"?session={mine.id}")) == 2 and ids("?session=nope") == []
    assert client.get(f"/api/generations/{a.id}/").json()["node_identity"] == "gpu-a"
    assert len(staff.get("/api/generations/").json()["results"]) == 3


def test_a_generations_filter_with_a_nul_character_is_a_400_naming_it(client):
    response = client.get("/api/generations/?model=s%00x&node=gpu")
    assert response.status_code == 400  # PostgreSQL refuses NUL in a string: it was a 500 there (the API fuzzer)
    assert response.json() == {"model": "must not contain NUL characters"}


def test_fleet_status_counts_lanes_and_models(client):
    node = NodeFactory(identity="gpu-live", lanes=4)
    add_fake_node(FakeLink(node_id=str(node.id), identity="gpu-live"), lanes=4)
    NodeFactory(identity="gpu-gone", state=Node.State.OFFLINE)
    status = client.get("/api/fleet/").json()
    assert status["models"] == [{"name": "smollm2", "nodes": 1, "lanes": 4, "lanes_free": 4}]
    assert [n["identity"] for n in status["nodes"]] == ["gpu-live"]
    assert (status["lanes_total"], status["lanes_busy"], status["lanes_free"], status["queue_length"]) == (4, 0, 4, 0)


@pytest.mark.parametrize(("page", "schema"), [("/api/docs/", "/api/schema/"), ("/v1/docs/", "/v1/openapi.json")])
def test_schema_and_an_offline_docs_page(page, schema):
    """Swagger UI for each API, its scripts and styles served by the head itself (drf-spectacular-sidecar): an
    offline head's docs work, and nothing is fetched from a CDN. The browser test renders them."""
    import re

    described = APIClient().get(schema, {"format": "json"} if schema == "/api/schema/" else {})
    assert described.status_code == 200
    paths = json.loads(described.content)["paths"]
    assert ("/api/sessions/{id}/messages/" in paths) if page == "/api/docs/" else ("/v1/chat/completions" in paths)
    docs = APIClient().get(page)
    assert docs.status_code == 200 and f'url: "{schema}"'.encode() in docs.content
    assets = re.findall(rb'(?:src|href)="([^"]+)"', docs.content)
    assert any(asset.endswith(b"swagger-ui-bundle.js") for asset in assets)
    assert all(asset.startswith(b"/static/") for asset in assets), assets  # nothing from another host
    for asset in assets:
        assert APIClient().get(asset.decode()).status_code == 200, asset


@pytest.mark.django_db(transaction=True)
async def test_posting_a_message_with_stream_answers_in_sse(api_user, bearer):
    from asgiref.sync import sync_to_async

    add_fake_node(FakeLink(script=Script(tokens=["Sure", "."])))
    session = await sync_to_async(InferenceSession.objects.create)(model="smollm2", owner=api_user)
    ex = await request("POST", f"/api/sessions/{session.id}/messages/", key=bearer,
                       body={"content": "Go on", "stream": True})
    assert ex.status == 200, ex.body
    assert ex.headers["content-type"].startswith("text/event-stream")
    data = ex.data()
    assert data[-1] == "[DONE]"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in data[:-1]) == "Sure."
    stored = await sync_to_async(lambda: list(Message.objects.values_list("role", "content")))()
    assert stored == [("user", "Go on"), ("assistant", "Sure.")]
