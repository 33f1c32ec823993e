"""What the fuzzers (tests/test_fuzz_api.py) found, each pinned by a plain test: a request that once got a 5xx, broke
a node's link, or was answered in the wrong shape; and the descriptions the fuzzers check against."""

import json

import msgpack
import pytest
from django.test import RequestFactory
from django.urls import get_resolver
from rest_framework.test import APIClient

from api.errors import server_error
from api.services import api_key_create
from tests.api_support import request
from tests.factories import UserFactory

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"


def chat(*messages, **extra):
    return {"model": "smollm2", "messages": list(messages) or [{"role": "user", "content": "Hi"}], **extra}


def openai_error(ex, status):
    assert ex.status == status, ex.body
    body = ex.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# --- /v1 ------------------------------------------------------------------------------------------------------


async def test_a_role_that_is_not_a_string_is_a_400_not_a_500(bearer, fake_node):
    error = openai_error(await request("POST", CHAT, key=bearer, body=chat({"role": {}, "content": "x"})), 400)
    assert error["param"] == "messages[0].role"


@pytest.mark.parametrize("path, body", [
    (CHAT, chat()),
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/responses", {"input": "Hi"}),
    ("/v1/embeddings", {"input": "Hi"}),
])
async def test_a_model_name_with_a_nul_is_a_400_on_every_backend(bearer, fake_node, path, body):
    """schemathesis found a model name with a NUL as a 500 on PostgreSQL: the on-demand lookup and the record both
    failed on it."""
    from sessions.models import Generation

    error = openai_error(await request("POST", path, key=bearer, body={**body, "model": "smol\x00lm2"}), 400)
    assert error["param"] == "model" and "NUL" in error["message"]
    assert await Generation.objects.acount() == 0


async def test_a_model_name_with_a_nul_is_an_anthropic_400_on_messages(bearer, fake_node):
    body = {"model": "smol\x00lm2", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    answer = await request("POST", "/v1/messages", key=bearer, body=body)
    assert answer.status == 400, answer.body
    assert answer.json()["error"]["type"] == "invalid_request_error" and "NUL" in answer.json()["error"]["message"]


async def test_a_tool_call_without_a_function_object_is_a_400(bearer, fake_node):
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": "get_weather"}]}
    error = openai_error(await request("POST", CHAT, key=bearer, body=chat(call, {"role": "user", "content": "?"})),
                         400)
    assert error["param"] == "messages[0].tool_calls[0]"


async def test_earlier_tool_calls_reach_the_node_in_one_shape_the_link_can_carry(bearer, fake_node):
    arguments = {"city": "Oslo", "population": 10**30}  # msgpack cannot carry this number: it broke the link
    call = {"role": "assistant", "content": None, "extra": 1,
            "tool_calls": [{"id": "c1", "type": "function", "junk": [2**70],
                            "function": {"name": "get_weather", "arguments": arguments}}]}
    ex = await request("POST", CHAT, key=bearer, body=chat(call, {"role": "user", "content": "And now?"}))
    assert ex.status == 200, ex.body
    sent = fake_node.specs[0]["messages"][0]
    assert sent["tool_calls"] == [{"id": "c1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]
    assert json.loads(sent["content"]) == {"name": "get_weather", "arguments": arguments}
    msgpack.packb({k: v for k, v in sent.items() if k != "content"})


async def test_tool_calls_stored_in_a_session_reach_the_node_in_the_same_shape(bearer, api_user, fake_node):
    from asgiref.sync import sync_to_async

    from sessions.services import session_create

    call = {"id": "c1", "function": {"name": "f", "arguments": {"n": 10**30}}, "junk": {"k": 2**70}}
    session = await sync_to_async(session_create)(owner=api_user, model="smollm2", messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}])
    ex = await request("POST", CHAT, key=bearer, body=chat({"role": "user", "content": "Go on"},
                                                           session=str(session.id)))
    assert ex.status == 200, ex.body
    stored = fake_node.specs[0]["messages"][1]
    assert stored["tool_calls"] == [{"id": "c1", "type": "function",
                                     "function": {"name": "f", "arguments": json.dumps({"n": 10**30})}}]
    msgpack.packb(fake_node.specs[0]["messages"])


@pytest.mark.parametrize("token, status", [("999999999", 200), ("1000000000", 400), ("9" * 30, 400)])
async def test_logit_bias_token_ids_are_bounded(bearer, fake_node, token, status):
    ex = await request("POST", CHAT, key=bearer, body=chat(logit_bias={token: 5}))
    assert ex.status == status, ex.body
    if status == 400:
        assert ex.json()["error"]["param"] == "logit_bias" and "0 to 999999999" in ex.json()["error"]["message"]


async def test_an_unknown_v1_url_is_a_404_in_openais_shape(bearer):
    error = openai_error(await request("GET", "/v1/models/a\nb", key=bearer), 404)
    assert error["code"] == "not_found" and "/v1/openapi.json" in error["message"]
    assert openai_error(await request("GET", "/v1/nothing-here", key=bearer), 404)["code"] == "not_found"


async def test_a_wrong_method_on_v1_says_which_are_allowed(bearer):
    ex = await request("DELETE", CHAT, key=bearer)
    assert openai_error(ex, 405)["code"] == "method_not_allowed" and ex.headers["allow"] == "POST"


async def test_the_v1_description_is_served_without_a_key():
    ex = await request("GET", "/v1/openapi.json")
    assert ex.status == 200
    document = ex.json()
    assert document["openapi"].startswith("3.") and set(document["paths"]) == set(_v1_routes())


def _v1_routes() -> dict[str, set[str]]:
    """Every /v1 route the head serves, as an OpenAPI path (`<str:file_id>` -> `{file_id}`), with its methods."""
    import re

    from django.urls import URLPattern, URLResolver

    def walk(resolver, prefix=""):
        for pattern in resolver.url_patterns:
            if isinstance(pattern, URLResolver):
                yield from walk(pattern, prefix + str(pattern.pattern))
            elif isinstance(pattern, URLPattern):
                yield "/" + prefix + str(pattern.pattern), pattern.callback

    routes = {}
    for route, view in walk(get_resolver()):
        if route.startswith("/v1/") and route != "/v1/docs/":  # the page that renders the description, not the API
            path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)
            routes[path] = set(getattr(view, "methods", None) or ("GET",))
    return routes


def test_the_v1_description_lists_every_v1_route_with_methods_it_allows():
    """Every /v1 route is described (a 404 points clients at the description), and nothing it does not serve."""
    from api.openapi_v1 import v1_document

    routes, described = _v1_routes(), v1_document()["paths"]
    assert len(routes) >= 13 and set(described) == set(routes), set(routes) ^ set(described)
    for path, operations in described.items():
        assert {m.upper() for m in operations} <= routes[path], (path, set(operations), routes[path])


def test_a_bug_outside_the_views_is_a_500_in_each_apis_shape():
    assert get_resolver().resolve_error_handler(500) is server_error
    factory = RequestFactory()
    v1 = json.loads(server_error(factory.get("/v1/models")).content)
    assert v1["error"]["code"] == "internal_error" and v1["error"]["type"] == "server_error"
    api = server_error(factory.get("/api/sessions/"))
    assert api.status_code == 500 and json.loads(api.content) == {"detail": "Internal error; it has been logged."}


# --- /api -----------------------------------------------------------------------------------------------------


@pytest.fixture
def client(api_user):
    _, key = api_key_create(owner=api_user, name="dev")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return api


def test_an_unknown_api_url_is_a_404_in_drfs_shape(client):
    response = client.get("/api/grammars/not.a.uuid/")
    assert response.status_code == 404 and "/api/schema/" in response.json()["detail"]


@pytest.mark.parametrize("query, name", [("limit=ten", "limit"), ("limit=0", "limit"), ("limit=1001", "limit"),
                                         ("offset=-1", "offset"), ("offset=1.5", "offset"),
                                         (f"offset={10**20}", "offset")])
def test_a_bad_page_is_a_400_naming_the_parameter(client, query, name):
    response = client.get(f"/api/sessions/?{query}")
    assert response.status_code == 400 and name in response.json()
    assert client.get("/api/sessions/?limit=1000&offset=5").status_code == 200


def test_a_new_session_says_how_many_messages_it_holds(client):
    made = client.post("/api/sessions/", {"model": "smollm2", "messages": [{"role": "user", "content": "a"},
                                                                          {"role": "assistant", "content": "b"}]},
                       format="json")
    assert made.status_code == 201 and made.json()["message_count"] == 2
    assert client.get("/api/sessions/").json()["results"][0]["message_count"] == 2


@pytest.mark.parametrize("body, field", [
    ({"model": "smollm2", "messages": [{"role": "assistant", "tool_calls": [{"\x00id": {}}]}]}, "messages"),
    ({"model": "smollm2", "metadata": {"team": "a\x00b"}}, "metadata"),
])
def test_a_nul_character_in_stored_json_is_a_400_not_a_500(client, body, field):
    """PostgreSQL's jsonb refuses NUL characters: schemathesis found a tool call with one as a 500 there."""
    answer = client.post("/api/sessions/", body, format="json")
    assert answer.status_code == 400 and field in answer.json(), answer.content
    assert "NUL" in json.dumps(answer.json())


async def test_a_nul_character_in_a_parameter_does_not_lose_the_record(bearer, fake_node):
    from sessions.models import Generation

    answer = await request("POST", CHAT, key=bearer, body=chat(stop=["a\x00b"]))
    assert answer.status == 200
    record = await Generation.objects.aget()
    assert record.parameters["stop"] == ["a\ufffdb"]


def test_the_schema_documents_the_error_statuses_and_soft_deletes():
    staff = APIClient()
    staff.force_authenticate(UserFactory(username="operator"))
    schema = staff.get("/api/schema/?format=json").json()
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            documented = set(operation["responses"])
            assert {"401", "403", "429"} <= documented, (method, path)
            assert ("404" in documented) == ("{" in path), (method, path)
            if "requestBody" in operation:
                assert {"400", "413", "415"} <= documented, (method, path)
                # a model upload's part is raw bytes (api/model_registry.py); everything else takes JSON
                raw = (method, path) == ("put", "/api/models/uploads/{upload_id}/")
                expected = {"application/octet-stream"} if raw else {"application/json"}
                assert set(operation["requestBody"]["content"]) == expected, (method, path)
    for path in ("/api/keys/{id}/", "/api/fleet-tokens/{id}/", "/api/grammars/{id}/", "/api/logit-biases/{id}/"):
        assert "gone from /api" in schema["paths"][path]["delete"]["description"], path
    assert "for good" in schema["paths"]["/api/sessions/{id}/"]["delete"]["description"]


@pytest.mark.parametrize("body", [b"", b"\x00 a part's bytes"])
def test_options_on_an_uploads_url_is_answered_not_a_500(body):
    """DRF's OPTIONS asks the PUT route for its object to check permissions; the upload's route has no pk."""
    staff = APIClient()
    staff.force_authenticate(UserFactory(username="operator", is_staff=True))
    response = staff.generic("OPTIONS", "/api/models/uploads/0/?offset=0", data=body,
                             content_type="application/octet-stream")
    assert response.status_code == 200, response.content
    assert "PUT" in response["Allow"] and response.json()["name"]


# --- hostile input (issue 41): each was a 500, or a 502 after it broke the node's link ---------------------------


@pytest.mark.parametrize("raw", [
    b'{"model": "smollm2", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}",
    b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "stop": ["\\udfff"]}',
])
async def test_json_nested_too_deep_or_with_a_lone_surrogate_is_a_400(bearer, fake_node, raw):
    error = openai_error(await request("POST", CHAT, key=bearer, raw=raw), 400)
    assert error["code"] == "invalid_json" and ("nested" in error["message"] or "surrogate" in error["message"])
    assert fake_node.specs == []


def test_json_nested_too_deep_is_a_400_on_the_management_api_too(client):
    answer = client.post("/api/sessions/", b'{"model": "smollm2", "metadata": ' + b'{"a": ' * 1000 + b"1" +
                         b"}" * 1000 + b"}", content_type="application/json")
    assert answer.status_code == 400 and "nested" in answer.json()["detail"], answer.content


@pytest.mark.parametrize("depth", [15, 29, 31, 40])
async def test_a_deep_json_schema_is_a_400_or_served(bearer, fake_node, depth):
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}})
    ex = await request("POST", CHAT, key=bearer, body=body)
    assert ex.status in (200, 400), ex.body
    if ex.status == 400:
        openai_error(ex, 400)


@pytest.mark.parametrize("url", ["http://a\\b/x.png", "https://\\\\evil\\x.png", "http://[x/", "http://a b/"])
async def test_a_hostile_image_url_is_a_400(bearer, fake_node, settings, url):
    settings.FLEET_MEDIA_REMOTE_URLS = ["*"]
    part = {"type": "image_url", "image_url": {"url": url}}
    ex = await request("POST", CHAT, key=bearer, body=chat({"role": "user", "content": [part]}))
    error = openai_error(ex, 400)
    assert error["param"] == "messages[0].content[0]" and error["code"] == "invalid_image_url"  # not even fetched


async def test_a_prompt_too_large_for_a_link_frame_is_a_413_before_any_node(bearer, fake_node, settings):
    settings.FLEET_LINK_MAX_FRAME_BYTES = 256 * 1024  # the 4 MiB body limit's case, smaller
    body = {"model": "smollm2", "prompt": "x" * (300 * 1024), "max_tokens": 1}
    error = openai_error(await request("POST", "/v1/completions", key=bearer, body=body), 413)
    assert error["code"] == "request_too_large" and "FLEET_LINK_MAX_FRAME_BYTES" in error["message"]
    assert fake_node.specs == []


async def test_a_nul_character_in_a_session_turn_is_a_400_on_every_backend(bearer, api_user, fake_node):
    """PostgreSQL cannot store a NUL: the turn was answered (200) and then never stored."""
    from asgiref.sync import sync_to_async

    from sessions.models import Message
    from sessions.services import session_create

    session = await sync_to_async(session_create)(owner=api_user, model="smollm2", messages=[])
    ex = await request("POST", CHAT, key=bearer, body=chat({"role": "user", "content": "a\x00b"},
                                                           session=str(session.id)))
    assert openai_error(ex, 400)["param"] == "messages" and "NUL" in ex.json()["error"]["message"]
    assert fake_node.specs == [] and not await Message.objects.filter(session=session).aexists()


def test_the_management_schema_is_generated_without_a_warning(capsys):
    """drf-spectacular printed a warning on every hit of /api/docs/ (an unannotated path parameter)."""
    from drf_spectacular.generators import SchemaGenerator

    SchemaGenerator().get_schema(request=None, public=True)
    assert "Warning" not in capsys.readouterr().err


def test_the_schema_lets_a_generation_never_placed_have_no_node():
    """schemathesis' stateful run found a never-placed generation's `node_identity: null` against a schema that
    said string (ST108)."""
    staff = APIClient()
    staff.force_authenticate(UserFactory(username="operator"))
    schema = staff.get("/api/schema/?format=json").json()
    assert schema["components"]["schemas"]["Generation"]["properties"]["node_identity"].get("nullable") is True
