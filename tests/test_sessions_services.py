"""Writes and reads for conversations, generation records and handles."""

import time
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from fleet.dispatch import Outcome
from sessions import selectors
from sessions.models import Generation, GrammarHandle, Message
from sessions.services import (
    GenerationTrace,
    generation_record,
    grammar_handle_create,
    grammar_handle_free,
    logit_bias_clean,
    logit_bias_handle_create,
    session_append,
    session_create,
)
from tests.factories import NodeFactory, UserFactory

pytestmark = pytest.mark.django_db


def outcome(**extra) -> Outcome:
    now = time.time()
    values = {"node": "gpu-1", "nodes_used": ["gpu-1"], "text": "Paris.", "completion_tokens": 3, "prompt_tokens": 20,
              "cached_tokens": 16, "finish_reason": "stop", "started_at": now - 1.0, "first_token_at": now - 0.75,
              "placement": {"node": "gpu-1", "cost": 4}}
    return Outcome(**{**values, **extra})


def test_a_finished_generation_writes_one_row_and_the_sessions_new_messages_together():
    node = NodeFactory()
    session = session_create(model="smollm2", system_prompt="Be brief.", messages=[{"role": "user", "content": "Hi"},
                                                                                   {"role": "assistant",
                                                                                    "content": "Hello"}])
    gen_id = uuid.uuid4().hex
    trace = GenerationTrace(gen_id=gen_id, kind="chat", model="smollm2", status="done",
                            outcome=outcome(node_id=str(node.id)), session_id=session.id,
                            new_messages=[{"role": "user", "content": "Capital of France?"},
                                          {"role": "assistant", "content": "Paris."}],
                            parameters={"max_tokens": 5}, finished_at=time.time())
    with CaptureQueriesContext(connection) as queries:
        generation = generation_record(trace)
    assert len(queries) < 12
    assert not any("nodes_node" in q["sql"] for q in queries.captured_queries)  # its node is not looked up first
    assert generation.id.hex == gen_id and generation.node == node and generation.status == "done"
    assert (generation.prompt_tokens, generation.cached_tokens, generation.completion_tokens) == (20, 16, 3)
    assert 200 < generation.ttft_ms < 300 and generation.duration_ms >= 1000 and generation.decode_tps > 0
    assert generation.placement == {"node": "gpu-1", "cost": 4}
    rows = list(Message.objects.filter(session=session).values_list("index", "role", "content", "generation_id",
                                                                    "token_count"))
    assert rows == [(0, "user", "Hi", None, None), (1, "assistant", "Hello", None, None),
                    (2, "user", "Capital of France?", generation.id, None),
                    (3, "assistant", "Paris.", generation.id, 3)]


@pytest.mark.django_db(transaction=True)  # the node's foreign key is checked when the record's transaction commits
def test_a_failed_or_cancelled_generation_leaves_the_session_alone_and_tolerates_an_unknown_node():
    session = session_create(model="smollm2")
    for status in ("failed", "cancelled"):
        trace = GenerationTrace(gen_id=uuid.uuid4().hex, kind="chat", model="smollm2", status=status,
                                outcome=outcome(node_id=str(uuid.uuid4()), first_token_at=None), session_id=session.id,
                                new_messages=[{"role": "user", "content": "Hi"}], error="boom")
        generation = generation_record(trace)
        assert generation.node is None and generation.ttft_ms is None and generation.error == "boom"
    assert Generation.objects.count() == 2 and not Message.objects.exists()


def test_messages_are_appended_after_the_last_one_with_tool_calls_kept():
    session = session_create(model="smollm2")
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    session_append(session=session, messages=[{"role": "assistant", "content": None, "tool_calls": calls}])
    session_append(session=session, messages=[{"role": "tool", "content": "42", "tool_call_id": "call_1"}])
    assert selectors.session_history(session=session) == [
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    with pytest.raises(ValueError, match="unknown message role"):
        session_append(session=session, messages=[{"role": "robot", "content": "x"}])


def test_grammar_handles_check_their_source():
    handle = grammar_handle_create(kind="json_schema", source='{"type": "object"}')
    assert handle.source == '{"type": "object"}'
    for kind, source, words in (("json_schema", "{nope", "not valid JSON"), ("json_schema", {"type": 5}, "invalid"),
                                ("json_schema", [1], "JSON object"), ("gbnf", "   ", "empty"),
                                ("gbnf", 'start ::= "a"', "root"), ("regex", "a+", "unknown grammar kind")):
        with pytest.raises(ValueError, match=words):
            grammar_handle_create(kind=kind, source=source)
    assert grammar_handle_free(handle=handle) is True and grammar_handle_free(handle=handle) is False


def test_logit_biases_are_token_ids_with_bounded_biases():
    assert logit_bias_clean({"12": -100, 7: 1.5}) == {"12": -100.0, "7": 1.5}
    for bias, words in (({"a": 1}, "not a token id"), ({"-3": 1}, "not a token id"), ({"1": "x"}, "number"),
                        ({"1": True}, "number"), ({"1": -101}, "between"), ([1], "object")):
        with pytest.raises(ValueError, match=words):
            logit_bias_clean(bias)


def test_people_see_their_own_sessions_and_handles_and_staff_see_all():
    alice, bob = UserFactory(is_staff=False), UserFactory(is_staff=False)
    operator = UserFactory(username="op")
    mine = session_create(model="smollm2", owner=alice)
    handle = logit_bias_handle_create(bias={"1": 1}, owner=alice)
    assert selectors.session_get(user=alice, session_id=mine.id) == mine
    assert selectors.session_get(user=bob, session_id=mine.id) is None
    assert selectors.session_get(user=alice, session_id="not-a-uuid") is None
    assert selectors.session_get(user=operator, session_id=str(mine.id)) == mine
    assert selectors.logit_bias_handle_get_active(user=alice, handle_id=str(handle.id)) == handle
    with pytest.raises(selectors.HandleUnavailable, match="no logit-bias handle"):
        selectors.logit_bias_handle_get_active(user=bob, handle_id=str(handle.id))
    gbnf = GrammarHandle.objects.create(kind="gbnf", source='root ::= "a"', owner=alice)
    grammar_handle_free(handle=gbnf)
    with pytest.raises(selectors.HandleUnavailable, match="was freed"):
        selectors.grammar_handle_get_active(user=alice, handle_id=gbnf.id)
