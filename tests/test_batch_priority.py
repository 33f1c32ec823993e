"""Batch lines below interactive traffic, in one head process: the dispatcher with fake nodes, requests through the
real ASGI app, batch lines carrying a worker's signed X-Fleet-Batch credential."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from api.batches import batch_credential
from api.models import Batch
from tests.api_support import FakeLink, Script, add_fake_node, request, start

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"


@pytest.fixture
def credential(api_key_pair):
    key = api_key_pair[0]
    batch = Batch.objects.create(owner=key.owner, api_key=key, endpoint=CHAT, completion_window="24h",
                                 input_file_ref="file-x", status=Batch.Status.IN_PROGRESS,
                                 expires_at=timezone.now() + timedelta(hours=1))
    return batch_credential(str(batch.pk))


def hanging_node(lanes: int) -> FakeLink:
    return add_fake_node(FakeLink(script=lambda spec: Script(tokens=[spec["messages"][-1]["content"]], hang=True)),
                         lanes=lanes)


def ask(content: str, *, bearer: str | None = None, credential: str | None = None, **extra):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": content}], **extra}
    headers = {"X-Fleet-Batch": credential} if credential else None
    return asyncio.ensure_future(start("POST", CHAT, key=bearer, body=body, headers=headers))


def contents(link: FakeLink) -> list[str]:
    return [s["messages"][-1]["content"] for s in link.specs]


async def settle(link: FakeLink, count: int) -> None:
    for _ in range(200):
        if len(link.specs) >= count:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # long enough for anything that could still start to start


async def test_an_interactive_generation_takes_the_next_lane_before_a_batch_line(bearer, credential):
    link = hanging_node(lanes=1)
    await ask("blocker", bearer=bearer)
    await settle(link, 1)
    await ask("batch", credential=credential)  # asks first
    await asyncio.sleep(0.2)
    await ask("interactive", bearer=bearer)
    await settle(link, 1)
    await link.send_cancel(next(iter(link.running)), "test")
    await settle(link, 2)
    assert contents(link) == ["blocker", "interactive"]


async def test_batch_lines_fill_the_lanes_interactive_traffic_leaves_free(bearer, credential):
    link = hanging_node(lanes=4)
    await ask("interactive", bearer=bearer)
    await settle(link, 1)
    for i in range(4):
        await ask(f"batch-{i}", credential=credential)
    await settle(link, 4)
    started = contents(link)
    assert started[0] == "interactive" and len(started) == 4  # every free lane, none more
    assert set(started[1:]) < {f"batch-{i}" for i in range(4)}


async def test_batch_lines_keep_to_their_share_while_an_interactive_generation_waits(bearer, credential, settings):
    """The interactive request needs grammar, which only the busy node has, so it waits (the other node's lanes
    are no use to it, nor are batch lines there to preempt); batch lines then keep to their share of the 6 lanes."""
    settings.FLEET_BATCH_SHARE = 0.25  # one lane of 6; the waiting queue alone would let three start
    grammar = add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "grammar-node",
                                     script=lambda spec: Script(tokens=["x"], hang=True)), lanes=2)
    plain = add_fake_node(FakeLink("33333333-3333-3333-3333-333333333333", "plain-node",
                                   script=lambda spec: Script(tokens=["x"], hang=True)), lanes=4,
                          capabilities=["chat", "completion"])
    for i in range(2):
        await ask(f"blocker-{i}", bearer=bearer, grammar='root ::= "x"')
    await settle(grammar, 2)
    await ask("waiting", bearer=bearer, grammar='root ::= "x"')
    await asyncio.sleep(0.2)
    for i in range(3):
        await ask(f"batch-{i}", credential=credential)
    await settle(plain, 1)
    assert len(contents(plain)) == 1 and not plain.cancelled


async def test_an_interactive_generation_preempts_a_batch_line_which_then_continues_exactly(bearer, credential):
    """Both lanes hold batch lines; an interactive request takes the lane of the one that started last at once.
    That line is placed again after it and continues from the token ids it had, to the same whole answer."""
    words = [f" w{i}" for i in range(12)]

    def script(spec):
        if spec["messages"][-1]["content"] == "interactive":
            return Script(tokens=["now"], per_batch=1)
        done = len(spec.get("resume_ids") or [])
        return Script(tokens=words[done:], per_batch=1, delay=0.05, first_id=100 + done)

    link = add_fake_node(FakeLink(script=script), lanes=2)
    first = await ask("batch-0", credential=credential)
    await settle(link, 1)
    second = await ask("batch-1", credential=credential)
    await asyncio.sleep(0.2)  # a few tokens each
    interactive = await start("POST", CHAT, key=bearer, body={
        "model": "smollm2", "messages": [{"role": "user", "content": "interactive"}]})
    await interactive.wait(lambda e: e.finished, 5)
    assert contents(link)[:3] == ["batch-0", "batch-1", "interactive"]
    assert list(link.cancelled) and len(link.cancelled) == 1  # one batch line stopped, batch-1 (it started last)
    for ex in (first, second):
        await ex.wait(lambda e: e.finished, 10)
    answers = [json.loads(b"".join(ex.chunks))["choices"][0]["message"]["content"] for ex in (first, second)]
    assert answers == ["".join(words)] * 2
    resumed = [s for s in link.specs if s["messages"][-1]["content"] == "batch-1"]
    assert len(resumed) == 2 and resumed[1]["resume_ids"] == list(range(100, 100 + len(resumed[1]["resume_ids"])))
    assert 0 < len(resumed[1]["resume_ids"]) < len(words)


async def test_the_preempting_generation_does_not_wait_for_the_batch_line_to_stop(bearer, credential):
    """Its lane is handed over as the cancel goes out: the interactive generation is sent right behind the cancel,
    as to a free lane, and ends while the node is still finishing the step that stops the batch line."""
    link = add_fake_node(FakeLink(script=lambda spec: Script(tokens=["x"], hang=spec["messages"][-1]["content"]
                                                             != "interactive"), cancel_delay=1.0), lanes=1)
    await ask("batch-0", credential=credential)
    await settle(link, 1)
    started = time.monotonic()
    answer = await request("POST", CHAT, key=bearer, body={"model": "smollm2",
                                                          "messages": [{"role": "user", "content": "interactive"}]})
    assert answer.status == 200 and time.monotonic() - started < 0.8
    assert contents(link) == ["batch-0", "interactive"] and list(link.running)  # batch-0 not stopped yet


async def test_a_batch_line_is_never_preempted_for_another_batch_line(credential):
    link = hanging_node(lanes=1)
    await ask("batch-0", credential=credential)
    await settle(link, 1)
    await ask("batch-1", credential=credential)
    await settle(link, 1)
    assert contents(link) == ["batch-0"] and not link.cancelled


async def test_batch_lines_fill_every_lane_with_no_interactive_traffic(credential):
    link = hanging_node(lanes=4)
    for i in range(4):
        await ask(f"batch-{i}", credential=credential)
    await settle(link, 4)
    assert sorted(contents(link)) == [f"batch-{i}" for i in range(4)]


async def test_a_forged_batch_credential_is_refused(credential):
    add_fake_node(lanes=1)
    batch_id = credential.partition(".")[0]
    answer = await request("POST", CHAT, body={"model": "smollm2", "messages": [{"role": "user", "content": "x"}]},
                           headers={"X-Fleet-Batch": f"{batch_id}.{'0' * 40}"})
    assert answer.status == 401 and answer.json()["error"]["code"] == "invalid_batch_credential"


async def test_a_batch_credential_stops_working_when_its_batch_is_over(credential):
    add_fake_node(lanes=1)
    await sync_to_async(Batch.objects.update)(status=Batch.Status.CANCELLED)
    answer = await request("POST", CHAT, body={"model": "smollm2", "messages": [{"role": "user", "content": "x"}]},
                           headers={"X-Fleet-Batch": credential})
    assert answer.status == 401
