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
