"""A grammar's compile and cost probe run beside the decode loop, under a time limit (issue 50, item 1): the red
team's grammar kept a node's engine in one step for 5 min 15 s, and every lane of the node failed meanwhile."""

from __future__ import annotations

import threading

import pytest

from nodes.agent.engine import EngineConfig, beside, sampling
from nodes.agent.engine.local import Outcome, bundled_model_path
from nodes.link.spec import GenerateSpec

pytestmark = pytest.mark.slow

BY_RULES = 'root ::= b{0,30}\nb ::= c{0,30}\nc ::= d{0,30}\nd ::= "a"'


@pytest.fixture(scope="module")
def engine():
    from nodes.agent.engine.llama import LlamaEngine

    engine = LlamaEngine(EngineConfig(model_path=bundled_model_path(), model_name="smollm2", lanes=2, max_context=256))
    yield engine
    engine.close()


def chat(gen_id: str, question: str, **kwargs) -> GenerateSpec:
    return GenerateSpec(gen_id=gen_id, messages=[{"role": "user", "content": question}], temperature=0, **kwargs)


def drive(engine, outcomes: dict[str, Outcome], until) -> None:
    """Step the engine, gathering what each generation streamed, until `until()` holds or the engine is idle."""
    while engine.busy() and not until():
        for event in engine.step():
            outcomes.setdefault(event.gen_id, Outcome(event.gen_id)).add(event)


def submit(engine, outcomes: dict[str, Outcome], spec: GenerateSpec) -> None:
    for event in engine.submit(spec):
        outcomes.setdefault(event.gen_id, Outcome(event.gen_id)).add(event)


@pytest.fixture
def held_compile(monkeypatch):
    """Grammar compiles wait for the test to let them go (as llama.cpp keeps a costly one)."""
    release = threading.Event()
    compile_grammar = sampling._grammar

    def slow(model, gbnf):
        release.wait(30)
        return compile_grammar(model, gbnf)

    monkeypatch.setattr(sampling, "_grammar", slow)
    yield release
    release.set()


def test_another_lane_decodes_while_a_grammar_compiles(engine, held_compile):
    outcomes: dict[str, Outcome] = {}
    submit(engine, outcomes, chat("slow", "Is the sky blue?", grammar='root ::= "yes" | "no"', max_tokens=4))
    submit(engine, outcomes, chat("other", "Name a colour.", max_tokens=6, ignore_eos=True))
    drive(engine, outcomes, until=lambda: outcomes.get("other", Outcome("other")).done is not None)

    assert outcomes["other"].done.usage["completion_tokens"] == 6
    assert "slow" not in outcomes  # still compiling: not accepted, not refused, holding no lane
    held_compile.set()
    drive(engine, outcomes, until=lambda: False)
    assert outcomes["slow"].done is not None and outcomes["slow"].text in ("yes", "no")


def test_a_compile_past_the_limit_is_refused_as_a_bad_grammar_and_the_engine_goes_on(engine, held_compile,
                                                                                   monkeypatch):
    monkeypatch.setattr(beside, "PREPARE_LIMIT_S", 0.2)
    outcomes: dict[str, Outcome] = {}
    submit(engine, outcomes, chat("slow", "Is the sky blue?", grammar='root ::= "yes" | "no"', max_tokens=4))
    drive(engine, outcomes, until=lambda: False)

    error = outcomes["slow"].error
    assert error.code == "invalid_grammar" and not error.retryable  # the head answers 400 and places it nowhere else
    assert "limit of 0.2 s" in error.message and outcomes["slow"].accepted is None
    held_compile.set()
    submit(engine, outcomes, chat("after", "Name a colour.", max_tokens=4, ignore_eos=True))
    drive(engine, outcomes, until=lambda: False)
    assert outcomes["after"].done.usage["completion_tokens"] == 4


def test_a_generation_cancelled_while_its_grammar_compiles_ends_cancelled(engine, held_compile):
    outcomes: dict[str, Outcome] = {}
    submit(engine, outcomes, chat("slow", "Is the sky blue?", grammar='root ::= "yes" | "no"', max_tokens=4))
    for event in engine.cancel("slow"):
        outcomes.setdefault(event.gen_id, Outcome(event.gen_id)).add(event)

    assert outcomes["slow"].finish_reason == "cancelled" and not engine.busy()


def test_the_bomb_past_the_static_check_is_refused_by_the_probe_within_a_token_or_two(engine, monkeypatch):
    """What a node behind a head without the bound sees: its probe stops as soon as it is over its budget, instead of
    filtering 512 tokens through the bomb (5 min 15 s), while the other lane decodes."""
    monkeypatch.setattr(sampling, "repetition_problem", lambda source: None)
    outcomes: dict[str, Outcome] = {}
    submit(engine, outcomes, chat("bomb", "hi", grammar=BY_RULES, max_tokens=4))
    submit(engine, outcomes, chat("other", "Name a colour.", max_tokens=4, ignore_eos=True))
    drive(engine, outcomes, until=lambda: False)

    assert outcomes["bomb"].error.code == "invalid_grammar" and "too costly" in outcomes["bomb"].error.message
    assert outcomes["other"].done.usage["completion_tokens"] == 4
