"""Input limits: body size (413), messages per chat, max_tokens within the model's window, websocket frame size."""

import asyncio
import json

import pytest
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.test import override_settings

from tests.api_support import add_fake_node, request

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"


def chat(**extra):
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], **extra}


def openai_error(ex, status):
    assert ex.status == status, ex.body
    body = ex.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def padded(size: int) -> dict:
    """A chat body of about `size` bytes."""
    return chat(user="x" * size)


# --- body size ------------------------------------------------------------------------------------------------


@override_settings(FLEET_MAX_BODY_BYTES=2000)
async def test_a_v1_body_over_the_limit_is_a_413_in_openais_shape(bearer, fake_node):
    error = openai_error(await request("POST", CHAT, key=bearer, body=padded(3000)), 413)
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "2000 bytes" in error["message"] and "FLEET_MAX_BODY_BYTES" in error["message"]
    assert fake_node.specs == []
    assert (await request("POST", CHAT, key=bearer, body=padded(1500))).status == 200


@override_settings(FLEET_MAX_BODY_BYTES=2000)
async def test_an_api_body_over_the_limit_is_a_413_in_drfs_shape(bearer):
    ex = await request("POST", "/api/sessions/", key=bearer, body={"model": "smollm2", "title": "x" * 3000})
    assert ex.status == 413 and set(ex.json()) == {"detail"} and "2000 bytes" in ex.json()["detail"]
    assert (await request("POST", "/api/sessions/", key=bearer, body={"model": "smollm2"})).status == 201


@override_settings(FLEET_MAX_BODY_BYTES=2000)
async def test_a_chunked_body_without_a_length_is_counted_as_it_arrives(bearer, fake_node):
    sent = []
    status, body = await _chunked(CHAT, bearer, [b"{" + b" " * 999] * 3, sent)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert len(sent) == 3  # refused at the chunk that passed the limit, before the client finished
    status, body = await _chunked(CHAT, bearer, [json.dumps(chat())[:10].encode(), json.dumps(chat())[10:].encode()])
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "Hello, world!"


async def _chunked(path, key, chunks, sent=None):
    """POST `chunks` as a body without Content-Length (Transfer-Encoding: chunked); (status, body)."""
    from fleet.asgi import application

    pending, out, sent = list(chunks), {"body": b""}, sent if sent is not None else []

    async def receive():
        if pending:
            sent.append(pending.pop(0))
            return {"type": "http.request", "body": sent[-1], "more_body": bool(pending)}
        await asyncio.sleep(3600)

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        else:
            out["body"] += message.get("body", b"")
            out["done"] = not message.get("more_body")

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked"),
                         (b"authorization", f"Bearer {key}".encode())],
             "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}
    task = asyncio.ensure_future(application(scope, receive, send))
    for _ in range(500):
        if out.get("done"):
            break
        await asyncio.sleep(0.01)
    task.cancel()
    return out["status"], out["body"]


@override_settings(FLEET_MAX_BODY_BYTES=10_000, DATA_UPLOAD_MAX_MEMORY_SIZE=2000)
async def test_djangos_own_request_data_too_big_is_a_413_too(bearer, fake_node):
    error = openai_error(await request("POST", CHAT, key=bearer, body=padded(3000)), 413)
    assert error["code"] == "request_too_large" and "2000 bytes" in error["message"]
    form = await request("POST", "/api/sessions/", key=bearer, raw=b"model=smollm2&title=" + b"x" * 3000,
                         headers={"content-type": "application/x-www-form-urlencoded"})
    assert form.status == 413 and "2000 bytes" in form.json()["detail"]


# --- what a chat may ask for ----------------------------------------------------------------------------------


@override_settings(FLEET_MAX_MESSAGES=3)
async def test_more_messages_than_the_limit_is_a_400_naming_it(bearer, fake_node):
    many = [{"role": "user", "content": f"m{i}"} for i in range(4)]
    error = openai_error(await request("POST", CHAT, key=bearer, body=chat(messages=many)), 400)
    assert error["param"] == "messages" and error["code"] == "too_many_messages"
    assert "at most 3" in error["message"] and "FLEET_MAX_MESSAGES" in error["message"]
    assert (await request("POST", CHAT, key=bearer, body=chat(messages=many[:3]))).status == 200


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_beyond_the_models_window_is_a_400_naming_the_window(bearer, name):
    add_fake_node(context_window=1024)
    error = openai_error(await request("POST", CHAT, key=bearer, body=chat(**{name: 1025})), 400)
    assert error["param"] == name and "context window" in error["message"] and "1024 tokens" in error["message"]
    assert (await request("POST", CHAT, key=bearer, body=chat(**{name: 1024}))).status == 200


async def test_the_window_is_the_largest_among_the_nodes_serving_the_model(bearer):
    from tests.api_support import FakeLink

    add_fake_node(context_window=1024)
    add_fake_node(FakeLink(node_id="22222222-2222-2222-2222-222222222222", identity="big"), context_window=8192)
    add_fake_node(FakeLink(node_id="33333333-3333-3333-3333-333333333333", identity="other"), model="other",
                  context_window=65536)
    assert (await request("POST", CHAT, key=bearer, body=chat(max_tokens=8192))).status == 200
    error = openai_error(await request("POST", CHAT, key=bearer, body=chat(max_tokens=8193)), 400)
    assert "8192 tokens" in error["message"]


# --- the client websocket -------------------------------------------------------------------------------------


@override_settings(FLEET_MAX_BODY_BYTES=2000)
async def test_a_websocket_frame_over_the_limit_gets_an_error_frame_and_the_socket_goes_on(bearer, fake_node):
    from fleet.routing import websocket_urlpatterns

    comm = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/v1/generate",
                                 headers=[(b"authorization", f"Bearer {bearer}".encode())])
    assert (await comm.connect())[0]
    await comm.send_json_to({"type": "generate", "id": "big", **padded(3000)})
    error = await comm.receive_json_from(timeout=3)
    assert error["type"] == "error" and error["code"] == "message_too_large"
    assert "at most 2000" in error["message"] and "FLEET_MAX_BODY_BYTES" in error["message"]
    assert fake_node.specs == []
    await comm.send_json_to({"type": "generate", "id": "small", **chat()})
    frames = [await comm.receive_json_from(timeout=3) for _ in range(3)]
    assert frames[-1]["type"] == "done" and frames[-1]["id"] == "small"
    await comm.disconnect()


async def test_the_body_is_let_go_once_handed_on_though_the_app_keeps_a_cycle():
    # Django's request is a reference cycle that holds the receive callable. A body the wrapper still held through
    # it stayed in memory until a full garbage collection: 4 MB for each part of a model upload.
    import gc
    import tracemalloc

    from api.limits import body_limit

    mb = 1 << 20
    parts = ({"type": "http.request", "body": bytes(mb), "more_body": more} for more in (True, False))  # made traced
    kept = []

    async def receive():
        return next(parts)

    async def app(scope, replay, send):
        message = await replay()
        assert len(message["body"]) == 2 * mb
        cycle = {"receive": replay}
        cycle["self"] = cycle
        kept.append(len(cycle))

    gc.disable()
    tracemalloc.start()
    try:
        await body_limit(app)({"type": "http", "path": "/v1/chat/completions", "headers": []}, receive, None)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        gc.enable()
    assert kept == [2]
    assert held < mb // 2, f"{held} bytes still held after the request"
