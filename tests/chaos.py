"""The chaos soak's engine, shared by `bench/soak.py` (10 minutes) and `tests/test_soak.py` (60 seconds).

Real parts only: two daphne head processes on one PostgreSQL database and one Redis prefix, four mock-engine
nodes (`tests.mock_node`, two dialing each head), and clients that send mixed chat and completion requests,
streamed and not, over HTTP to whichever head is in service. Every node links both heads (it is given one and
learns the other). Meanwhile one node is killed with SIGKILL and restarted every `node_kill_every_s`, and the
second head is restarted twice: once drained (it leaves the clients' rotation, its requests finish, as a load
balancer drains a head, then SIGTERM), and once SIGKILLed under load. Each time it starts again on its port and
every node must link it again. A SIGKILL costs that head's own streams only: the other head's lose nothing.

Then every request is judged: done, or an error in OpenAI's shape with a code docs/api.md documents; each
completed answer is compared token by token with what the mock engine produces for that prompt, seed and
max_tokens uninterrupted; and the Generation rows are matched to the requests by their unique seeds
(`parameters.seed`) and the `X-Fleet-Generation` header.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.chaos_verdict import MODEL, Oracle, describe, judge_records, judge_tokens, summarize
from tests.live import ROOT, Head, NodeProc, make_head, make_peer_head
from tests.mock_node import start_mock_node

SYSTEMS = [("You are the support assistant of a bicycle shop. " * 12).strip(),
           ("You answer questions about the city's trains, briefly. " * 12).strip(),
           "You are terse."]
QUESTIONS = ["Do you repair tyres?", "When do you open on Sundays?", "How long is the trip to the coast?",
             "Can I bring a dog?", "What does a new chain cost?"]
PROMPTS = ["Once upon a time, in a fleet of small models,", "def fibonacci(n):", "The head routes each request"]


def documented_codes(root: Path) -> set[str]:
    """The error codes docs/api.md's error table names (a code missing there is not a clear error)."""
    text = (root / "docs" / "api.md").read_text()
    table = text.split("### Errors", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ")]
    return {code for cells in rows for code in re.findall(r"`(\w+)`", cells[2])}


@dataclass
class SoakConfig:
    seconds: float = 600.0
    clients: int = 50
    nodes: int = 4
    lanes: int = 8
    decode_tps: float = 60.0  # the mock's decode steps a second: answers last long enough to be cut mid-stream
    max_tokens: tuple[int, int] = (8, 64)
    node_kill_every_s: float = 20.0
    head_restart_at: float = 0.4  # of the run
    head_kill_at: float = 0.75  # of the run: the second head SIGKILLed under load, and started again
    hang_grace_s: float = 30.0  # after the run, how long a request may still take before it counts as hung
    hang_after_s: float = 120.0  # a request that took longer hung, however it ended (e.g. node_stuck after 300 s)
    node_back_limit_s: float = 35.0


@dataclass
class Request:
    """One client request and what the client saw."""

    seed: int
    kind: str  # chat | completion
    stream: bool
    head: int
    body: dict[str, Any]
    status: str = "pending"  # done | error (a clear one) | unclear
    code: str = ""
    gen_id: str = ""
    text: str = ""
    finish_reason: str = ""
    completion_tokens: int | None = None
    started: float = 0.0
    ended: float = 0.0
    killed_with_head: bool = False  # in flight on the head that was SIGKILLed: its loss is that head's cost

    def end(self, status: str, code: str = "") -> None:
        self.status, self.code, self.ended = status, code, time.monotonic()


@dataclass
class SoakReport:
    summary: dict[str, Any]  # exactly what bench/results/soak.json holds
    details: dict[str, Any]
    requests: list[Request] = field(default_factory=list, repr=False)
    records: list[dict[str, Any]] = field(default_factory=list, repr=False)


class Fleet:
    """Two head processes sharing PostgreSQL and Redis, and mock nodes split between them."""

    def __init__(self, workdir: Path, config: SoakConfig):
        quotas = {name: "0" for name in ("FLEET_QUOTA_REQUESTS_PER_MINUTE", "FLEET_QUOTA_TOKENS_PER_MINUTE",
                                         "FLEET_QUOTA_CONCURRENT_STREAMS")}
        self.config = config
        self.heads: list[Head] = [make_head(workdir, extra_env=quotas)]
        self.heads.append(make_peer_head(self.heads[0], workdir))
        self.homes = {f"soak-node-{i + 1}": i % 2 for i in range(config.nodes)}  # identity -> head index
        self.nodes: dict[str, NodeProc] = {}

    def start(self) -> None:
        for head in self.heads:
            head.start()
        for identity in self.homes:
            self.start_node(identity)
        for index, head in enumerate(self.heads):
            head.wait_nodes(self.expected_nodes(index), timeout=120)

    def expected_nodes(self, index: int) -> int:
        return len(self.homes)  # every node links every head

    def start_node(self, identity: str) -> None:
        params = {"decode_tps": self.config.decode_tps}
        self.nodes[identity] = start_mock_node(self.heads[self.homes[identity]], identity, model=MODEL,
                                               lanes=self.config.lanes, **params)

    def kill_node(self, identity: str) -> None:
        self.nodes[identity].stop(signal.SIGKILL)

    def linked(self, index: int) -> int:
        return (self.heads[index].health() or {}).get("nodes", 0)

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()
        for head in self.heads:
            head.stop()

    def records(self) -> list[dict[str, Any]]:
        import psycopg

        with psycopg.connect(self.heads[0].env["DATABASE_URL"]) as conn:
            rows = conn.execute("SELECT id::text, status, nodes_used, completion_tokens, parameters->>'seed', error "
                                "FROM inference_sessions_generation").fetchall()
        keys = ("id", "status", "nodes_used", "completion_tokens", "seed", "error")
        return [dict(zip(keys, row, strict=True)) for row in rows]

    def drop_database(self) -> None:
        import psycopg

        url = self.heads[0].env["DATABASE_URL"]
        base, _, name = url.rpartition("/")
        with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Soak:
    """The run: clients, the chaos, and what they saw."""

    def __init__(self, fleet: Fleet, config: SoakConfig, codes: set[str]):
        self.fleet, self.config, self.codes = fleet, config, codes
        self.requests: list[Request] = []
        self.in_service = {0, 1}
        self.inflight = Counter()
        self.head_restarting = False
        self.node_kills: list[str] = []
        self.head_restart: dict[str, float] = {}
        self.head_kill: dict[str, Any] = {}
        self.seeds = itertools.count(random.SystemRandom().randrange(1, 2**40))
        self.stop_at = 0.0

    async def run(self) -> None:
        self.stop_at = time.monotonic() + self.config.seconds
        clients = [asyncio.ensure_future(self.client(n)) for n in range(self.config.clients)]
        chaos = [asyncio.ensure_future(self.node_chaos()), asyncio.ensure_future(self.head_chaos())]
        _, pending = await asyncio.wait(clients, timeout=self.config.seconds + self.config.hang_grace_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*clients, *chaos, return_exceptions=True)
        for request in self.requests:
            if request.status == "pending":
                request.end("unclear", "hang")

    # --- clients ---
    async def client(self, n: int) -> None:
        rng = random.Random(n)
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.config.hang_after_s, connect=5), limits=limits) as http:
            while time.monotonic() < self.stop_at:
                request = self.new_request(rng)
                self.requests.append(request)
                self.inflight[request.head] += 1
                try:
                    await send(http, self.fleet.heads[request.head], request, self.codes)
                finally:
                    self.inflight[request.head] -= 1
                limit = self.config.hang_after_s
                if request.ended - request.started > limit:
                    request.end("unclear", f"hang ({request.code or request.status}, over {limit:.0f} s)")

    def new_request(self, rng: random.Random) -> Request:
        kind, stream = rng.choice(["chat", "completion"]), rng.random() < 0.6
        seed = next(self.seeds)
        body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(*self.config.max_tokens), "seed": seed,
                                "temperature": 0.7, "stream": stream}
        if kind == "chat":
            body["messages"] = [{"role": "system", "content": rng.choice(SYSTEMS)},
                                {"role": "user", "content": rng.choice(QUESTIONS)}]
        else:
            body["prompt"] = rng.choice(PROMPTS)
        if stream:
            body["stream_options"] = {"include_usage": True}
        head = rng.choice(sorted(self.in_service))
        return Request(seed=seed, kind=kind, stream=stream, head=head, body=body, started=time.monotonic())

    # --- chaos ---
    async def node_chaos(self) -> None:
        identities = itertools.cycle(sorted(self.fleet.homes))
        tick = time.monotonic()
        while (tick := tick + self.config.node_kill_every_s) < self.stop_at:
            await asyncio.sleep(tick - time.monotonic())
            if self.head_restarting:  # the head's own nodes are measured coming back; leave them be
                continue
            identity = next(identities)
            await asyncio.to_thread(self.fleet.kill_node, identity)
            self.node_kills.append(identity)
            await asyncio.to_thread(self.fleet.start_node, identity)

    async def head_chaos(self, index: int = 1) -> None:
        await asyncio.sleep(self.config.seconds * self.config.head_restart_at)
        self.head_restarting = True
        await self.wait(lambda: sum(map(self.fleet.linked, (0, 1))) >= self.config.nodes, 60)
        self.in_service.discard(index)
        drained = await self.wait(lambda: self.inflight[index] == 0, 30)
        head = self.fleet.heads[index]
        began = time.monotonic()
        await asyncio.to_thread(head.stop)
        await asyncio.to_thread(head.start)
        up = time.monotonic()
        expected = self.fleet.expected_nodes(index)
        back = await self.wait(lambda: self.fleet.linked(index) >= expected, 90)
        self.head_restart = {"drained": drained, "down_s": round(up - began, 2),
                             "node_back_s": round(time.monotonic() - up, 2) if back else None}
        self.in_service.add(index)
        self.head_restarting = False
        kill_at = self.stop_at - self.config.seconds * (1 - self.config.head_kill_at)
        await asyncio.sleep(max(kill_at - time.monotonic(), 0))
        await self.kill_head(index)

    async def kill_head(self, index: int) -> None:
        """SIGKILL the head under load (its requests in flight are its cost), start it again, wait for its links."""
        self.head_restarting = True
        self.in_service.discard(index)  # as a load balancer's health check would
        head = self.fleet.heads[index]
        killed_at = time.monotonic()
        await asyncio.to_thread(head.stop, signal.SIGKILL)
        cut = [r for r in self.requests if r.head == index and (r.status == "pending" or r.ended >= killed_at)]
        for request in cut:
            request.killed_with_head = True
        await asyncio.to_thread(head.start)
        up = time.monotonic()
        back = await self.wait(lambda: self.fleet.linked(index) >= self.fleet.expected_nodes(index), 90)
        self.head_kill = {"streams_cut": len(cut), "down_s": round(up - killed_at, 2),
                          "node_back_s": round(time.monotonic() - up, 2) if back else None}
        self.in_service.add(index)
        self.head_restarting = False

    async def wait(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await asyncio.to_thread(predicate):
                return True
            await asyncio.sleep(0.2)
        return False


# --- one request ----------------------------------------------------------------------------------------------


async def send(http: httpx.AsyncClient, head: Head, request: Request, codes: set[str]) -> None:
    path = "/v1/chat/completions" if request.kind == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {head.api_key}"}
    try:
        async with http.stream("POST", head.url + path, json=request.body, headers=headers) as response:
            request.gen_id = response.headers.get("x-fleet-generation", "")
            if response.status_code != 200:
                judge_error(request, await response.aread(), codes)
            elif request.stream:
                await read_stream(request, response, codes)
            else:
                read_answer(request, json.loads(await response.aread()))
    except (httpx.HTTPError, ValueError) as exc:
        request.end("unclear", f"{type(exc).__name__}")
    except asyncio.CancelledError:
        request.end("unclear", "hang")
        raise


def read_answer(request: Request, body: dict[str, Any]) -> None:
    choice = body["choices"][0]
    request.gen_id = request.gen_id or body.get("id", "").split("-", 1)[-1]
    request.text = choice["message"]["content"] if request.kind == "chat" else choice["text"]
    request.finish_reason = choice["finish_reason"]
    request.completion_tokens = body["usage"]["completion_tokens"]
    request.end("done")


async def read_stream(request: Request, response: httpx.Response, codes: set[str]) -> None:
    over = False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            over = True
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            judge_error(request, line[6:].encode(), codes)
            return
        if chunk.get("usage"):
            request.completion_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices") or []:
            request.text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            request.finish_reason = choice.get("finish_reason") or request.finish_reason
    if over and request.finish_reason:
        request.end("done")
    else:
        request.end("unclear", "stream cut" if not over else "no finish_reason")


def judge_error(request: Request, raw: bytes, codes: set[str]) -> None:
    """A clear error is OpenAI's object with a message, a type and a documented code."""
    try:
        error = json.loads(raw)["error"]
        shaped = all(isinstance(error.get(k), str) and error[k] for k in ("message", "type", "code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        request.end("unclear", "not an OpenAI error object")
        return
    if not shaped:
        request.end("unclear", "error object without message, type or code")
    elif error["code"] not in codes:
        request.end("unclear", f"undocumented code {error['code']}")
    else:
        request.end("error", error["code"])


# --- the whole run --------------------------------------------------------------------------------------------


def run_soak(config: SoakConfig, workdir: Path) -> SoakReport:
    """Start the fleet, run the soak with its chaos, judge every request and record, stop everything."""
    fleet = Fleet(workdir, config)
    try:
        fleet.start()
        soak = Soak(fleet, config, documented_codes(ROOT))
        asyncio.run(soak.run())
        rows = fleet.records()
        # A node killed near the end may still be joining; every one must be back.
        asyncio.run(soak.wait(lambda: sum(map(fleet.linked, (0, 1))) >= config.nodes, 40))
        linked = [fleet.linked(i) for i in range(len(fleet.heads))]
    finally:
        fleet.stop()
    chaos = {"head_restart": soak.head_restart, "head_kill": soak.head_kill, "node_kills": soak.node_kills,
             "nodes_linked_at_end": linked,
             "logs": str(workdir), "database": fleet.heads[0].env["DATABASE_URL"]}
    report = judge(config.seconds, soak.requests, rows, chaos)
    if not (report.details["unclear"] or report.details["token_problems"] or report.details["record_problems"]):
        fleet.drop_database()  # kept for a look when something went wrong
    return report


def judge(seconds: float, requests: list[Request], rows: list[dict[str, Any]], chaos: dict[str, Any]) -> SoakReport:
    """The report on what the clients saw and the database holds (`chaos`: what was done to the fleet). The
    requests in flight on the SIGKILLed head are its cost, counted apart (`killed_with_head`) and judged apart: each
    that was running on a node (its client had tokens of it) must still have one record, failed, written by the
    other head from the node's `cut` (sessions.cuts)."""
    killed = {r.seed for r in requests if r.killed_with_head}
    placed = {r.seed: r for r in requests if r.killed_with_head and r.text}
    cut_rows: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        if row["seed"] is not None and int(row["seed"]) in placed:
            cut_rows.setdefault(int(row["seed"]), []).append(row)
    requests = [r for r in requests if r.seed not in killed]
    rows = [row for row in rows if row["seed"] is None or int(row["seed"]) not in killed]
    tokens, records = judge_tokens(requests, Oracle()), judge_records(requests, rows)
    summary = summarize(seconds, requests, tokens, records, chaos["head_restart"].get("node_back_s"))
    summary["killed_with_head"] = len(killed)
    summary["killed_with_head_placed"] = len(placed)
    summary["killed_with_head_unrecorded"] = sum(1 for seed in placed if not cut_rows.get(seed))
    summary["killed_with_head_misrecorded"] = sum(
        1 for found in cut_rows.values() if len(found) > 1 or found[0]["status"] != "failed")
    details = {**chaos, "record_statuses": records["statuses"], "token_problems": tokens["problems"],
               "record_problems": records["problems"],
               "killed_with_head_records": {seed: [row["status"] for row in cut_rows.get(seed, [])]
                                            for seed in placed},
               "unclear": [{**describe(r), "records": records["by_seed"].get(r.seed, [])}
                           for r in requests if r.status == "unclear"]}
    return SoakReport(summary, details, requests, rows)
