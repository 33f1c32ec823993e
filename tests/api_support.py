"""Test-only helpers for the API tests: a fake node link that plays a node's frames, and a small ASGI client.

The fake link stands in for a node's link consumer in `fleet.links.registry()`: it answers `send_generate` with
Accepted, TokenBatch and Done (or Error) frames pushed into the generation's relay, exactly as the consumer does,
and frees its lane when a generation ends. It is for routing and relay tests; real nodes are in test_api_e2e.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from fleet.links import NodeLost, registry
from nodes.link.messages import Accepted, Done, Error, TokenBatch
from nodes.link.placement import NodeSlot


@dataclass
class Script:
    """What the fake node does with a generation."""

    tokens: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "!"])
    per_batch: int = 2
    delay: float = 0.0  # seconds between batches
    finish_reason: str = "stop"
    error: tuple[str, str] | None = None  # (code, message) instead of running
    start_delay: float = 0.0  # seconds before the first frame (Accepted or Error)
    hang: bool = False  # after the tokens, run until cancelled
    prompt_tokens: int = 11
    cached_tokens: int = 3
    lose_after: int | None = None  # the link drops once this many tokens are sent (a node killed mid-stream)
    drop_seq: int | None = None  # this token batch is lost on its way to the head (the node goes on)
    first_id: int = 100  # token ids count up from here
    reported_completion: int | None = None  # what the done's usage claims (None: the tokens it sent)
    stop_index: int | None = None  # the node reports that this stop string (by its place in spec.stop) ended it


class FakeLink:
    """A LinkHandle that plays `script` (a Script, or a function of the spec dict returning one)."""

    def __init__(self, node_id: str = "11111111-1111-1111-1111-111111111111", identity: str = "fake-node",
                 script: Any = None, embeddings: list[list[float]] | None = None, cancel_delay: float = 0.0):
        self.node_id, self.identity = node_id, identity
        self.cancel_delay = cancel_delay  # a cancel takes effect this late (a node finishing its step)
        self.script = script or Script()
        self.specs: list[dict[str, Any]] = []
        self.cancelled: dict[str, float] = {}
        self.running: dict[str, asyncio.Task] = {}
        self.state_ops: list[tuple[str, dict]] = []
        self.embeddings = embeddings

    async def send_generate(self, gen_id: str, spec: dict[str, Any]) -> None:
        self.specs.append(spec)
        script = self.script(spec) if callable(self.script) else self.script
        self.running[gen_id] = asyncio.ensure_future(self._play(gen_id, spec, script))

    async def send_cancel(self, gen_id: str, reason: str) -> None:
        task = self.running.get(gen_id)
        if task is not None and not task.done():
            self.cancelled.setdefault(gen_id, asyncio.get_running_loop().time())
            asyncio.get_running_loop().call_later(self.cancel_delay, task.cancel)

    async def state_op(self, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.state_ops.append((op, args))
        vectors = self.embeddings or [[0.5, -0.25, 0.125] for _ in args.get("texts", [])]
        return {"embeddings": vectors[: len(args.get("texts", []))], "prompt_tokens": 5}

    async def _play(self, gen_id: str, spec: dict[str, Any], script: Script) -> None:
        reg = registry()
        sent = 0
        seq = 1  # batches count from 1, as the real node's runs do (and the dispatcher expects)
        try:
            if script.start_delay:
                await asyncio.sleep(script.start_delay)
            if script.error is not None:
                self._end(gen_id, Error(gen_id=gen_id, code=script.error[0], message=script.error[1]))
                return
            reg.relay_push(gen_id, Accepted(gen_id=gen_id, prompt_tokens=script.prompt_tokens,
                                            cached_tokens=script.cached_tokens))
            tokens = script.tokens[: spec.get("max_tokens") or None]
            for start in range(0, len(tokens), script.per_batch):
                if script.delay:
                    await asyncio.sleep(script.delay)
                batch = tokens[start: start + script.per_batch]
                logprobs = None
                if spec.get("logprobs"):
                    logprobs = [{"token": t, "logprob": -0.5, "top": [{"token": t, "logprob": -0.5},
                                                                      {"token": "x", "logprob": -2.0}]
                                 [: spec.get("top_logprobs", 0)]} for t in batch]
                if seq != script.drop_seq:
                    reg.relay_push(gen_id, TokenBatch(gen_id=gen_id, seq=seq, text=batch,
                                                      ids=list(range(script.first_id + sent,
                                                                     script.first_id + sent + len(batch))),
                                                      logprobs=logprobs), node_id=self.node_id)
                seq += 1
                sent += len(batch)
                if script.lose_after is not None and sent >= script.lose_after:
                    self._end(gen_id, NodeLost(self.node_id, "link closed"))
                    return
            while script.hang:
                await asyncio.sleep(0.05)
            reason = "length" if len(tokens) < len(script.tokens) else script.finish_reason
            claimed = sent if script.reported_completion is None else script.reported_completion
            usage = {"prompt_tokens": script.prompt_tokens, "completion_tokens": claimed}
            if script.stop_index is not None:
                usage["stop_index"] = script.stop_index
            self._end(gen_id, Done(gen_id=gen_id, seq=seq, finish_reason=reason, timings={"decode_ms": 1.0},
                                   usage=usage))
        except asyncio.CancelledError:
            self._end(gen_id, Done(gen_id=gen_id, seq=seq, finish_reason="cancelled", timings={},
                                   usage={"prompt_tokens": script.prompt_tokens, "completion_tokens": sent}))

    def _end(self, gen_id: str, frame: Any) -> None:
        reg = registry()
        self.running.pop(gen_id, None)
        if gen_id not in reg.relays:  # as the link consumer does: a dispatcher here frees the lane itself
            reg.lifecycle.ended(self.node_id, gen_id)
        reg.lanes.notify()
        reg.relay_push(gen_id, frame, node_id=self.node_id)


# What a default node reports as true (a llama.cpp engine without --batch-invariant).
DEFAULT_CAPABILITIES = ["chat", "completion", "embeddings", "grammar", "logprobs"]


def add_fake_node(link: FakeLink | None = None, *, model: str = "smollm2", lanes: int = 2,
                  context_window: int = 2048, capabilities: list[str] | None = None) -> FakeLink:
    """Register a fake node in this process's link registry and placement state."""
    link = link or FakeLink()
    reg = registry()
    reg.links[link.node_id] = link
    caps = DEFAULT_CAPABILITIES if capabilities is None else capabilities
    reg.placement.node_up(NodeSlot(link.node_id, link.identity, [model], lanes, context_window, capabilities=caps))
    reg.lanes.notify()
    return link


# --- a small ASGI client that streams, and can hang up ----------------------------------------------------------


@dataclass
class Exchange:
    """One HTTP exchange with the ASGI app, as it goes."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)
    finished: bool = False
    task: asyncio.Task | None = None
    hang_up: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[str]:
        return [block for block in self.body.decode().split("\n\n") if block]

    def data(self) -> list[Any]:
        out = []
        for block in self.events():
            if block.startswith("data: "):
                payload = block[len("data: "):]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
        return out

    async def wait(self, predicate, timeout: float = 5.0) -> None:
        async def loop():
            while not predicate(self):
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), timeout)

    async def close(self, timeout: float = 5.0) -> None:
        self.hang_up.set()
        await asyncio.wait_for(self.task, timeout)


_handler = None


def _app():
    global _handler
    if _handler is None:
        from fleet.asgi import application  # the real app, with the SSE guard around Django

        _handler = application
    return _handler


async def start(method: str, path: str, *, body: Any = None, key: str | None = None,
                headers: dict[str, str] | None = None, raw: bytes | None = None) -> Exchange:
    """Start a request; the returned Exchange fills in as the response streams."""
    ex = Exchange()
    all_headers = {"content-type": "application/json", **(headers or {})}
    if key:
        all_headers["authorization"] = f"Bearer {key}"
    payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
    all_headers["content-length"] = str(len(payload))
    path, _, query = path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in all_headers.items()],
        "client": ("127.0.0.1", 50000), "server": ("testserver", 80),
    }
    sent_body = False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await ex.hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            ex.status = message["status"]
            ex.headers = {k.decode().lower(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            ex.chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                ex.finished = True
        ex.changed.set()

    ex.task = asyncio.ensure_future(_app()(scope, receive, send))
    return ex


async def request(method: str, path: str, *, timeout: float = 10.0, **kwargs) -> Exchange:
    """A whole request: wait for the complete response, then hang up."""
    ex = await start(method, path, **kwargs)
    await ex.wait(lambda e: e.finished, timeout)
    await ex.close()
    return ex



async def written_rows(query, *, attempts: int = 200, interval: float = 0.05) -> list:
    """What the sync `query` returns once it returns rows (within about 10 s: a loaded machine's writer thread can lag
    seconds): a generation is recorded a moment after its stream ends.

    The tests' SQLite database lives in memory with a shared cache, where a read that meets another connection's
    uncommitted write to its table fails at once ("database table is locked") instead of waiting as a read of the
    head's file database (WAL) does. Such a read counts as "not written yet", as does an empty one.
    """
    from asgiref.sync import sync_to_async
    from django.db import OperationalError

    rows: list = []
    for _ in range(attempts):
        try:
            rows = await sync_to_async(query)()
        except OperationalError as exc:
            if "is locked" not in str(exc):
                raise
        if rows:
            return rows
        await asyncio.sleep(interval)
    return rows


def on_a_fresh_loop_thread(make: Any, *, timeout: float = 30.0) -> tuple[Any, Any]:
    """`make()`'s coroutine run to its end on an event loop in a new thread, as on the head's loop thread: one that
    holds no database connection (the test's own thread holds the test database's, and Django's request_finished
    must not close a loop thread's connection). Its result and that thread; what it raised is raised here."""
    import threading

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = asyncio.run(make())
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="test-loop")
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the loop thread ran past {timeout} s"
    if "error" in out:
        raise out["error"]
    return out["result"], thread
