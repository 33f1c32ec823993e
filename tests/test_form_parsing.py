"""The head's HTTP requests reach daphne with their body as sent and no form parsed by Twisted first
(fleet/form_parsing.py). A real Twisted HTTP channel parses the request bytes into daphne's own request class."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from daphne.http_protocol import WebRequest
from twisted.internet.testing import StringTransport
from twisted.web import http

from fleet.form_parsing import skip_form_parsing

BOUNDARY = b"fleet-boundary"
MULTIPART = (b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
             b"Content-Type: audio/wav\r\n\r\nRIFF....\r\n--" + BOUNDARY + b"--\r\n")


@pytest.fixture
def received(monkeypatch):
    """Feed raw HTTP request bytes to a Twisted channel making daphne's requests; the requests daphne got, and how
    often Twisted parsed a Content-Type."""
    import fleet.asgi  # noqa: F401 - the head as daphne loads it (which makes the change)

    seen: list[WebRequest] = []
    parses: list[bytes] = []
    original = http._parseContentType
    monkeypatch.setattr(http, "_parseContentType", lambda line: parses.append(line) or original(line))
    monkeypatch.setattr(WebRequest, "process", lambda self: seen.append(self))

    def feed(content_type: bytes, body: bytes) -> tuple[list[WebRequest], list[bytes]]:
        channel = http.HTTPChannel()
        channel.requestFactory = WebRequest
        channel.factory = SimpleNamespace(server=SimpleNamespace(protocol_connected=lambda request: None))
        channel.makeConnection(StringTransport())
        channel.dataReceived(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: head\r\nContent-Type: " + content_type
                             + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        return seen, parses

    return feed


def test_a_url_encoded_post_is_not_parsed_into_args(received):
    seen, parses = received(b"application/x-www-form-urlencoded", b"model=whisper&language=en")
    assert len(seen) == 1
    assert seen[0].args == {}
    assert parses == []
    seen[0].content.seek(0)
    assert seen[0].content.read() == b"model=whisper&language=en"  # what daphne hands the application


def test_a_multipart_upload_is_not_parsed_on_the_event_loop(received):
    seen, parses = received(b"multipart/form-data; boundary=" + BOUNDARY, MULTIPART)
    assert len(seen) == 1
    assert seen[0].args == {}
    assert parses == []
    seen[0].content.seek(0)
    assert seen[0].content.read() == MULTIPART


def test_installing_twice_wraps_once():
    import fleet.asgi  # noqa: F401 - installed once there already

    init = WebRequest.__init__
    assert skip_form_parsing()
    assert WebRequest.__init__ is init
