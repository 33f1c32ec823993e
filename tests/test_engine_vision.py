"""Images on the llama.cpp engine, through a random-weight projector built for the bundled model at test time
(tests/vision_projector.py): it proves the path (decoded, embedded, counted, reused), not what a model says."""

from __future__ import annotations

import hashlib

import pytest

from nodes.agent.engine import EngineConfig
from nodes.agent.engine.local import bundled_model_path, run_local
from nodes.link.spec import GenerateSpec
from tests.vision_projector import IMAGE_TOKENS, build_projector, png

pytestmark = pytest.mark.slow

QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def projector(tmp_path_factory):
    return build_projector(tmp_path_factory.mktemp("mmproj") / "mmproj.gguf")


def engine_with(mmproj: str | None, **config):
    from nodes.agent.engine.llama import LlamaEngine

    config = {"lanes": 3, **config}
    return LlamaEngine(EngineConfig(model_path=bundled_model_path(), model_name="smollm2", max_context=512,
                                    batch_invariant=True, mmproj_path=mmproj, **config))


@pytest.fixture(scope="module")
def seeing(projector):
    engine = engine_with(str(projector))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    made = {}
    for name, data in (("a", png(seed=1)), ("b", png(seed=2)), ("broken", png(seed=3)[:60])):
        path = folder / f"{name}.png"
        path.write_bytes(data)
        made[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "format": "png",
                      "local_path": str(path)}
    return made


def chat(gen_id: str, *images: dict, question: str = QUESTION, max_tokens: int = 8) -> GenerateSpec:
    content = [{"type": "text", "text": question}] + [{"type": "image", "image": image} for image in images]
    return GenerateSpec(gen_id=gen_id, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                        temperature=0, ignore_eos=True)


def one(engine, spec: GenerateSpec):
    outcome = run_local(engine, [spec])[spec.gen_id]
    assert outcome.error is None, outcome.error
    return outcome


def test_a_node_with_a_projector_reports_vision_and_one_without_does_not(seeing):
    assert seeing.info()["capabilities"]["vision"] is True
    plain = engine_with(None)
    try:
        assert plain.info()["capabilities"]["vision"] is False
    finally:
        plain.close()


def test_an_image_is_read_and_its_tokens_count_in_the_prompt(seeing, images):
    text_only = one(seeing, chat("text", question=QUESTION))
    with_image = one(seeing, chat("image", images["a"]))
    assert with_image.done.usage["prompt_tokens"] == text_only.done.usage["prompt_tokens"] + IMAGE_TOKENS
    assert len(with_image.ids) == 8 and with_image.done.finish_reason == "length"
    # the model read the picture: another image (the same text) changes what it says
    assert one(seeing, chat("other", images["b"], max_tokens=8)).ids != with_image.ids


def test_the_same_image_in_the_next_turn_is_not_embedded_again(seeing, images):
    first = one(seeing, chat("turn1", images["a"], question="Describe it."))
    again = one(seeing, chat("turn2", images["a"], question="Describe it."))
    assert again.accepted.cached_tokens == again.done.usage["prompt_tokens"] - 1  # image included
    assert again.ids == first.ids
    other = one(seeing, chat("turn3", images["b"], question="Describe it."))
    # another image at the same place: only the text before it is reused
    assert other.accepted.cached_tokens < other.done.usage["prompt_tokens"] - IMAGE_TOKENS


def test_image_and_text_generations_share_the_batch_and_each_equals_its_run_alone(seeing, images):
    alone = {"img": one(seeing, chat("img-alone", images["b"], question="Tell me.")).ids,
             "txt": one(seeing, chat("txt-alone", question="Name three birds.")).ids}
    together = run_local(seeing, [chat("img", images["b"], question="Tell me."),
                                  chat("txt", question="Name three birds.")])
    assert {gen_id: o.ids for gen_id, o in together.items()} == alone


def test_an_image_the_decoder_refuses_is_an_invalid_request_saying_so(seeing, images):
    outcome = run_local(seeing, [chat("broken", images["broken"])])["broken"]
    assert outcome.error.code == "invalid_request" and "could not be decoded" in outcome.error.message


def test_a_node_without_a_projector_refuses_an_image_naming_the_flag(images):
    plain = engine_with(None)
    try:
        outcome = run_local(plain, [chat("blind", images["a"])])["blind"]
    finally:
        plain.close()
    assert outcome.error.code == "invalid_request" and "--mmproj" in outcome.error.message


def test_a_projector_of_another_width_is_refused_at_load(tmp_path, monkeypatch):
    from nodes.agent.engine.base import EngineLoadError

    monkeypatch.setattr("tests.vision_projector._text_width", lambda: 64)
    wrong = build_projector(tmp_path / "wrong.gguf")
    with pytest.raises(EngineLoadError, match="could not load the multimodal projector"):
        engine_with(str(wrong))


def test_a_lane_that_holds_an_image_is_not_parked(projector, images, tmp_path):
    """A restarted node has no image behind a lane's placeholder tokens, so such a lane stays off the disk."""
    parked = engine_with(str(projector), lanes=1, park_dir=str(tmp_path))
    try:
        one(parked, chat("seen", images["a"]))
        parked.idle_work()
        assert not list(tmp_path.glob("lane-*"))
        one(parked, chat("said", question="Name three birds."))
        parked.idle_work()
        assert [p.name for p in sorted(tmp_path.glob("lane-*"))] == ["lane-0.json", "lane-0.kv"]
    finally:
        parked.close()
