"""LoRA adapters on the llama.cpp engine, with an adapter built for the bundled model at test time."""

from __future__ import annotations

import pytest

from nodes.agent.engine import EngineConfig
from nodes.agent.engine.local import bundled_model_path, run_local
from nodes.link.spec import GenerateSpec
from tests.lora_adapter import build_adapter

pytestmark = pytest.mark.slow

STYLE = [["style", 1.0]]


@pytest.fixture(scope="module")
def adapter_path(tmp_path_factory):
    return build_adapter(tmp_path_factory.mktemp("lora") / "style.gguf")


def engine_with(adapters: dict[str, str]):
    from nodes.agent.engine.llama import LlamaEngine

    # batch-invariant: the only settings where a generation's tokens never depend on what shares its batch
    return LlamaEngine(EngineConfig(model_path=bundled_model_path(), model_name="smollm2", lanes=4, max_context=512,
                                    batch_invariant=True, adapters=adapters))


@pytest.fixture(scope="module")
def base():
    engine = engine_with({})
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def lora(adapter_path):
    engine = engine_with({"style": str(adapter_path)})
    yield engine
    engine.close()


def chat(gen_id: str, question: str, lora=()) -> GenerateSpec:
    return GenerateSpec(gen_id=gen_id, messages=[{"role": "user", "content": question}], max_tokens=16,
                        temperature=0, ignore_eos=True, lora=[list(pair) for pair in lora])


def ids(engine, *specs: GenerateSpec) -> dict[str, list[int]]:
    outcomes = run_local(engine, list(specs))
    assert all(o.error is None for o in outcomes.values()), [o.error for o in outcomes.values()]
    return {gen_id: o.ids for gen_id, o in outcomes.items()}


def test_an_adapter_changes_greedy_output_and_only_for_the_requests_that_name_it(base, lora):
    question = "Name three colours."
    plain = ids(base, chat("plain", question))["plain"]
    assert ids(lora, chat("held", question))["held"] == plain

    named = run_local(lora, [chat("named", question, STYLE)])["named"]
    assert named.ids != plain
    assert named.accepted.cached_tokens == 0  # a lane computed without the adapter holds nothing it can reuse
    other = "Who wrote Hamlet?"
    assert ids(lora, chat("unnamed", other))["unnamed"] == ids(base, chat("ref", other))["ref"]
    assert lora.info()["capabilities"]["lora"] is True and lora.info()["capabilities"]["lora:style"] is True


def test_batched_with_and_without_the_adapter_equals_each_run_alone(lora):
    questions = ["What is 2+2?", "Name three birds.", "Write a haiku about rain.", "Who painted the Mona Lisa?"]
    asks = list(enumerate(zip(questions, [STYLE, STYLE, (), ()], strict=True)))
    alone = {f"a{i}": ids(lora, chat(f"a{i}", q, s))[f"a{i}"] for i, (q, s) in asks}
    steps = []
    together = run_local(lora, [chat(f"t{i}", q, s) for i, (q, s) in asks],
                         on_step=lambda step, events: steps.append({la.run.adapters for la in lora.lanes if la.run}))

    for i in range(len(questions)):
        assert together[f"t{i}"].ids == alone[f"a{i}"]
    assert len({o.accepted.lane for o in together.values()}) == 4
    assert any(len(sets_running) == 2 for sets_running in steps)  # both sets ran at once, in separate steps


def test_a_step_never_mixes_adapter_sets(lora):
    seen = []
    original = lora._decode

    def spy(works):
        seen.append({w.lane.run.adapters for w in works})
        return original(works)

    lora._decode = spy
    run_local(lora, [chat("x", "Count to five.", STYLE), chat("y", "Count to six.")])

    assert seen and all(len(adapter_sets) == 1 for adapter_sets in seen)
    assert {key for adapter_sets in seen for key in adapter_sets} == {(("style", 1.0),), ()}


def test_an_adapter_in_use_is_not_unloaded_and_a_bad_file_is_refused(lora, tmp_path):
    from nodes.agent.engine.base import EngineError, EngineLoadError

    lora.submit(chat("busy", "Tell a long story.", STYLE))
    with pytest.raises(EngineError, match="in use by 1 generation"):
        lora.unload_adapter("style")
    lora.cancel("busy")
    assert not lora.busy()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(EngineLoadError, match="could not load"):
        lora.load_adapter("bad", str(bad))


def test_unloading_restores_the_base_output_and_refuses_the_name(base, lora):  # last: it unloads the adapter
    ids(lora, chat("used", "Say something.", STYLE))
    lora.unload_adapter("style")

    sea = "Describe the sea."
    assert ids(lora, chat("after", sea))["after"] == ids(base, chat("ref2", sea))["ref2"]
    refused = run_local(lora, [chat("gone", "Hi", STYLE)])["gone"]
    assert refused.error.code == "invalid_request" and "no LoRA adapter 'style'" in refused.error.message
    assert "lora:style" not in lora.info()["capabilities"]


def test_placement_keys_a_prompt_apart_for_each_adapter_set():
    from nodes.agent.vocab import BUILTINS, BYTES
    from nodes.link.lifecycle import placement_keys

    def keys(lora):
        spec = GenerateSpec(gen_id="k", model="smollm2", prompt="p" * 600, lora=lora)
        return [k.key for k in placement_keys(spec, BUILTINS[BYTES])]

    assert keys([]) != keys([["style", 1.0]]) != keys([["style", 0.5]])
    assert keys([["style", 1.0]]) == keys([["style", 1.0]])
