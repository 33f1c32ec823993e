"""Images in /v1/chat/completions on the head: what a node is sent (the image by hash, with a grant), where it is
placed (only on nodes with `vision`), and a 400 that says what is wrong for every bad image."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.server
import threading

import pytest

from nodes.blobs import blob_path
from nodes.link.prefix import prefix_keys
from tests.api_support import FakeLink, Script, add_fake_node, request
from tests.vision_projector import png

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/v1/chat/completions"
VISION = ["chat", "completion", "vision"]


@pytest.fixture(autouse=True)
def _home(settings, tmp_path):
    settings.FLEET_HOME = tmp_path


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(url: str, *, role: str = "user", part_type: str = "image_url") -> dict:
    image = {"type": part_type, "image_url": url if part_type == "input_image" else {"url": url}}
    return {"model": "smollm2", "max_tokens": 4,
            "messages": [{"role": role, "content": [{"type": "text", "text": "What is it?"}, image]}]}


async def error_of(bearer: str, body: dict) -> dict:
    answer = await request("POST", URL, key=bearer, body=body)
    assert answer.status == 400, answer.chunks
    return answer.json()["error"]


async def test_the_node_gets_the_image_by_hash_with_a_grant_and_the_head_keeps_it_once(bearer):
    link = add_fake_node(FakeLink(script=Script(tokens=[" A", " cat"])), capabilities=VISION)
    image = png()
    for _ in range(2):
        answer = await request("POST", URL, key=bearer, body=chat(data_url(image)))
        assert answer.status == 200, answer.chunks
    sha256 = hashlib.sha256(image).hexdigest()
    text, part = link.specs[0]["messages"][-1]["content"]
    assert text == {"type": "text", "text": "What is it?"}
    assert part["type"] == "image" and part["image"]["sha256"] == sha256 and part["image"]["size"] == len(image)
    assert part["image"]["path"] == f"/models/blobs/{sha256}" and part["image"]["grant"]
    assert blob_path(sha256).read_bytes() == image
    assert [p.name for p in blob_path(sha256).parent.iterdir() if p.is_file()] == [sha256]  # stored once


async def test_the_responses_shape_input_image_is_read_too(bearer):
    link = add_fake_node(FakeLink(script=Script(tokens=[" A"])), capabilities=VISION)
    answer = await request("POST", URL, key=bearer, body=chat(data_url(png()), part_type="input_image"))
    assert answer.status == 200, answer.chunks
    assert link.specs[0]["messages"][-1]["content"][1]["type"] == "image"


async def test_an_image_goes_only_to_a_node_with_vision(bearer):
    # Two nodes, each with its own id; on a tie placement takes the one named first: the text-only one.
    text_only = add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "a-text-only",
                                       script=Script(tokens=[" no"])), capabilities=["chat"])
    seeing = add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "b-seeing",
                                    script=Script(tokens=[" yes"])), capabilities=VISION)
    for _ in range(3):
        answer = await request("POST", URL, key=bearer, body=chat(data_url(png())))
        assert answer.status == 200, answer.chunks
    assert len(seeing.specs) == 3 and not text_only.specs
    text = {"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "What is it?"}]}
    assert (await request("POST", URL, key=bearer, body=text)).status == 200
    assert len(text_only.specs) == 1  # it was there all along, and takes what needs no vision


async def test_with_no_node_that_has_vision_it_is_a_400_naming_the_capability_and_the_flag(bearer):
    add_fake_node(FakeLink(identity="text-only"), capabilities=["chat"])
    error = await error_of(bearer, chat(data_url(png())))
    assert error["code"] == "capability_unavailable" and error["param"] == "vision"
    assert "--mmproj" in error["message"] and "text-only" in error["message"]


async def test_an_image_of_a_type_the_node_does_not_read_is_a_400_naming_the_types(bearer, fake_node):
    webp = b"RIFF\x1a\x00\x00\x00WEBPVP8 " + bytes(20)
    error = await error_of(bearer, chat(data_url(webp, "image/webp")))
    assert error["code"] == "unsupported_image_format" and error["param"] == "messages[0].content[1]"
    assert "png, jpeg, gif, bmp" in error["message"]


async def test_an_image_whose_header_is_cut_off_is_a_400(bearer, fake_node):
    error = await error_of(bearer, chat(data_url(png()[:14])))
    assert error["code"] == "invalid_image" and "could not be decoded" in error["message"]


async def test_a_payload_that_is_not_base64_is_a_400(bearer, fake_node):
    error = await error_of(bearer, chat("data:image/png;base64,not*base64!"))
    assert error["code"] == "invalid_image" and "base64" in error["message"]


async def test_an_image_over_the_byte_limit_is_a_400_naming_the_setting(bearer, fake_node, settings):
    settings.FLEET_MAX_IMAGE_BYTES = 1000
    error = await error_of(bearer, chat(data_url(png(64, 64))))
    assert error["code"] == "image_too_large" and "FLEET_MAX_IMAGE_BYTES" in error["message"]


async def test_an_image_a_byte_over_the_limit_is_a_400_and_one_at_it_is_taken(bearer, settings):
    add_fake_node(FakeLink(script=Script(tokens=[" A"])), capabilities=VISION)
    image = png()
    settings.FLEET_MAX_IMAGE_BYTES = len(image) - 1
    error = await error_of(bearer, chat(data_url(image)))
    assert error["code"] == "image_too_large" and f"has {len(image)} bytes" in error["message"]
    settings.FLEET_MAX_IMAGE_BYTES = len(image)
    answer = await request("POST", URL, key=bearer, body=chat(data_url(image)))
    assert answer.status == 200, answer.chunks


async def test_an_image_over_the_pixel_limit_is_a_400_naming_the_setting(bearer, fake_node, settings):
    settings.FLEET_MAX_IMAGE_PIXELS = 100
    error = await error_of(bearer, chat(data_url(png(32, 24))))
    assert error["code"] == "image_too_large" and "32x24" in error["message"]
    assert "FLEET_MAX_IMAGE_PIXELS" in error["message"]


async def test_an_image_outside_a_user_message_is_a_400(bearer, fake_node):
    error = await error_of(bearer, chat(data_url(png()), role="system"))
    assert "user messages" in error["message"] and error["param"] == "messages[0].content[1]"


async def test_a_part_of_another_kind_is_a_400(bearer, fake_node):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}
    error = await error_of(bearer, body)
    assert error["param"] == "messages[0].content[0]" and "image_url" in error["message"]


class _Images(http.server.BaseHTTPRequestHandler):
    """A tiny image server on localhost: /cat.png is an image, /moved redirects to it."""

    release = threading.Event()  # /slow.png answers once this is set

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/slow.png":
            self.release.wait(30)
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        body = png()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def image_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def test_a_remote_url_is_a_400_while_the_setting_is_off(bearer, fake_node, image_server):
    error = await error_of(bearer, chat(f"{image_server}/cat.png"))
    assert error["code"] == "remote_url_not_allowed" and "FLEET_MEDIA_REMOTE_URLS" in error["message"]


async def test_a_remote_url_on_an_allowed_host_is_fetched_once_by_the_head(bearer, image_server, settings):
    settings.FLEET_MEDIA_REMOTE_URLS = {"127.0.0.1"}
    link = add_fake_node(FakeLink(script=Script(tokens=[" A"])), capabilities=VISION)
    answer = await request("POST", URL, key=bearer, body=chat(f"{image_server}/cat.png"))
    assert answer.status == 200, answer.chunks
    sha256 = hashlib.sha256(png()).hexdigest()
    assert link.specs[0]["messages"][-1]["content"][1]["image"]["sha256"] == sha256
    assert blob_path(sha256).read_bytes() == png()


async def test_a_slow_image_server_holds_up_its_own_request_only(bearer, image_server, settings):
    settings.FLEET_MEDIA_REMOTE_URLS = {"127.0.0.1"}
    _Images.release.clear()
    add_fake_node(FakeLink(script=Script(tokens=[" A"])), capabilities=VISION)
    slow = asyncio.ensure_future(request("POST", URL, key=bearer, body=chat(f"{image_server}/slow.png")))
    await asyncio.sleep(0.5)  # its fetch has begun
    models = await asyncio.wait_for(request("GET", "/v1/models", key=bearer), 8)  # the sync thread is free
    assert models.status == 200 and not slow.done()
    _Images.release.set()
    assert (await slow).status == 200


async def test_a_remote_url_that_redirects_is_not_followed(bearer, fake_node, image_server, settings):
    settings.FLEET_MEDIA_REMOTE_URLS = {"127.0.0.1"}
    error = await error_of(bearer, chat(f"{image_server}/moved"))
    assert error["code"] == "image_fetch_failed" and "redirected" in error["message"]


def test_placement_keys_tell_images_apart_and_match_the_same_image():
    def keys(sha256: str | None) -> list[str]:
        content = [{"type": "text", "text": "What is it?"}]
        if sha256:
            content.append({"type": "image", "image": {"sha256": sha256, "size": 1}})
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
        return [k.key for k in prefix_keys(space="smollm2", tokenize=lambda text: list(text.encode()), messages=chat)]

    cat, dog, text = keys("a" * 64), keys("b" * 64), keys(None)
    assert keys("a" * 64) == cat
    assert cat[0] == dog[0] == text[0]  # the system message before the images is shared
    assert cat[-1] != dog[-1] and cat[-1] != text[-1]
