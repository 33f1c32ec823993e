"""A node's media cache (nodes.agent.media): a blob is fetched from the head once by its hash, checked, kept, and the
least recently used go past the cap. The head here is a small Range server over loopback."""

from __future__ import annotations

import hashlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nodes.agent.media import MediaCache, MediaError

BLOBS = {name: bytes([i]) * 1000 for i, name in enumerate(("a", "b", "c"), 1)}


class _Head(BaseHTTPRequestHandler):
    """Serves /blobs/<sha256> in Range requests, as /models/blobs/<sha256> does, and counts them."""

    by_hash = {hashlib.sha256(data).hexdigest(): data for data in BLOBS.values()}
    requests: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        data = self.by_hash.get(self.path.rsplit("/", 1)[-1], b"")
        first, last = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
        body = data[first:last + 1]
        self.requests.append(self.path)
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def head():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Head)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Head.requests = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def ref(data: bytes, sha256: str | None = None) -> dict:
    sha256 = sha256 or hashlib.sha256(data).hexdigest()
    return {"sha256": sha256, "size": len(data), "path": f"/blobs/{sha256}", "grant": "g"}


def test_a_blob_is_fetched_once_then_used_from_the_cache(head, tmp_path):
    cache = MediaCache(tmp_path)
    first = cache.get(head, ref(BLOBS["a"]))
    again = cache.get(head, ref(BLOBS["a"]))
    assert first == again and first.read_bytes() == BLOBS["a"]
    assert cache.fetched_bytes == len(BLOBS["a"]) and len(_Head.requests) == 1


def test_a_blob_that_does_not_match_its_hash_is_refused_and_not_kept(head, tmp_path):
    cache = MediaCache(tmp_path)
    wrong = {**ref(BLOBS["a"]), "sha256": hashlib.sha256(b"something else").hexdigest()}
    _Head.by_hash[wrong["sha256"]] = BLOBS["a"]  # the head answers with other bytes than the hash names
    with pytest.raises(MediaError, match="does not match"):
        cache.get(head, wrong)
    assert not list((tmp_path / "media").iterdir())


def test_past_its_cap_the_cache_drops_the_least_recently_used_blob(head, tmp_path):
    cache = MediaCache(tmp_path, cap=2500)  # room for two blobs of 1000 bytes
    a, b = cache.get(head, ref(BLOBS["a"])), cache.get(head, ref(BLOBS["b"]))
    time.sleep(0.02)  # modification times order the blobs' last uses
    cache.get(head, ref(BLOBS["a"]))  # a used again: b is now the least recently used
    time.sleep(0.02)
    c = cache.get(head, ref(BLOBS["c"]))
    assert a.exists() and c.exists() and not b.exists()
