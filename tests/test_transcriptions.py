"""/v1/audio/transcriptions on the head, with fake node links: what placement does with a transcription, what the
node is sent (the audio by hash, never its bytes), and the errors a client can cause. (Real node:
test_transcriptions_e2e.)"""

from __future__ import annotations

import hashlib
import uuid

import numpy as np
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from nodes.blobs import blob_path
from tests.api_support import FakeLink, Script, add_fake_node, request
from tests.factories import UserFactory
from tests.speech import write_wav

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/v1/audio/transcriptions"
SPEECH = ["chat", "completion", "transcribe"]


@pytest.fixture(autouse=True)
def _home(settings, tmp_path):
    settings.FLEET_HOME = tmp_path


@pytest.fixture
def wav_bytes(tmp_path) -> bytes:
    return write_wav(tmp_path / "quiet.wav", np.zeros(1600, dtype=np.int16)).read_bytes()


def form(fields: dict[str, str], file: bytes, name: str = "speech.wav") -> tuple[bytes, dict[str, str]]:
    """A multipart/form-data body as the openai client sends it."""
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
                 "Content-Type: application/octet-stream\r\n\r\n".encode() + file + b"\r\n")
    headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), headers


async def transcribe(bearer: str, file: bytes, **fields: str):
    body, headers = form({"model": "whisper-tiny.en", **fields}, file)
    return await request("POST", URL, key=bearer, raw=body, headers=headers)


async def test_the_node_gets_the_audio_by_hash_with_a_grant_and_the_head_keeps_it_once(bearer, wav_bytes):
    link = add_fake_node(FakeLink(script=Script(tokens=[" Hi", " there"])), model="whisper-tiny.en",
                         capabilities=SPEECH)
    for _ in range(2):
        answer = await transcribe(bearer, wav_bytes, language="en")
        assert answer.status == 200, answer.chunks
    sha256 = hashlib.sha256(wav_bytes).hexdigest()
    audio = link.specs[0]["audio"]
    assert audio["sha256"] == sha256 and audio["size"] == len(wav_bytes) and audio["grant"]
    assert audio["path"] == f"/models/blobs/{sha256}"
    assert link.specs[0]["transcribe"]["language"] == "en"
    assert blob_path(sha256).read_bytes() == wav_bytes
    assert [p.name for p in blob_path(sha256).parent.iterdir() if p.is_file()] == [sha256]  # stored once


async def test_with_no_node_that_transcribes_it_is_a_400_naming_the_capability(bearer, wav_bytes):
    link = add_fake_node(FakeLink(identity="text-only"), model="whisper-tiny.en", capabilities=["chat"])
    answer = await transcribe(bearer, wav_bytes)
    assert answer.status == 400
    error = answer.json()["error"]
    assert error["code"] == "capability_unavailable" and error["param"] == "transcribe"
    assert "text-only" in error["message"] and "--transcribe" in error["message"]
    assert not link.specs


async def test_a_model_no_node_serves_is_a_404(bearer, wav_bytes):
    add_fake_node(FakeLink(), model="whisper-tiny.en", capabilities=SPEECH)
    body, headers = form({"model": "whisper-large"}, wav_bytes)
    answer = await request("POST", URL, key=bearer, raw=body, headers=headers)
    assert answer.status == 404 and answer.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": "xml"}, "response_format"),
    ({"temperature": "hot"}, "temperature"),
    ({"timestamp_granularities[]": "word"}, "timestamp_granularities"),  # only with verbose_json
])
async def test_a_wrong_field_is_a_400_naming_it(bearer, wav_bytes, fields, param):
    answer = await transcribe(bearer, wav_bytes, **fields)
    assert answer.status == 400 and answer.json()["error"]["param"] == param


async def test_json_instead_of_a_form_is_a_415(bearer):
    answer = await request("POST", URL, key=bearer, body={"model": "whisper-tiny.en"})
    assert answer.status == 415 and "multipart/form-data" in answer.json()["error"]["message"]


async def test_a_node_that_fails_before_the_first_segment_is_failed_over(bearer, wav_bytes):
    crashing = add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "crashing",
                                      script=Script(error=("engine_crashed", "the worker died"))),
                             model="whisper-tiny.en", lanes=4, capabilities=SPEECH)  # idler: placed there first
    steady = add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "steady",
                                    script=Script(tokens=[" Hello", " again"])),
                           model="whisper-tiny.en", lanes=1, capabilities=SPEECH)
    answer = await transcribe(bearer, wav_bytes, response_format="text")
    assert answer.status == 200 and answer.headers["x-fleet-node"] == "steady"
    assert b"".join(answer.chunks).decode() == "Hello again\n"
    assert len(crashing.specs) == 1 and steady.specs[0]["audio"] == crashing.specs[0]["audio"]


def session_post(client, wav_bytes: bytes, **headers: str):
    return client.post(URL, {"model": "whisper-large", "file": SimpleUploadedFile("speech.wav", wav_bytes)},
                       headers=headers)


def test_the_playground_s_staff_session_may_transcribe_with_its_csrf_token_and_nothing_else_may(wav_bytes):
    """No key: the admin playground's staff session, with the page's CSRF token (another site cannot ride it)."""
    client = Client(enforce_csrf_checks=True)
    assert session_post(client, wav_bytes).json()["error"]["code"] == "missing_api_key"
    client.force_login(UserFactory(is_staff=False))
    refused = session_post(client, wav_bytes)
    assert refused.status_code == 403 and "Only staff users" in refused.json()["error"]["message"]
    client.force_login(UserFactory(is_staff=True))
    refused = session_post(client, wav_bytes)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "csrf_failed"
    token = client.get("/admin/playground/").context["csrf_token"]
    answer = session_post(client, wav_bytes, X_CSRFToken=str(token))
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"  # past the session check


async def test_a_streamed_transcription_keeps_the_connection_alive_until_its_first_segment(bearer, wav_bytes,
                                                                                           monkeypatch):
    monkeypatch.setattr("api.sse.HEADER_WAIT_S", 0.05)
    monkeypatch.setattr("api.sse.KEEPALIVE_S", 0.05)
    add_fake_node(FakeLink(script=Script(tokens=[" Hi", " there"], per_batch=1, start_delay=0.3)),
                  model="whisper-tiny.en", capabilities=SPEECH)
    answer = await transcribe(bearer, wav_bytes, stream="true")
    body = b"".join(answer.chunks).decode()
    assert answer.status == 200 and answer.headers["content-type"].startswith("text/event-stream")
    assert body.index(": keep-alive") < body.index("transcript.text.delta")  # a long file's first segment takes time
    assert body.count('"type":"transcript.text.delta"') == 2 and '"text":"Hi there"' in body
    assert body.rstrip().endswith("data: [DONE]")
