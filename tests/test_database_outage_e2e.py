"""PostgreSQL away under streams (issue 50 item 3), with real processes: a daphne head on PostgreSQL and Redis, a
node on the bundled model, and the database behind a TCP relay this test cuts (every connection closed, new ones
refused) and then lets through again. Streams begun before go on to their last token, one that ends meanwhile has its
record written once the database is back, a new request meanwhile is answered or a clear 503, and the fleet serves
new requests within seconds of the database's return, with no restart. Runs in the PostgreSQL + Redis pass (it needs
DATABASE_URL's server and REDIS_URL)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from tests.live import _postgres_create, _postgres_drop, make_head, start_node, wait_for
from tests.test_shutdown_e2e import Streamed

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (os.environ.get("DATABASE_URL", "").startswith("postgres")
                                      and os.environ.get("REDIS_URL")),
                                 reason="needs PostgreSQL and Redis (DATABASE_URL, REDIS_URL): the backend pass")]

OUTAGE_S = 10.0
TOKENS = 60
SHORT = 12
STREAMS = 3


class Relay:
    """TCP from a local port to PostgreSQL, cut and restored at will (the database as a head sees an outage)."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.port = 0
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        """Close every connection and refuse new ones until `restore`."""
        listener, self._listener = self._listener, None
        with contextlib.suppress(OSError, AttributeError):  # shutdown wakes the accept waiting (close would not)
            listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:  # both ends closed, as a stopped PostgreSQL closes them (shutdown: a close alone leaves
            for sock in pair:  # a socket whose recv another thread waits in open, and the head's query hanging)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.close()


@pytest.fixture
def database():
    """A database of this test's own on DATABASE_URL's server, and a relay in front of it."""
    url = os.environ["DATABASE_URL"]
    name = f"fleet_outage_{uuid.uuid4().hex[:8]}"
    direct = _postgres_create(url, name)
    parts = urlsplit(direct)
    relay = Relay((parts.hostname or "127.0.0.1", parts.port or 5432))
    through = direct.replace(f"@{parts.hostname}:{parts.port or 5432}/", f"@127.0.0.1:{relay.port}/")
    assert through != direct, direct
    yield direct, through, relay
    relay.cut()
    _postgres_drop(url, name)


def _models(head) -> list[str]:
    try:
        response = httpx.get(f"{head.url}/v1/models", headers={"Authorization": f"Bearer {head.api_key}"}, timeout=5)
    except httpx.HTTPError:
        return []
    return [row["id"] for row in response.json().get("data", [])] if response.status_code == 200 else []


def _records(direct: str) -> dict[str, tuple[str, int]]:
    import psycopg

    with psycopg.connect(direct) as conn:
        rows = conn.execute("SELECT id, status, completion_tokens FROM inference_sessions_generation").fetchall()
    return {row[0].hex: (row[1], row[2]) for row in rows}


def test_streams_outlive_a_database_outage_their_records_land_and_the_fleet_serves_after(tmp_path, database):
    direct, through, relay = database
    head = make_head(tmp_path, database_url=through)
    head.start()
    node = start_node(head, "--max-batch", "4")
    try:
        head.wait_nodes(1, timeout=180)
        client = openai.OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0, timeout=300)
        assert _answer(client)  # the fleet serves, and the key is verified (and cached) before the outage
        streams = [Streamed(client, max_tokens=TOKENS) for _ in range(STREAMS)]
        short = Streamed(client, max_tokens=SHORT)  # ends while the database is away: its record must wait
        wait_for(lambda: all(s.chunks >= 2 for s in [*streams, short]), 120, "the streams did not begin")
        relay.cut()
        at_cut = [s.chunks for s in streams]
        try:  # a new one: served when its key was verified in the last 30 s (the cache), else a clear 503
            assert _answer(client)
        except openai.InternalServerError as refused:
            assert refused.status_code == 503 and refused.response.headers["Retry-After"] == "5"
        time.sleep(OUTAGE_S)
        short.thread.join(60)
        assert not short.thread.is_alive(), "an answer that ended with the database away waited for its record"
        during = [s.chunks for s in streams]
        relay.restore()
        streams.append(short)
        for stream in streams:
            stream.thread.join(300)
        assert [s.error for s in streams] == [None] * (STREAMS + 1)
        assert [s.finish for s in streams] == ["length"] * (STREAMS + 1)  # every token asked for
        assert all(after > before for before, after in zip(at_cut, during[:STREAMS], strict=True)), (at_cut, during)
        wait_for(lambda: "smollm2" in _models(head), 60, "the model list did not come back after the outage")
        assert _answer(client)  # a new request, without a restart
        wait_for(lambda: all(s.gen_id in _records(direct) for s in streams), 60,
                 "the streams' records were not written after the outage")
        found = _records(direct)
        assert [found[s.gen_id] for s in streams] == [("done", TOKENS)] * STREAMS + [("done", SHORT)]
        assert node.proc.poll() is None, node.log()
    finally:
        node.stop()
        head.stop()


def _answer(client) -> str:
    reply = client.chat.completions.create(model="smollm2", max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Say hi."}])
    return reply.choices[0].message.content

