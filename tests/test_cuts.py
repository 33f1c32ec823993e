"""The record of a generation whose head process died, written by the head a node told (sessions.cuts)."""

import time
import uuid

import pytest
from asgiref.sync import sync_to_async

from fleet import heads
from fleet.links import registry
from nodes.link.messages import Cut
from sessions import cuts
from sessions.models import Generation
from tests.factories import NodeFactory

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db(transaction=True)

DEAD = "0123456789ab"  # a head process that is not this one


def signed(gen_id: str, api_key=None, head: str = DEAD) -> dict:
    record = cuts.record_for(gen_id=gen_id, kind="chat", model="smollm2", api_key=api_key, session=None,
                             parameters={"max_tokens": 2000, "stream": True})
    if head != heads.PROCESS_ID:  # as another process would have signed it
        payload = cuts.opened(record, gen_id) | {"head": head}
        record = {"signed": cuts.signing.dumps(payload, salt=cuts.SALT, compress=True)}
    return record


def cut_of(gen_id: str, record: dict) -> Cut:
    return Cut(gen_id=gen_id, record=record, finish_reason="cancelled", timings={},
               usage={"prompt_tokens": 41, "cached_tokens": 0, "completion_tokens": 17})


async def test_a_dead_heads_generation_is_recorded_as_failed_with_what_the_node_made_and_only_once(api_key_pair):
    node = await sync_to_async(NodeFactory)()
    gen_id = str(uuid.uuid4())
    cut = cut_of(gen_id, signed(gen_id, api_key=api_key_pair[0].pk))
    written = await cuts.settle(node_id=str(node.pk), node=node.identity, cut=cut)
    assert written is not None
    row = await Generation.objects.aget(pk=gen_id)
    assert (row.status, row.prompt_tokens, row.completion_tokens, row.finish_reason) == ("failed", 41, 17,
                                                                                         "cancelled")
    assert (row.node_id, row.api_key_id, row.model, row.kind) == (node.pk, api_key_pair[0].pk, "smollm2", "chat")
    assert row.error.startswith(f"head_lost: head process {DEAD} stopped before the end; node {node.identity}")
    assert row.parameters["max_tokens"] == 2000
    assert await cuts.settle(node_id=str(node.pk), node=node.identity, cut=cut) is None  # a second node's report
    assert await Generation.objects.filter(pk=gen_id).acount() == 1


async def test_a_record_the_fleet_did_not_sign_or_of_another_generation_is_not_written():
    node = await sync_to_async(NodeFactory)()
    gen_id, other = str(uuid.uuid4()), str(uuid.uuid4())
    forged = signed(gen_id) | {"signed": signed(gen_id)["signed"][:-2] + "xx"}
    for cut in (cut_of(gen_id, forged), cut_of(gen_id, signed(other)), cut_of(gen_id, {})):
        assert await cuts.settle(node_id=str(node.pk), node=node.identity, cut=cut) is None
    assert not await Generation.objects.filter(pk__in=[gen_id, other]).aexists()


async def test_a_head_still_alive_records_its_own_generation(monkeypatch):
    """Its link to the node dropped and the head lives on (this process, or one that beats on): it fails the
    stream over or fails it, and writes that record itself; the report is not a second one."""
    node = await sync_to_async(NodeFactory)()
    mine = str(uuid.uuid4())
    own = cut_of(mine, signed(mine, head=heads.PROCESS_ID))
    assert await cuts.settle(node_id=str(node.pk), node=node.identity, cut=own) is None
    monkeypatch.setattr(heads, "BEAT_S", 0.05)
    monkeypatch.setattr(registry().heads, "alive_until", lambda head: time.time() + 0.1)  # it beats on
    beating = str(uuid.uuid4())
    assert await cuts.settle(node_id=str(node.pk), node=node.identity, cut=cut_of(beating, signed(beating))) is None
    lapses = time.time() + 0.1
    monkeypatch.setattr(registry().heads, "alive_until", lambda head: lapses)  # its beats stopped: dead once it lapses
    dead = str(uuid.uuid4())
    assert await cuts.settle(node_id=str(node.pk), node=node.identity, cut=cut_of(dead, signed(dead))) is not None
    assert [g.pk async for g in Generation.objects.all()] == [uuid.UUID(dead)]
