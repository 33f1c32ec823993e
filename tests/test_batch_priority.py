"""Batch lines below interactive traffic, in one head process: the dispatcher with fake nodes, requests through the
real ASGI app, batch lines carrying a worker's signed X-Fleet-Batch credential."""

from __future__ import annotations

import asyncio
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


def ask(content: str, *, bearer: str | None = None, credential: str | None = None):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": content}]}
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


async def test_batch_lines_keep_to_their_share_while_interactive_traffic_runs(bearer, credential):
    link = hanging_node(lanes=4)
    await ask("interactive", bearer=bearer)
    await settle(link, 1)
    for i in range(3):
        await ask(f"batch-{i}", credential=credential)
    await settle(link, 3)
    started = contents(link)
    assert started[0] == "interactive" and len(started) == 3  # two batch lines: half of 4 lanes, one left free


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
