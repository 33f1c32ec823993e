"""The batched llama.cpp engine against the real SmolLM2-135M-Instruct model, in-process."""

from __future__ import annotations

import json
import math
import time

import pytest

from nodes.agent.engine import EngineConfig
from nodes.agent.engine.local import Outcome, bundled_model_path, run_local
from nodes.link.spec import GenerateSpec

pytestmark = pytest.mark.slow

WINDOW = 512


@pytest.fixture(scope="module")
def engine():
    from nodes.agent.engine.llama import LlamaEngine

    config = EngineConfig(model_path=bundled_model_path(), model_name="smollm2", lanes=4, max_context=WINDOW)
    engine = LlamaEngine(config)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def invariant_engine():
    """A `node_join --batch-invariant` engine: flash attention off, so batched greedy output equals solo output."""
    from nodes.agent.engine.llama import LlamaEngine

    config = EngineConfig(model_path=bundled_model_path(), model_name="smollm2", lanes=4, max_context=WINDOW,
                          batch_invariant=True)
    engine = LlamaEngine(config)
    yield engine
    engine.close()


def chat(gen_id: str, question: str, **kwargs) -> GenerateSpec:
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 32)
    return GenerateSpec(gen_id=gen_id, messages=[{"role": "user", "content": question}], **kwargs)


def one(engine, spec: GenerateSpec) -> Outcome:
    outcome = run_local(engine, [spec])[spec.gen_id]
    assert not engine.busy()
    return outcome


def test_chat_answer_streams_real_tokens(engine):
    out = one(engine, chat("paris", "What is the capital of France? Answer in one word."))

    assert out.error is None
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.accepted.prompt_tokens == out.done.usage["prompt_tokens"] > 10
    assert out.done.usage["completion_tokens"] == len(out.ids) == len(out.texts)
    assert engine.state_op("detokenize", {"tokens": out.ids})["text"] == out.text
    timings = out.done.timings
    assert 0 < timings["prompt_ms"] <= timings["ttft_ms"] <= timings["total_ms"]
    assert engine.info()["capabilities"]["chat"] is True


def test_greedy_is_deterministic(engine):
    first = one(engine, chat("g1", "Write a short poem about the sea.", max_tokens=24))
    second = one(engine, chat("g2", "Write a short poem about the sea.", max_tokens=24))

    assert first.ids == second.ids and len(first.ids) == 24


def test_stop_string_ends_the_answer_and_is_not_emitted(engine):
    full = one(engine, chat("full", "Count from one to ten in words.", max_tokens=40)).text
    words = full.split()
    stop = words[len(words) // 2]
    cut = one(engine, chat("cut", "Count from one to ten in words.", max_tokens=40, stop=[stop]))

    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
    assert stop not in cut.text


def test_max_tokens_finishes_with_length(engine):
    out = one(engine, chat("len", "Tell me a long story about a dragon.", max_tokens=5))

    assert out.finish_reason == "length"
    assert out.done.usage["completion_tokens"] == 5


def test_gbnf_grammar_constrains_the_answer(engine):
    out = one(engine, chat("yn", "Is the sky green?", grammar='root ::= "yes" | "no"', max_tokens=8))

    assert out.text in {"yes", "no"}
    assert out.finish_reason == "stop"


def test_a_grammar_with_no_way_forward_fails_that_generation_only(engine):
    # Once "yes" is out only end-of-generation is allowed, and the bias forbids it: llama.cpp would abort
    # the process if the engine let the grammar accept a token anyway.
    no_end = {t: -math.inf for t in engine.model.eog_ids}
    stuck = chat("stuck", "Is the sky blue?", grammar='root ::= "yes"', logit_bias=no_end, max_tokens=8)
    out = run_local(engine, [stuck, chat("fine", "Say hello.", max_tokens=4)])

    assert out["stuck"].text == "yes"
    assert out["stuck"].error.code == "invalid_grammar" and out["stuck"].done is None
    assert out["fine"].finish_reason == "length"


def test_json_schema_output_parses_and_matches(engine):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    out = one(engine, chat("json", "Describe a person as JSON.", json_schema=json.dumps(schema), max_tokens=60))

    value = json.loads(out.text)
    assert set(value) == {"name", "age"}
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


def test_logit_bias_keeps_a_token_out(engine):
    plain = one(engine, chat("plain", "What is the capital of France?", max_tokens=12))
    banned = plain.ids[0]
    biased = one(engine, chat("biased", "What is the capital of France?", max_tokens=12, logit_bias={banned: -100.0}))

    assert banned not in biased.ids
    assert biased.text != plain.text


def test_logprobs_come_with_top_alternatives(engine):
    out = one(engine, chat("lp", "Say hello.", max_tokens=6, logprobs=True, top_logprobs=3))

    assert len(out.logprobs) == len(out.ids) == 6
    for text, entry in zip(out.texts, out.logprobs, strict=True):
        assert entry["logprob"] <= 0.0
        assert len(entry["top"]) == 3
        tops = [t["logprob"] for t in entry["top"]]
        assert tops == sorted(tops, reverse=True)
        # Greedy picks the most likely token: the sampled one is the top alternative.
        assert entry["top"][0]["token"] == entry["token"] and entry["token"].endswith(text)
        assert entry["logprob"] == pytest.approx(tops[0])
    # the raw bytes of the pieces are the generation's text, even where a piece holds part of a character
    assert bytes(b for entry in out.logprobs for b in entry["bytes"]).decode() == "".join(out.texts)


def test_a_token_that_holds_part_of_a_character_keeps_its_raw_bytes(engine):
    from nodes.agent.engine.sampling import _piece
    ids = engine.model.tokenize("🌟", False, False)
    pieces = [_piece(engine.model, t) for t in ids]
    assert len(ids) > 1 and "\ufffd" in pieces[0]["token"]  # this tokenizer splits the emoji mid-character
    assert bytes(b for p in pieces for b in p["bytes"]).decode() == "🌟"


def test_a_default_engine_is_fast_and_refuses_a_request_for_batch_invariance(engine, invariant_engine):
    info = engine.info()
    assert info["flash_attn"] == "auto" and info["capabilities"]["batch_invariant"] is False
    assert invariant_engine.info()["flash_attn"] == "off"
    assert invariant_engine.info()["capabilities"]["batch_invariant"] is True
    out = one(engine, chat("inv", "Hi", batch_invariant=True))
    assert out.error.code == "invalid_request" and "--batch-invariant" in out.error.message and not out.ids
    served = one(invariant_engine, chat("inv2", "Hi", max_tokens=2, batch_invariant=True))
    assert served.error is None and len(served.ids) == 2


def test_concurrent_greedy_generations_match_the_same_prompts_run_alone(invariant_engine):
    engine = invariant_engine
    questions = ["What is 2+2?", "Name three colors.", "Write a haiku about rain.", "Who wrote Hamlet?"]
    alone = {f"a{i}": one(engine, chat(f"a{i}", q, max_tokens=24, ignore_eos=True)) for i, q in enumerate(questions)}
    together = run_local(engine, [chat(f"t{i}", q, max_tokens=24, ignore_eos=True) for i, q in enumerate(questions)])

    assert len({o.accepted.lane for o in together.values()}) == 4
    for i in range(len(questions)):
        assert together[f"t{i}"].finish_reason == "length"
        assert together[f"t{i}"].ids == alone[f"a{i}"].ids


def test_same_long_prompt_twice_reuses_the_prefix(engine):
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: be precise and kind." for i in range(40))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}]
    first = one(engine, GenerateSpec(gen_id="p1", messages=messages, max_tokens=4, temperature=0))
    second = one(engine, GenerateSpec(gen_id="p2", messages=messages, max_tokens=4, temperature=0))

    prompt = first.done.usage["prompt_tokens"]
    assert prompt > 300
    assert first.done.usage["cached_tokens"] < prompt // 2
    assert second.done.usage["cached_tokens"] == prompt - 1  # only the last token is read again
    assert second.done.timings["prompt_ms"] < first.done.timings["prompt_ms"] / 3
    assert second.ids == first.ids


@pytest.mark.parametrize("kind", ["engine", "invariant_engine"])
def test_a_shared_system_prompt_is_copied_from_a_busy_lane_and_both_answers_are_unchanged(kind, request):
    """The copy works on both settings; only a batch-invariant engine promises the same tokens as solo runs."""
    from nodes.agent.engine.llama import LlamaEngine

    engine = request.getfixturevalue(kind)

    system = "You answer for the fleet desk. " + " ".join(f"Policy {i}: answer briefly." for i in range(30))

    def ask(gen_id: str, question: str) -> GenerateSpec:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return GenerateSpec(gen_id=gen_id, messages=messages, max_tokens=24, temperature=0, ignore_eos=True)

    # References on a one-lane engine: the donor read fresh, then the copier reusing the system prompt in place,
    # so each reads exactly the token chunks it reads below (llama.cpp's numerics depend on the chunk shapes).
    config = EngineConfig(model_path=bundled_model_path(), model_name="smollm2", lanes=1, max_context=WINDOW,
                          batch_invariant=engine.config.batch_invariant)
    single = LlamaEngine(config)
    try:
        donor_alone = one(single, ask("donor-alone", "What is a lane?"))
        copier_alone = one(single, ask("copier-alone", "What is a node?"))
    finally:
        single.close()
    assert donor_alone.accepted.cached_tokens == 0 and copier_alone.accepted.cached_tokens > 150

    seen: dict[str, int] = {}

    def submit_once_the_donor_generates(step, events):
        lane = next((la for la in engine.lanes if la.run is not None and la.run.gen_id == "donor"), None)
        if not seen and lane is not None and len(lane.tokens) > len(lane.run.tokens):
            seen.update(lane=lane.index, copies=engine.stats()["prefix_copies"])
            return engine.submit(ask("copier", "What is a node?"))
        return []

    both = run_local(engine, [ask("donor", "What is a lane?")], on_step=submit_once_the_donor_generates)

    copier = both["copier"]
    assert copier.accepted.lane != seen["lane"]
    assert copier.accepted.cached_tokens == copier_alone.accepted.cached_tokens  # from the donor's lane
    assert "donor" not in copier.accepted.evicted
    assert engine.stats()["prefix_copies"] == seen["copies"] + 1
    assert len(both["donor"].ids) == len(copier.ids) == 24
    if engine.config.batch_invariant:
        assert both["donor"].ids == donor_alone.ids  # the donor went on undisturbed
        assert copier.ids == copier_alone.ids  # and the copied cache reads exactly like the lane's own


def test_caches_swapped_to_keep_busy_lanes_together_read_exactly_as_in_place():
    """A warm conversation in a far lane moves beside the busy lane (llama.cpp reads only consecutive sequence ids
    in one pass), and the conversation it displaces moves out to the far lane: both KV caches survive the swap
    through host memory and answer token for token as on a one-lane engine that never moved anything."""
    from nodes.agent.engine.llama import LlamaEngine

    def config(lanes: int) -> EngineConfig:
        return EngineConfig(model_path=bundled_model_path(), model_name="smollm2", lanes=lanes, max_context=WINDOW,
                            batch_invariant=True)

    questions = {"a": "What is a lane?", "b": "Name a boat.", "c": "What is a car?", "d": "Describe a dune."}

    def ask(gen_id: str, messages: list[dict]) -> GenerateSpec:
        return GenerateSpec(gen_id=gen_id, messages=messages, max_tokens=16, temperature=0, ignore_eos=True)

    def opening(name: str) -> list[dict]:
        # a system prompt of its own: the template's default one would be a prefix all four share
        return [{"role": "system", "content": f"Desk {name}."}, {"role": "user", "content": questions[name]}]

    def first(name: str) -> GenerateSpec:
        return ask(f"{name}1", opening(name))

    def second(name: str, answer: Outcome) -> GenerateSpec:
        return ask(f"{name}2", [*opening(name),
                                {"role": "assistant", "content": "".join(answer.texts)},
                                {"role": "user", "content": "Tell me more."}])

    single = LlamaEngine(config(1))
    try:
        reference, answers = {}, {}
        for name in ("d", "b"):
            answers[name] = one(single, first(name))
            reference[name] = one(single, second(name, answers[name]))
    finally:
        single.close()
    assert all(ref.accepted.cached_tokens > 20 for ref in reference.values())

    engine = LlamaEngine(config(4))
    try:
        firsts = {name: one(engine, first(name)) for name in questions}
        assert [firsts[name].accepted.lane for name in questions] == [0, 1, 2, 3]
        assert all(firsts[name].ids == answers[name].ids for name in answers)  # so the second turns match too

        def submit_d_once_a_generates(step, events):
            lane = engine.lanes[0]
            if not engine.stats()["lane_swaps"] and lane.run is not None and len(lane.tokens) > len(lane.run.tokens):
                return engine.submit(second("d", firsts["d"]))
            return []

        both = run_local(engine, [second("a", firsts["a"])], on_step=submit_d_once_a_generates)
        moved = both["d2"]
        assert both["a2"].accepted.lane == 0 and moved.accepted.lane == 1  # beside lane 0, not in lane 3
        assert engine.stats()["lane_swaps"] == 1
        displaced = one(engine, second("b", firsts["b"]))
        assert displaced.accepted.lane == 3  # b's cache went out to lane 3
        for name, outcome in (("d", moved), ("b", displaced)):
            assert outcome.accepted.evicted == []
            assert outcome.accepted.cached_tokens == reference[name].accepted.cached_tokens
            assert outcome.ids == reference[name].ids
    finally:
        engine.close()


def test_each_step_reads_its_lanes_in_index_order():
    """llama.cpp puts sequences into one pass only when their ids follow one another in batch order: a prompt
    read on lane 0 while lanes 1 and 2 decode goes first in the batch, not after their tokens."""
    from nodes.agent.engine.llama import LlamaEngine

    engine = LlamaEngine(EngineConfig(model_path=bundled_model_path(), model_name="smollm2", lanes=4,
                                      max_context=WINDOW))
    orders: list[list[int]] = []
    add = engine.batch.add

    def recording_add(tokens, pos, seq, sample):
        if engine.batch.n == 0:
            orders.append([])
        orders[-1].append(seq)
        return add(tokens, pos, seq, sample)

    engine.batch.add = recording_add
    try:
        def submit_on_lane_0_once_it_frees(step, events):
            if engine.lanes[0].run is None and not seen:
                seen.add("g4")
                return engine.submit(chat("g4", "What is 2+2? Answer in one word.", max_tokens=4))
            return []

        seen: set[str] = set()
        specs = [chat("g1", "What is 2+2?", max_tokens=2), chat("g2", "Name three colors.", max_tokens=40),
                 chat("g3", "Who wrote Hamlet?", max_tokens=40)]
        out = run_local(engine, specs, on_step=submit_on_lane_0_once_it_frees)
    finally:
        engine.close()
    assert [out[g].accepted.lane for g in ("g1", "g2", "g3", "g4")] == [0, 1, 2, 0]
    # g4's prompt went into a batch with lanes 1 and 2 decoding, and in every batch the lanes ascend
    assert any(order[0] == 0 and {1, 2} <= set(order) for order in orders[2:])
    assert all(order == sorted(order) for order in orders)


def test_prompt_longer_than_the_window_is_refused(engine):
    out = one(engine, GenerateSpec(gen_id="huge", prompt="hello " * 2 * WINDOW, max_tokens=4))

    assert out.error.code == "context_length_exceeded"
    assert str(WINDOW) in out.error.message and "tokens" in out.error.message
    assert out.error.retryable is False and out.done is None


def test_bad_input_gets_error_codes(engine):
    out = run_local(
        engine,
        [
            chat("bad-grammar", "hi", grammar="root ::= (("),
            chat("bad-schema", "hi", json_schema="{not json"),
            chat("bad-penalty", "hi", repeat_penalty=0.0),
            chat("bad-bias", "hi", logit_bias={10**9: 1.0}),
        ],
    )
    assert out["bad-grammar"].error.code == "invalid_grammar"
    assert out["bad-schema"].error.code == "invalid_grammar"
    assert out["bad-penalty"].error.code == "invalid_request"
    assert out["bad-bias"].error.code == "invalid_request"


def test_cancel_stops_a_running_generation(engine):
    def cancel_soon(step, _events):
        return engine.cancel("story") if step == 4 else []

    spec = chat("story", "Tell me a very long story.", max_tokens=200, ignore_eos=True)
    out = run_local(engine, [spec], on_step=cancel_soon)["story"]

    assert out.finish_reason == "cancelled"
    assert 0 < len(out.ids) < 10
    assert engine.cancel("story") == []  # already gone


def test_deadline_ends_a_generation(engine):
    spec = chat("late", "Tell me a very long story.", max_tokens=400, ignore_eos=True, deadline=time.time() + 0.5)
    out = one(engine, spec)

    assert out.finish_reason == "deadline"
    assert 0 < len(out.ids) < 400


def test_resume_text_continues_where_another_node_stopped(engine):
    base = one(engine, chat("base", "Write a short poem about the sea.", max_tokens=24, ignore_eos=True))
    streamed = "".join(base.texts[:10])
    resumed = one(engine, chat("resume", "Write a short poem about the sea.", max_tokens=14, resume_text=streamed))

    resume_tokens = len(engine.state_op("tokenize", {"text": streamed})["tokens"])
    assert resumed.done.usage["prompt_tokens"] == base.done.usage["prompt_tokens"] + resume_tokens
    assert streamed + resumed.text == base.text


@pytest.fixture
def other_node():
    """A second engine on the same model, standing for the node a generation fails over to: nothing cached."""
    from nodes.agent.engine.llama import LlamaEngine

    config = EngineConfig(model_path=bundled_model_path(), model_name="smollm2", lanes=2, max_context=WINDOW)
    engine = LlamaEngine(config)
    yield engine
    engine.close()


@pytest.mark.parametrize("sampling", [
    {"temperature": 0},
    {"temperature": 0.9, "seed": 1234},
    {"temperature": 0.9, "seed": 99, "repeat_penalty": 1.3,
     "json_schema": json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})},
], ids=["greedy", "seeded", "seeded-penalised-grammar"])
def test_a_generation_resumed_from_its_token_ids_on_another_node_goes_on_token_for_token(engine, other_node,
                                                                                        sampling):
    question = "Invent a person and describe them: a name and a few words."
    if "json_schema" not in sampling:
        sampling = {**sampling, "ignore_eos": True}
    base = one(engine, chat("whole", question, max_tokens=28, **sampling))
    assert len(base.ids) >= 8, base.text
    cut = len(base.ids) // 2
    resumed = one(other_node, chat("rest", question, max_tokens=len(base.ids) - cut,
                                   resume_text="".join(base.texts[:cut]), resume_ids=base.ids[:cut], **sampling))
    assert resumed.accepted.cached_tokens == 0  # read from scratch, as on a node that never saw it
    assert resumed.ids == base.ids[cut:]
    assert "".join(base.texts[:cut]) + resumed.text == base.text


def test_a_seeded_generation_repeats_and_another_seed_differs(engine):
    runs = [one(engine, chat(f"s{i}", "Invent a word.", max_tokens=12, temperature=1.0, seed=seed))
            for i, seed in enumerate((5, 5, 6))]
    assert runs[0].ids == runs[1].ids != runs[2].ids


def test_resume_text_advances_the_grammar(engine):
    schema = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    out = one(engine, chat("rj", "Name a city as JSON.", json_schema=schema, resume_text='{"city": "', max_tokens=30))

    assert json.loads('{"city": "' + out.text)["city"]
    wrong = one(engine, chat("rw", "Name a city.", grammar='root ::= "yes" | "no"', resume_text="maybe"))
    assert wrong.error.code == "invalid_request"


def test_seeded_sampling_repeats(engine):
    spec = {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "seed": 42, "max_tokens": 16}
    a = one(engine, chat("s1", "Invent a word.", **spec))
    b = one(engine, chat("s2", "Invent a word.", **spec))

    assert a.ids == b.ids  # what each penalty and top_k change: test_each_penalty_and_top_k_changes_what_...


def test_each_penalty_and_top_k_changes_what_the_node_generates(engine):
    """Each knob alone, against the same run without it: a node that dropped one would answer the same."""
    def run(gen_id, **knobs):  # a text that begs to go on repeating itself, so a penalty bites at once
        return one(engine, GenerateSpec(gen_id=gen_id, prompt="cat " * 12, max_tokens=8, ignore_eos=True, **knobs))

    base = run("pen-base", temperature=0)
    for knob, value in (("repeat_penalty", 1.5), ("frequency_penalty", 2.0), ("presence_penalty", 2.0)):
        penalised = run(f"pen-{knob}", temperature=0, **{knob: value})
        assert penalised.ids != base.ids, f"{knob} changed nothing: {base.text!r}"
    # top_k 1 leaves one candidate a step, so even a hot sampled run gives the greedy answer
    assert run("topk-1", temperature=1.5, top_p=1.0, min_p=0.0, seed=7, top_k=1).ids == base.ids


def test_top_p_and_min_p_each_narrow_a_hot_run_to_the_greedy_answer(engine):
    """top_p near 0 keeps only the likeliest token (the nucleus holds at least one), and so does min_p 1 (a token at
    least as likely as the likeliest): each alone makes a hot sampled run the greedy one. A node that dropped either
    sampler would answer as the hot run without it, which differs."""
    def run(gen_id, **knobs):
        return one(engine, GenerateSpec(gen_id=gen_id, prompt="cat " * 12, max_tokens=8, ignore_eos=True, **knobs))

    greedy = run("narrow-greedy", temperature=0)
    hot = {"temperature": 2.0, "top_k": 0, "seed": 7}
    assert run("narrow-none", top_p=1.0, min_p=0.0, **hot).ids != greedy.ids  # unnarrowed, it wanders
    assert run("narrow-top-p", top_p=1e-6, min_p=0.0, **hot).ids == greedy.ids
    assert run("narrow-min-p", top_p=1.0, min_p=1.0, **hot).ids == greedy.ids


def test_more_generations_than_lanes_queue_in_order(engine):
    out = run_local(engine, [chat(f"q{i}", f"Say the number {i}.", max_tokens=3, ignore_eos=True) for i in range(5)])

    assert all(o.finish_reason == "length" for o in out.values())
    assert out["q4"].done.timings["ttft_ms"] > out["q0"].done.timings["ttft_ms"]


def test_embeddings_and_tokenize(engine):
    result = engine.state_op("embed", {"texts": ["a cat sat on the mat", "a kitten sat on a rug", "tax law"]})
    cat, kitten, tax = result["embeddings"]

    def dot(a, b):
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert len(cat) == engine.model.n_embd
    assert dot(cat, cat) == pytest.approx(1.0, abs=1e-4)
    assert dot(cat, kitten) > dot(cat, tax)
    assert engine.state_op("tokenize", {"text": "hello world"})["tokens"]


def test_park_saves_lanes_and_a_new_engine_starts_warm(tmp_path):
    from nodes.agent.engine.llama import LlamaEngine

    config = EngineConfig(model_path=bundled_model_path(), lanes=2, max_context=WINDOW, park_dir=str(tmp_path))
    messages = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": "Hi."}]
    first = LlamaEngine(config)
    cold = one(first, GenerateSpec(gen_id="cold", messages=messages, max_tokens=4, temperature=0))
    first.idle_work()
    first.close()

    second = LlamaEngine(config)
    assert second.info()["warm_lanes"] == 1
    assert second.info()["warm_generations"] == ["cold"]  # what the node tells the head it still holds
    warm = one(second, GenerateSpec(gen_id="warm", messages=messages, max_tokens=4, temperature=0))
    second.close()

    assert cold.done.usage["cached_tokens"] == 0
    assert warm.done.usage["cached_tokens"] == warm.done.usage["prompt_tokens"] - 1
    assert warm.ids == cold.ids
    # a cache parked under other context settings (flash attention) does not load (llama.cpp refuses the layout):
    # that engine starts cold rather than wrong
    other = LlamaEngine(EngineConfig(**{**config.to_dict(), "batch_invariant": True}))
    assert other.info()["warm_lanes"] == 0
    other.close()


def test_the_heartbeat_carries_the_prefill_rate_and_decode_slowdown_the_engine_measured(engine):
    from nodes.agent.dialer import heartbeat_of
    from nodes.agent.engine.pace import Pace

    engine.pace = Pace()  # measured afresh, whatever this module's earlier tests ran
    long_question = "Summarise the history of the bicycle in Europe, decade by decade, with dates. " * 12
    solo = run_local(engine, [chat("pace-solo", long_question, max_tokens=8, ignore_eos=True)])["pace-solo"]
    read = solo.done.usage["prompt_tokens"] - solo.done.usage["cached_tokens"]
    # the rate its heartbeat reports is the one its own timings show for reading that prompt
    assert read > 100
    assert heartbeat_of(engine.stats(), engine_ready=True).prefill_tps == pytest.approx(
        read / solo.done.timings["prompt_ms"] * 1000, rel=0.25)

    # decode steps with one lane and with four, taking turns (so another process busy on the machine for a while
    # slows both kinds alike)
    for turn in range(3):
        run_local(engine, [chat(f"pace-1-{turn}", "Name a river.", max_tokens=16, ignore_eos=True)])
        run_local(engine, [chat(f"pace-4-{turn}-{i}", f"Name a river in country number {i}.", max_tokens=16,
                                ignore_eos=True) for i in range(4)])
    heartbeat = heartbeat_of(engine.stats(), engine_ready=True)

    # each further lane decoding makes a step slower, by less than a second
    assert 0 < heartbeat.decode_slowdown_ms < 1000


def test_a_grammar_too_costly_to_sample_fails_alone_at_once(engine, monkeypatch):
    """`((("a"{0,30}){0,30}){0,30})` (62 bytes) held a node's decode loop for 59 minutes. Refused before any step:
    nested inline or through rule references (the static check), or too slow a filter of the vocabulary (the timed
    probe: here with a budget made tiny); the generation beside them runs."""
    from nodes.agent.engine import sampling

    nested = chat("nested", "hi", grammar='root ::= ((("a"{0,30}){0,30}){0,30})', max_tokens=4)
    by_rules = chat("by-rules", "hi", grammar='root ::= y{0,10}\ny ::= x{0,10}\nx ::= "a"{0,10}', max_tokens=4)
    out = run_local(engine, [nested, by_rules])
    assert out["nested"].error.code == "invalid_grammar" and "can match nothing" in out["nested"].error.message
    assert out["by-rules"].error.code == "invalid_grammar" and "can match nothing" in out["by-rules"].error.message
    monkeypatch.setattr(sampling, "GRAMMAR_FILTER_BUDGET_S", 1e-6)
    out = run_local(engine, [chat("probed", "hi", grammar='root ::= "yes" | "no"', max_tokens=4),
                             chat("beside", "Is the sky blue?", max_tokens=4)])
    assert out["probed"].error.code == "invalid_grammar" and "too costly" in out["probed"].error.message
    assert out["beside"].done is not None and out["beside"].text


def test_a_thinking_past_its_budget_is_closed_and_the_model_answers_after_reading_the_close(engine, other_node):
    """Budget forcing with the real model: a thinking that reaches thinking_budget without a </think> gets
    "\\n</think>\\n\\n" as its next tokens, read into the lane before the model goes on, so a node reading the same
    tokens from scratch continues token for token. (SmolLM2 has no thinking mode: its answer is resumed after a
    "<think>", whose tokens count toward the budget as a resumed thinking's do.)"""
    from nodes.link.thinking import THINK_END

    question = "Think about the sea, then name one colour."
    opened = engine.model.tokenize("<think>", False, False)
    closing = engine.model.tokenize(THINK_END, False, True)
    budget, answer = len(opened) + 5, 8
    forced = one(engine, chat("budget", question, max_tokens=5 + len(closing) + answer, ignore_eos=True,
                              resume_text="<think>", thinking_budget=budget))
    cut = 5 + len(closing)
    assert "</think>" not in "".join(forced.texts[:5]), forced.text  # it did not close by itself: it was closed
    assert forced.ids[5:cut] == closing and "".join(forced.texts[5:cut]) == THINK_END
    assert forced.done.usage["completion_tokens"] == len(forced.ids) == cut + answer
    again = one(other_node, chat("again", question, max_tokens=answer, ignore_eos=True,
                                 resume_ids=opened + forced.ids[:cut]))
    assert again.ids == forced.ids[cut:]
    free = one(engine, chat("free", question, max_tokens=5 + len(closing), ignore_eos=True, resume_text="<think>"))
    assert THINK_END not in free.text
