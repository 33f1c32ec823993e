"""What a hostile client or a busy node broke (issue 41), in process: each test replays the attack."""

import asyncio
import os

import pytest

from nodes.agent.dialer import TOKENIZER_PART, AgentConfig, HeadLink, NodeAgent
from nodes.link.channel import MAX_FRAME
from nodes.link.handshake import format_token, make_secret
from nodes.link.messages import StateOp, StateResult, TokenizerFile, encode
from nodes.link.noise import TAGLEN
from tests.api_support import FakeLink, add_fake_node, request

pytest_plugins = ["tests.api_fixtures"]

DAPHNE_DEFAULT_MAX_MESSAGE = 1024 * 1024


# --- item 1: frames that fit end to end --------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
async def test_256_embeddings_go_to_the_node_in_runs_that_each_fit_a_frame(bearer):
    """In one state op, 256 vectors were more than a frame can carry: the reply was over daphne's cap (the link
    closed, ending every stream on it), and over the link's own cap for wide models."""
    link = add_fake_node(FakeLink())
    texts = [f"text {i}" for i in range(256)]
    answer = await request("POST", "/v1/embeddings", key=bearer, body={"model": "smollm2", "input": texts})
    assert answer.status == 200, answer.body
    assert [d["index"] for d in answer.json()["data"]] == list(range(256))
    runs = [args["texts"] for op, args in link.state_ops]
    assert sum(runs, []) == texts and max(len(run) for run in runs) <= 32
    wide = StateResult(op_id="o", ok=True, result={"embeddings": [[0.1] * 8192] * max(len(r) for r in runs)})
    assert len(encode(wide)) + TAGLEN <= MAX_FRAME


class _HugeEngine:
    async def state_op(self, op, args):
        return {"embeddings": [[0.1] * 8192] * 128}  # about 9.4 MB as msgpack doubles


async def test_a_node_answers_a_state_op_too_large_for_a_frame_with_an_error_not_a_dead_link(tmp_path):
    agent = NodeAgent(AgentConfig(head=None, token=format_token("t0ken1d", make_secret()), home=tmp_path),
                      _HugeEngine())
    link = HeadLink("127.0.0.1:9")
    link.outbox = asyncio.Queue()
    await agent._on_state_op(StateOp(op_id="o1", op="embed", args={}), link)
    reply = link.outbox.get_nowait()
    assert isinstance(reply, StateResult) and not reply.ok and "larger than a link frame" in reply.error
    assert len(encode(reply)) < MAX_FRAME  # the send loop seals it (an oversized one failed the loop: the link)


def test_a_tokenizer_part_fits_even_under_daphnes_default_message_cap():
    part = TokenizerFile(fingerprint="f" * 64, part=0, parts=64, data=os.urandom(TOKENIZER_PART))
    assert len(encode(part)) + TAGLEN < DAPHNE_DEFAULT_MAX_MESSAGE


def test_the_head_starts_daphne_with_the_links_frame_size(settings):
    from fleet.daphne_options import daphne_limit_args

    settings.FLEET_LINK_MAX_FRAME_BYTES = 8 * 1024 * 1024
    args = daphne_limit_args()
    size = int(args[args.index("--websocket-max-message-size") + 1])
    assert size > settings.FLEET_LINK_MAX_FRAME_BYTES and size > settings.FLEET_MAX_BODY_BYTES
    assert int(args[args.index("--websocket-max-frame-size") + 1]) == size


# --- item 2: a grammar that froze a node ---------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
async def test_a_grammar_of_nested_repetitions_is_a_400_before_any_node(bearer, fake_node):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}],
            "grammar": 'root ::= ((("a"{0,30}){0,30}){0,30})'}
    answer = await request("POST", "/v1/chat/completions", key=bearer, body=body)
    assert answer.status == 400 and answer.json()["error"]["code"] == "invalid_grammar", answer.body
    assert "can match nothing" in answer.json()["error"]["message"] and fake_node.specs == []


# `("a"{0,30}){0,30}` passed here once: cheap at the grammar's start (0.07 s a filter), it takes 19 s a token after
# twenty characters (nodes/link/gbnf.py); `"a"{0,900}` says the same.
@pytest.mark.parametrize("grammar", ['root ::= "a"{0,900}', 'root ::= ("[" ("(" [a-z]{0,30} ")"){0,30} "]")*',
                                     'root ::= "\\"(((" x{0,99}\nx ::= [)(]{1,3} # (((', 'root ::= ((("a"?)?)?)'])
def test_grammars_without_costly_nesting_pass_the_check(grammar):
    from nodes.link.gbnf import repetition_problem

    assert repetition_problem(grammar) is None


# --- items 6 and 4: the database or Redis away -------------------------------------------------------------------


def _down(exc):
    def raising(*args, **kwargs):
        raise exc

    return raising


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("exc", ["database", "redis"])
async def test_a_request_that_needs_an_unreachable_store_is_a_503_with_retry_after(bearer, monkeypatch, exc):
    """During a 10 s PostgreSQL or Redis outage every such request was a bare 500."""
    from django.db import OperationalError
    from redis.exceptions import ConnectionError as RedisConnectionError

    from nodes import selectors

    error = OperationalError("could not connect to server") if exc == "database" else RedisConnectionError("refused")
    monkeypatch.setattr(selectors, "node_models_served", _down(error))
    answer = await request("GET", "/v1/models", key=bearer)
    assert answer.status == 503 and answer.headers["retry-after"] == "5", answer.body
    assert answer.json()["error"]["code"] == "service_unavailable"


@pytest.mark.django_db(transaction=True)
def test_the_management_api_answers_503_with_retry_after_while_the_database_is_away(api_user, monkeypatch):
    from django.db import OperationalError
    from rest_framework.test import APIClient

    from api.services import api_key_create
    from sessions import selectors

    _, key = api_key_create(owner=api_user, name="dev")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    monkeypatch.setattr(selectors, "session_list", _down(OperationalError("the database system is starting up")))
    answer = client.get("/api/sessions/")
    assert answer.status_code == 503 and answer["Retry-After"] == "5" and "database" in answer.json()["detail"]


# --- issue 50, item 10: empty cursors and multipart bodies without a boundary ----------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["/v1/files?after=", "/v1/batches?after="])
async def test_an_empty_after_cursor_is_the_first_page_not_a_500(bearer, path):
    answer = await request("GET", path, key=bearer)
    assert answer.status == 200, answer.body
    assert answer.json()["object"] == "list"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["/v1/files", "/v1/audio/transcriptions"])
async def test_multipart_without_a_boundary_is_a_400_in_openais_shape(bearer, path):
    answer = await request("POST", path, key=bearer, headers={"content-type": "multipart/form-data"},
                           raw=b"--x\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--x--\r\n")
    assert answer.status == 400, answer.body
    error = answer.json()["error"]
    assert "multipart" in error["message"] and error["type"] == "invalid_request_error"


# --- issue 50 item 8: a revoked key's running streams end -------------------------------------------------------


@pytest.mark.django_db(transaction=True)
async def test_revoking_a_key_ends_its_running_streams_at_once_and_no_other_keys(api_user):
    """Its streams ran to their end (18.6 s in the red team's run): now each ends within a second with the API's
    error event, its lane cancelled on the node and its record written as failed; another key's goes on."""
    from asgiref.sync import sync_to_async

    from api.services import api_key_create, api_key_revoke
    from sessions.models import Generation
    from tests.api_support import Script, start, written_rows

    (row, key), (_, other) = await sync_to_async(lambda: (api_key_create(owner=api_user, name="revoked"),
                                                          api_key_create(owner=api_user, name="kept")))()
    link = add_fake_node(FakeLink(script=Script(tokens=["a"], hang=True)), lanes=2)
    body = {"model": "smollm2", "stream": True, "messages": [{"role": "user", "content": "Go on."}]}
    revoked, kept = await start("POST", "/v1/chat/completions", key=key, body=body), await start(
        "POST", "/v1/chat/completions", key=other, body=body)
    for ex in (revoked, kept):
        await ex.wait(lambda e: len(e.data()) >= 1)
    await sync_to_async(api_key_revoke)(key=row)
    await revoked.wait(lambda e: e.finished, timeout=1.5)
    [error] = [d for d in revoked.data() if isinstance(d, dict) and "error" in d]
    assert (error["error"]["code"], error["error"]["type"]) == ("key_revoked", "authentication_error")
    assert len(link.cancelled) == 1
    [record] = await written_rows(lambda: list(Generation.objects.filter(api_key=row)))
    assert record.status == "failed" and "revoked" in record.error
    await asyncio.sleep(0.6)  # past another stamp read: the other key's stream still runs
    assert not kept.finished and len(link.cancelled) == 1
    await kept.close()


# --- issue 50 item 6: a node that never accepts -------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
async def test_a_generation_a_node_never_accepts_is_placed_elsewhere_and_the_node_gets_no_more(bearer, settings):
    """A node whose link and heartbeats are up but whose engine answers nothing held a request without a deadline
    for 300 s, with no failover: past FLEET_ACCEPT_TIMEOUT_S it goes to another node, and the silent one is
    taken off placement until its next heartbeat."""
    from fleet.links import registry
    from tests.api_support import Script, start

    settings.FLEET_ACCEPT_TIMEOUT_S = 1
    silent = add_fake_node(FakeLink(node_id="aaaaaaaa-0000-0000-0000-000000000001", identity="silent",
                                    script=Script(start_delay=3600)))
    ex = await start("POST", "/v1/chat/completions", key=bearer,
                     body={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]})
    for _ in range(100):
        if silent.specs:
            break
        await asyncio.sleep(0.01)
    good = add_fake_node(FakeLink(node_id="bbbbbbbb-0000-0000-0000-000000000002", identity="good"))
    await ex.wait(lambda e: e.finished, timeout=5)
    assert ex.status == 200, ex.body
    assert ex.json()["choices"][0]["message"]["content"] == "Hello, world!" and len(good.specs) == 1
    assert len(silent.cancelled) == 1  # its lane there is freed
    slots = {slot.identity: slot for slot in registry().placement.nodes()}
    assert slots["silent"].schedulable is False and slots["good"].schedulable is True
    await ex.close()
