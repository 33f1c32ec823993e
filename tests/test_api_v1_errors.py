"""/v1 validation, auth and error shapes: every mistake a client can make gets OpenAI's error object and a 4xx."""

import pytest

from api.services import api_key_revoke
from tests.api_support import request
from tests.factories import GrammarHandleFactory, LogitBiasHandleFactory

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"


def chat(**extra):
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], **extra}


def error_of(ex, status):
    assert ex.status == status, ex.body
    body = ex.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("authorization, code", [
    (None, "missing_api_key"),
    ("Bearer fk-00000000.wrong", "invalid_api_key"),
    ("Basic dXNlcjpwdw==", "invalid_api_key"),
])
async def test_missing_or_wrong_key_is_a_401(authorization, code):
    headers = {"authorization": authorization} if authorization else {}
    error = error_of(await request("POST", CHAT, body=chat(), headers=headers), 401)
    assert error["code"] == code and error["type"] == "authentication_error"


async def test_revoked_key_is_a_401(api_key_pair, fake_node):
    from asgiref.sync import sync_to_async

    row, secret = api_key_pair
    assert (await request("POST", CHAT, key=secret, body=chat())).status == 200
    await sync_to_async(api_key_revoke)(key=row)
    assert error_of(await request("POST", CHAT, key=secret, body=chat()), 401)["code"] == "invalid_api_key"


async def test_wrong_content_type_is_a_415(bearer):
    ex = await request("POST", CHAT, key=bearer, raw=b"model=smollm2", headers={"content-type": "text/plain"})
    error = error_of(ex, 415)
    assert "application/json" in error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"'])
async def test_malformed_body_is_a_400(bearer, raw):
    error = error_of(await request("POST", CHAT, key=bearer, raw=raw), 400)
    assert error["code"] == "invalid_json"


async def test_get_on_a_generation_endpoint_is_a_405(bearer):
    assert error_of(await request("GET", CHAT, key=bearer), 405)["code"] == "method_not_allowed"


@pytest.mark.parametrize("body, param", [
    ({"model": "smollm2"}, "messages"),
    ({"model": "smollm2", "messages": []}, "messages"),
    ({"model": "smollm2", "messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "model"),
    ({"model": 7, "messages": [{"role": "user", "content": "Hi"}]}, "model"),
    (chat(max_tokens=-5), "max_tokens"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_completion_tokens=1.5), "max_completion_tokens"),
    (chat(n=2), "n"),
    (chat(temperature=3), "temperature"),
    (chat(temperature="hot"), "temperature"),
    (chat(top_p=-0.1), "top_p"),
    (chat(stop=["ok", ""]), "stop"),
    (chat(stop=5), "stop"),
    (chat(logit_bias={"abc": 1}), "logit_bias"),
    (chat(logit_bias={"12": 500}), "logit_bias"),
    (chat(top_logprobs=3), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    (chat(deadline_ms=0), "deadline_ms"),
    (chat(stream="yes"), "stream"),
    ({"model": "smollm2", "messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
    ({"model": "smollm2", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"model": "smollm2", "messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
    (chat(response_format={"type": "xml"}), "response_format"),
    (chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function",
                                                                                "function": {"name": "g"}}),
     "tool_choice"),
    (chat(grammar="root = nothing"), "grammar"),
    (chat(session="not-a-session"), "session"),
])
async def test_bad_parameters_are_400s_naming_the_parameter(bearer, body, param):
    error = error_of(await request("POST", CHAT, key=bearer, body=body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


async def test_invalid_json_schema_is_a_400(bearer):
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    error = error_of(await request("POST", CHAT, key=bearer, body=body), 400)
    assert error["code"] == "invalid_json_schema" and "schema" in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"model": "smollm2", "prompt": ""}, "prompt"),
    ({"model": "smollm2", "prompt": [1, 2, 3]}, "prompt"),
    ({"model": "smollm2", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "smollm2", "prompt": "x", "echo": True}, "echo"),
    ({"model": "smollm2", "prompt": "x", "logprobs": 50}, "logprobs"),
])
async def test_bad_completion_parameters_are_400s(bearer, body, param):
    assert error_of(await request("POST", "/v1/completions", key=bearer, body=body), 400)["param"] == param


async def test_unknown_model_is_a_404_naming_what_is_served(bearer, fake_node):
    error = error_of(await request("POST", CHAT, key=bearer, body={**chat(), "model": "gpt-17"}), 404)
    assert error["code"] == "model_not_found" and "gpt-17" in error["message"] and "smollm2" in error["message"]


async def test_a_missing_or_freed_handle_is_a_400(api_user, bearer, fake_node):
    from asgiref.sync import sync_to_async
    from django.utils import timezone

    freed = await sync_to_async(GrammarHandleFactory)(owner=api_user, freed_at=timezone.now())
    other_users = await sync_to_async(LogitBiasHandleFactory)()
    cases = [
        (chat(grammar=str(freed.id)), "grammar", "was freed"),
        (chat(grammar="6f1c2d3e-0000-4000-8000-000000000000"), "grammar", "no grammar handle"),
        (chat(logit_bias_handle=str(other_users.id)), "logit_bias_handle", "no logit-bias handle"),
    ]
    for body, param, words in cases:
        error = error_of(await request("POST", CHAT, key=bearer, body=body), 400)
        assert error["param"] == param and error["code"] == "handle_unavailable"
        assert words in error["message"].lower()


async def test_models_lists_what_the_fleet_serves(bearer, fake_node):
    ex = await request("GET", "/v1/models", key=bearer)
    assert ex.status == 200
    assert ex.json() == {"object": "list", "data": [{"id": "smollm2", "object": "model", "created": 0,
                                                     "owned_by": "fleet"}]}
    assert (await request("GET", "/v1/models/smollm2", key=bearer)).json()["id"] == "smollm2"
    assert error_of(await request("GET", "/v1/models/llama-9000", key=bearer), 404)["code"] == "model_not_found"

