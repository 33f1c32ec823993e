"""The mock engine: deterministic text, the shared lane/prefix-cache accounting, and really-spent costs."""

from __future__ import annotations

import time

import pytest

from nodes.agent.engine import EngineConfig, create_engine
from nodes.agent.engine.local import run_local
from nodes.agent.engine.mock import MockEngine
from nodes.agent.engine.runs import stop_cut
from nodes.link.messages import Accepted, decode, encode
from nodes.link.spec import GenerateSpec

LONG = " ".join(f"word{i}" for i in range(300))


def mock(**params) -> MockEngine:
    lanes = params.pop("lanes", 2)
    config = EngineConfig(model_name="mock-model", lanes=lanes, mock={"decode_tps": 2000, **params})
    engine = create_engine(config)
    assert isinstance(engine, MockEngine)
    return engine


def test_same_request_gives_the_same_text_and_other_prompts_differ():
    engine = mock()
    first = run_local(engine, [GenerateSpec(gen_id="a", prompt="tell me about lanes", max_tokens=12)])["a"]
    again = run_local(engine, [GenerateSpec(gen_id="b", prompt="tell me about lanes", max_tokens=12)])["b"]
    other = run_local(engine, [GenerateSpec(gen_id="c", prompt="something else entirely", max_tokens=12)])["c"]

    assert first.text == again.text
    assert first.text != other.text
    assert first.finish_reason == "length"
    assert first.done.usage["completion_tokens"] == 12 == len(first.ids)


def test_events_come_in_order_with_sequence_numbers_and_flush_batches():
    engine = create_engine(EngineConfig(lanes=1, flush_tokens=4, flush_ms=10_000, mock={"decode_tps": 2000}))
    outcome = run_local(engine, [GenerateSpec(gen_id="a", prompt="hello there", max_tokens=10)])["a"]

    assert outcome.accepted == Accepted(gen_id="a", prompt_tokens=2, cached_tokens=0, lane=0, evicted=[])
    assert outcome.seqs == [1, 2, 3, 4]  # 4 + 4 + 2 tokens, then done
    assert len(outcome.ids) == 10


def test_cached_tokens_follow_the_lane_prefix():
    engine = mock(lanes=2)
    run_local(engine, [GenerateSpec(gen_id="turn1", prompt=LONG, max_tokens=3)])
    second = run_local(engine, [GenerateSpec(gen_id="turn2", prompt=LONG + " and more words", max_tokens=3)])["turn2"]

    assert second.accepted.cached_tokens == 300
    assert second.done.usage == {"prompt_tokens": 303, "cached_tokens": 300, "completion_tokens": 3}
    assert second.done.evicted == []


def test_a_replaced_prefix_is_reported_as_evicted():
    engine = mock(lanes=1)
    run_local(engine, [GenerateSpec(gen_id="old", prompt="alpha beta gamma", max_tokens=2)])
    new = run_local(engine, [GenerateSpec(gen_id="new", prompt="alpha delta", max_tokens=2)])["new"]

    assert new.accepted.cached_tokens == 1
    # Reported at admission, so the head forgets the old prefix a whole generation earlier; done repeats it.
    assert new.accepted.evicted == ["old"]
    assert new.done.evicted == ["old"]


def test_the_accepted_message_forwards_the_evicted_generations_to_the_head():
    engine = mock(lanes=1)
    run_local(engine, [GenerateSpec(gen_id="old", prompt="alpha beta gamma", max_tokens=2)])
    new = run_local(engine, [GenerateSpec(gen_id="new", prompt="delta", max_tokens=2)])["new"]

    msg = decode(encode(new.accepted))  # the engine's event is the link message the head reads
    assert isinstance(msg, Accepted) and msg.evicted == ["old"] and msg.cached_tokens == 0


def test_reading_the_same_prompt_again_evicts_nobody():
    engine = mock(lanes=1)
    run_local(engine, [GenerateSpec(gen_id="first", prompt=LONG, max_tokens=2)])
    again = run_local(engine, [GenerateSpec(gen_id="again", prompt=LONG, max_tokens=2)])["again"]

    assert again.accepted.cached_tokens == 299  # the last prompt token is read again for its logits
    assert again.accepted.evicted == [] == again.done.evicted


def chat_turn(engine: MockEngine, gen_id: str, messages: list[dict[str, str]], max_tokens: int = 20):
    """One chat turn; the answer is appended to `messages` as a client would send it back."""
    outcome = run_local(engine, [GenerateSpec(gen_id=gen_id, messages=list(messages), max_tokens=max_tokens)])[gen_id]
    messages.append({"role": "assistant", "content": outcome.text.lstrip()})
    return outcome


def chat(topic: str, words: int = 60) -> list[dict[str, str]]:
    # Every chat starts with the same "<|system|>" token: a one-token match that must not steal a warm lane.
    return [
        {"role": "system", "content": " ".join(f"{topic}{i}" for i in range(words))},
        {"role": "user", "content": f"tell me about {topic}"},
    ]


def test_two_conversations_alternating_on_two_lanes_each_keep_their_own_lane():
    engine = mock(lanes=2)
    convs = {"a": chat("apples"), "b": chat("boats")}
    lanes: dict[str, set[int]] = {"a": set(), "b": set()}
    for turn in range(4):
        for name, messages in convs.items():
            if turn:
                messages.append({"role": "user", "content": f"and more on {name} please, turn {turn}"})
            out = chat_turn(engine, f"{name}{turn}", messages)
            lanes[name].add(out.accepted.lane)
            assert out.accepted.evicted == []
            if turn:
                # All but the new question (and the "<|assistant|>" marker) comes from the lane's cache.
                assert out.accepted.cached_tokens >= out.accepted.prompt_tokens - 12
    assert lanes["a"] == {0} and lanes["b"] == {1}


def test_a_new_unrelated_prompt_takes_an_empty_lane_rather_than_a_warm_one():
    engine = mock(lanes=3)
    warm = chat("apples")
    first = chat_turn(engine, "warm1", warm)
    other = chat_turn(engine, "other", chat("boats"))

    assert other.accepted.lane != first.accepted.lane
    assert other.accepted.cached_tokens == 0 and other.accepted.evicted == []
    warm.append({"role": "user", "content": "go on"})
    again = chat_turn(engine, "warm2", warm)
    assert again.accepted.lane == first.accepted.lane
    assert again.accepted.cached_tokens > 60


def test_with_no_empty_lane_the_least_valuable_then_least_recently_used_lane_is_evicted():
    engine = mock(lanes=2)
    chat_turn(engine, "older", chat("apples"))
    chat_turn(engine, "newer", chat("boats"))
    # Both lanes hold caches of the same size: the least recently used one goes.
    out = chat_turn(engine, "third", chat("cars"))
    assert out.accepted.evicted == ["older"]
    assert out.accepted.cached_tokens == 1  # only "<|system|>" was shared

    # A smaller cache is worth less than a bigger one, even when it was used more recently.
    engine = mock(lanes=2)
    chat_turn(engine, "big", chat("apples", words=200))
    chat_turn(engine, "small", chat("boats", words=20))
    out = chat_turn(engine, "third", chat("cars"))
    assert out.accepted.evicted == ["small"]


def test_a_shared_prefix_is_copied_into_an_empty_lane_and_nobody_is_evicted():
    engine = mock(lanes=3)
    system = " ".join(f"rule{i}" for i in range(100))
    base = [{"role": "system", "content": system}, {"role": "user", "content": "first question"}]
    first = chat_turn(engine, "first", base)
    # Another conversation on the same long system prompt: its 100+ tokens are copied into an empty lane, so the
    # first conversation keeps its whole cache.
    other = chat_turn(engine, "other", [{"role": "system", "content": system}, {"role": "user", "content": "hi"}])

    assert other.accepted.lane != first.accepted.lane
    assert other.accepted.cached_tokens > 100
    assert other.accepted.evicted == []
    assert engine.stats()["prefix_copies"] == 1
    base.append({"role": "user", "content": "and then?"})
    again = chat_turn(engine, "first2", base)
    assert again.accepted.lane == first.accepted.lane
    assert again.accepted.cached_tokens >= again.accepted.prompt_tokens - 6


def test_a_prefix_is_copied_from_a_lane_that_is_still_generating():
    engine = mock(lanes=2, decode_tps=200)
    system = " ".join(f"rule{i}" for i in range(100))
    long_answer = GenerateSpec(gen_id="busy", messages=[{"role": "system", "content": system},
                                                      {"role": "user", "content": "a long answer"}], max_tokens=50)
    engine.submit(long_answer)
    busy = engine.lanes[0]
    while len(busy.tokens) <= len(busy.run.tokens):  # until it has read its prompt and is generating
        engine.step()
    short = GenerateSpec(gen_id="copy", messages=[{"role": "system", "content": system},
                                                  {"role": "user", "content": "hi"}], max_tokens=3)
    accepted = next(e for e in engine.submit(short) if isinstance(e, Accepted))

    assert accepted.lane == 1
    assert accepted.cached_tokens > 100 and accepted.evicted == []
    while engine.busy():
        engine.step()


def test_a_generation_goes_next_to_the_busy_lanes_and_its_cache_swaps_in_without_losing_the_other():
    """llama.cpp reads only consecutive sequence ids in one pass: a warm cache in a far lane moves beside the busy
    ones, and the cache it displaces moves into the far lane rather than being thrown away."""
    engine = mock(lanes=4, decode_tps=200)
    convs = {name: chat(name) for name in ("apples", "boats", "cars", "dunes")}
    first = {name: chat_turn(engine, f"{name}1", messages) for name, messages in convs.items()}
    assert [first[name].accepted.lane for name in convs] == [0, 1, 2, 3]
    for name, messages in convs.items():
        messages.append({"role": "user", "content": f"more on {name}"})

    engine.submit(GenerateSpec(gen_id="apples2", messages=convs["apples"], max_tokens=50))
    assert engine.lanes[0].run is not None  # apples goes on in its own lane 0
    accepted = next(e for e in engine.submit(GenerateSpec(gen_id="dunes2", messages=convs["dunes"], max_tokens=3))
                    if isinstance(e, Accepted))

    assert accepted.lane == 1  # beside lane 0, not in lane 3 where its cache was
    assert accepted.cached_tokens >= accepted.prompt_tokens - 12 and accepted.evicted == []
    assert engine.stats()["lane_swaps"] == 1 and engine.stats()["prefix_copies"] == 0
    while engine.busy():
        engine.step()
    boats = chat_turn(engine, "boats2", convs["boats"])  # its cache now sits in lane 3
    assert boats.accepted.lane == 3 and boats.accepted.evicted == []
    assert boats.accepted.cached_tokens >= boats.accepted.prompt_tokens - 12


def test_of_two_lanes_beside_the_busy_one_the_empty_one_takes_the_moved_cache():
    engine = mock(lanes=5, decode_tps=200)
    convs = {name: chat(name) for name in ("apples", "boats", "cars")}
    for name, messages in convs.items():
        chat_turn(engine, f"{name}1", messages)  # lanes 0, 1, 2; lanes 3 and 4 stay empty
        messages.append({"role": "user", "content": "more"})
    engine.submit(GenerateSpec(gen_id="cars2", messages=convs["cars"], max_tokens=50))  # lane 2 busy
    accepted = next(e for e in engine.submit(GenerateSpec(gen_id="apples2", messages=convs["apples"], max_tokens=3))
                    if isinstance(e, Accepted))

    assert accepted.lane == 3 and accepted.cached_tokens >= accepted.prompt_tokens - 12  # not lane 1: boats stays
    while engine.busy():
        engine.step()
    boats = chat_turn(engine, "boats2", convs["boats"])
    assert boats.accepted.lane == 1 and boats.accepted.cached_tokens >= boats.accepted.prompt_tokens - 12


def test_a_failed_swap_empties_both_lanes_and_tells_the_head_what_they_held():
    engine = mock(lanes=4, decode_tps=200)
    convs = {name: chat(name) for name in ("apples", "boats", "cars", "dunes")}
    for name, messages in convs.items():
        chat_turn(engine, f"{name}1", messages)
    engine._swap_lanes = lambda a, b: False  # as the llama engine reports a KV state it could not write back
    engine.submit(GenerateSpec(gen_id="apples2", messages=convs["apples"], max_tokens=50))
    accepted = next(e for e in engine.submit(GenerateSpec(gen_id="dunes2", messages=convs["dunes"], max_tokens=3))
                    if isinstance(e, Accepted))

    assert sorted(accepted.evicted) == ["boats1", "dunes1"] and accepted.cached_tokens == 0
    assert accepted.lane == 1 and engine.lanes[3].tokens == [] and engine.stats()["lane_swaps"] == 0
    while engine.busy():
        engine.step()


def test_with_no_lane_busy_a_warm_cache_stays_where_it_is():
    engine = mock(lanes=4)
    convs = {name: chat(name) for name in ("apples", "boats", "cars", "dunes")}
    for name, messages in convs.items():
        chat_turn(engine, f"{name}1", messages)
    convs["dunes"].append({"role": "user", "content": "more"})
    again = chat_turn(engine, "dunes2", convs["dunes"])
    assert again.accepted.lane == 3 and engine.stats()["lane_swaps"] == 0


def test_a_short_shared_prefix_is_read_again_rather_than_copied():
    engine = mock(lanes=2)
    chat_turn(engine, "first", chat("apples", words=10))
    other = chat_turn(engine, "other", [{"role": "system", "content": " ".join(f"apples{i}" for i in range(10))},
                                        {"role": "user", "content": "something else"}])

    assert other.accepted.cached_tokens == 0  # ~12 shared tokens: below COPY_MIN_TOKENS
    assert engine.stats()["prefix_copies"] == 0


def test_prefill_cost_is_spent_only_on_uncached_tokens():
    engine = mock(lanes=1, prefill_ms_per_token=1.0, decode_tps=1000)
    cold = run_local(engine, [GenerateSpec(gen_id="cold", prompt=LONG, max_tokens=2)])["cold"]
    warm = run_local(engine, [GenerateSpec(gen_id="warm", prompt=LONG, max_tokens=2)])["warm"]

    assert cold.done.timings["ttft_ms"] >= 250  # 300 tokens at 1 ms each
    assert warm.done.timings["ttft_ms"] < cold.done.timings["ttft_ms"] / 5
    assert warm.done.usage["cached_tokens"] == 299


def test_decode_rate_is_honoured_and_lanes_decode_together():
    engine = mock(lanes=4, decode_tps=100, prefill_ms_per_token=0)
    started = time.perf_counter()
    outcomes = run_local(engine, [GenerateSpec(gen_id=f"g{i}", prompt=f"p{i}", max_tokens=20) for i in range(4)])
    elapsed = time.perf_counter() - started

    assert all(o.finish_reason == "length" for o in outcomes.values())
    # 20 steps of 10 ms serve all four lanes at once: nowhere near the 0.8 s four lanes one by one would take.
    assert 0.18 <= elapsed < 0.6
    assert max(o.done.timings["decode_tps"] for o in outcomes.values()) <= 110


def test_stop_string_ends_the_generation_and_is_never_emitted():
    engine = mock(words=["alpha", "beta", "gamma", "delta"])
    full = run_local(engine, [GenerateSpec(gen_id="a", prompt="x", max_tokens=8)])["a"].text
    stop = full.split()[2]
    stopped = run_local(engine, [GenerateSpec(gen_id="b", prompt="x", max_tokens=8, stop=["zzz", " " + stop])])["b"]

    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(" " + stop)]
    assert stop not in stopped.text
    assert stopped.done.usage["stop_index"] == 1  # which one (Anthropic's stop_sequence); none when none ended it
    assert "stop_index" not in run_local(engine, [GenerateSpec(gen_id="c", prompt="x", max_tokens=8)])["c"].done.usage


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello world", ["wor"], (6, 6)),  # complete stop: cut before it
        ("hello wo", ["world"], (None, 6)),  # "wo" may grow into "world": hold it back
        ("hello", ["xyz"], (None, 5)),
        ("ab", ["b", "abc"], (1, 1)),
    ],
)
def test_stop_cut(text, stops, expected):
    assert stop_cut(text, stops) == expected


def test_cancel_and_deadline_finish_with_their_reasons():
    engine = mock(lanes=2, decode_tps=200)

    def cancel_after_three(step, _events):
        return engine.cancel("slow") if step == 3 else []

    out = run_local(engine, [GenerateSpec(gen_id="slow", prompt="a", max_tokens=500)], on_step=cancel_after_three)
    assert out["slow"].finish_reason == "cancelled"
    assert 1 <= len(out["slow"].ids) < 10

    late = run_local(engine, [GenerateSpec(gen_id="late", prompt="b", max_tokens=500, deadline=time.time() + 0.1)])
    assert late["late"].finish_reason == "deadline"
    gone = run_local(engine, [GenerateSpec(gen_id="gone", prompt="c", deadline=time.time() - 1)])
    assert gone["gone"].finish_reason == "deadline" and gone["gone"].ids == []
    # It never had a lane, and its done still crosses the link (a None lane was a protocol error that cut the node).
    assert gone["gone"].done.lane == -1
    frame = encode(gone["gone"].done)
    assert decode(frame).lane == -1


def test_errors_have_codes_and_clear_messages():
    engine = mock(context_window=64)
    out = run_local(
        engine,
        [
            GenerateSpec(gen_id="long", prompt=LONG),
            GenerateSpec(gen_id="grammar", prompt="x", grammar="not a grammar"),
            GenerateSpec(gen_id="zero", prompt="x", max_tokens=0),
        ],
    )
    assert out["long"].error.code == "context_length_exceeded"
    assert "300 tokens" in out["long"].error.message and "64" in out["long"].error.message
    assert out["grammar"].error.code == "invalid_grammar"
    assert out["zero"].error.code == "invalid_request"
    assert not engine.busy()


def test_more_generations_than_lanes_wait_their_turn_in_order():
    engine = mock(lanes=1)
    out = run_local(engine, [GenerateSpec(gen_id=f"g{i}", prompt=f"p{i}", max_tokens=3) for i in range(3)])

    assert [o.finish_reason for o in out.values()] == ["length"] * 3
    ends = [o.done.timings["total_ms"] for o in out.values()]
    assert ends == sorted(ends)


def test_stats_and_state_ops():
    engine = mock(lanes=3)
    engine.submit(GenerateSpec(gen_id="a", prompt="one two three", max_tokens=50))
    engine.step()
    stats = engine.stats()
    assert stats["lanes_busy"] == 1 and stats["lanes"] == 3
    assert stats["kv_used"] >= 3 and stats["kv_total"] == 3 * 2048

    assert len(engine.state_op("tokenize", {"text": "one two three"})["tokens"]) == 3
    vectors = engine.state_op("embed", {"texts": ["a", "b"]})["embeddings"]
    assert len(vectors) == 2 and vectors[0] != vectors[1]
    assert engine.info()["engine"] == "mock"


def test_a_resumed_run_completes_a_character_the_first_node_left_unfinished():
    from nodes.agent.engine.runs import Run

    star = "🌟".encode()
    run = Run(spec=GenerateSpec(gen_id="g", prompt="x"), tokens=[1], submitted_at=0.0)
    run.continue_after([b"Look: ", star[:2]])  # the last streamed token held half of the emoji
    run.add_token(7, star[2:], None, 0.0)
    run.release_all(0.0)
    assert run.take_batch(0.0, force=True).text == ["🌟"]


def test_a_thinking_past_its_budget_is_closed_and_the_lane_reads_the_close_before_it_answers():
    """Budget forcing: once a generation's thinking (from the <think> it opened with) has used thinking_budget tokens
    without a </think>, the node streams "\\n</think>\\n\\n" as its next tokens and reads them into the lane, so the
    model answers after them; without a budget, or with a grammar the close might not follow, nothing is forced."""
    from nodes.agent.vocab import mock_token_id

    engine = mock(lanes=1, words=["<think>"])
    spec = GenerateSpec(gen_id="t", prompt="Think about lanes.", max_tokens=8, thinking_budget=3)
    forced = run_local(engine, [spec])["t"]
    assert forced.texts == [" <think>"] * 3 + ["\n</think>", "\n\n"] + [" <think>"] * 3
    assert forced.done.usage["completion_tokens"] == 8 and forced.finish_reason == "length"
    closing = [mock_token_id("\n</think>"), mock_token_id("\n\n")]
    lane = engine.lanes[0].tokens
    at = lane.index(closing[0])
    assert lane[at:at + 2] == closing and len(lane) - at == 2 + 3 - 1  # read, then answered after (the last unread)
    free = run_local(engine, [GenerateSpec(gen_id="f", prompt="Think about lanes.", max_tokens=8)])["f"]
    assert "</think>" not in free.text
    grammar = GenerateSpec(gen_id="g", prompt="Think.", max_tokens=8, thinking_budget=3, grammar='root ::= "x"')
    assert "</think>" not in run_local(engine, [grammar])["g"].text
