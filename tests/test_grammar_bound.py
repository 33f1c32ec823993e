"""A grammar's size bound on the head (issue 50, item 1): repetitions of something that can match nothing, followed
through rule references, are refused with a 400 before any node sees them."""

import pytest

from api.grammars import JSON_GBNF
from tests.api_support import request

pytest_plugins = ["tests.api_fixtures"]

# The red team's bombs: the inline one of the round before, written with rule references (5 min 15 s in one step of
# a node), and a two-level {0,1000} one (4 min 41 s).
BY_RULES = 'root ::= b{0,30}\nb ::= c{0,30}\nc ::= d{0,30}\nd ::= "a"'
TWO_LEVEL = 'root ::= b{0,1000}\nb ::= "a"{0,1000}'


def _chat(grammar: str) -> dict:
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "grammar": grammar}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("grammar", [BY_RULES, TWO_LEVEL])
async def test_a_repetition_bomb_written_with_rule_references_is_a_400_before_any_node(bearer, fake_node, grammar):
    answer = await request("POST", "/v1/chat/completions", key=bearer, body=_chat(grammar))
    assert answer.status == 400, answer.body
    error = answer.json()["error"]
    assert error["code"] == "invalid_grammar" and error["param"] == "grammar"
    assert "can match nothing" in error["message"] and "(at most 4)" in error["message"]
    assert fake_node.specs == []


@pytest.mark.django_db
@pytest.mark.parametrize("grammar", [BY_RULES, TWO_LEVEL])
def test_a_grammar_handle_over_the_bound_is_refused_in_drfs_shape(staff, grammar):
    answer = staff.post("/api/grammars/", {"kind": "gbnf", "source": grammar}, format="json")
    assert answer.status_code == 400
    assert "can match nothing" in answer.json()["detail"] and "(at most 4)" in answer.json()["detail"]


@pytest.mark.django_db(transaction=True)
async def test_a_handle_kept_before_the_bound_is_checked_again_when_used(api_user, bearer, fake_node):
    from asgiref.sync import sync_to_async

    from sessions.models import GrammarHandle

    handle = await sync_to_async(GrammarHandle.objects.create)(kind="gbnf", source=BY_RULES, owner=api_user)
    answer = await request("POST", "/v1/chat/completions", key=bearer, body=_chat(str(handle.id)))
    assert answer.status == 400 and answer.json()["error"]["code"] == "invalid_grammar", answer.body
    assert fake_node.specs == []


@pytest.mark.parametrize("grammar", [
    JSON_GBNF,
    'root ::= "yes" | "no"',
    'root ::= b{0,1000}\nb ::= [a-z]{1,10}',  # each copy consumes text
    'root ::= (w " "?){0,100}\nw ::= [a-z]{1,20}',
    'root ::= b{0,4}\nb ::= [a-z]{0,1000}',  # four copies of something that can be empty
    'root ::= b{0,2}\nb ::= c{0,2}\nc ::= [a-z]{0,100}',
    'root ::= "[" (item ("," item)*)? "]"\nitem ::= "x" | "[" (item ("," item)*)? "]"',  # recursive
])
def test_grammars_within_the_bound_pass(grammar):
    from sessions.services import gbnf_problem

    assert gbnf_problem(grammar) is None


@pytest.mark.parametrize("grammar", [
    'root ::= ("a"?){0,1000}',  # 11,566 s a filter of the vocabulary, inline
    'root ::= ("a" | ""){0,200}',
    'root ::= (("a"{1,30} | ""){0,30}){0,30}',  # the inline bomb with its emptiness in an alternative
    'root ::= b{0,30} | "z" root\nb ::= c{0,30} | root "z"\nc ::= "a"{0,30}',  # hidden behind a recursion
    'root ::= b{0,4}\nb ::= c{0,4}\nc ::= [a-z]{0,4}',  # sixteen copies
])
def test_grammars_over_the_bound_are_refused(grammar):
    from sessions.services import gbnf_problem

    assert "can match nothing" in gbnf_problem(grammar)


def test_a_grammar_too_large_is_refused_naming_the_bound():
    from sessions.services import gbnf_problem

    rules = "\n".join(f"r{i} ::= r{i + 1}" for i in range(10_001))
    assert "(at most 10000)" in gbnf_problem(f"root ::= r0\n{rules}\nr10001 ::= \"a\"")
