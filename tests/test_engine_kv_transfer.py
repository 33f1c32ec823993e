"""A lane's prompt prefix exported by one engine and imported by another (issue 53, item 1): on the real SmolLM2, on
the mock, through the worker process, and the payload's own format."""

from __future__ import annotations

import asyncio

import pytest

from nodes.agent.engine import EngineConfig, create_engine
from nodes.agent.engine.kv_payload import KvHeader, PayloadError, decode, encode
from nodes.agent.engine.local import bundled_model_path, run_local
from nodes.agent.gguf_info import file_fingerprint
from nodes.link.codes import KvRefusal
from nodes.link.messages import Done
from nodes.link.prefix import block_keys
from nodes.link.spec import GenerateSpec

WINDOW = 512
BASE = "The fleet keeps a cache of every prompt it reads, block by block, on every node it runs. " * 9
ASKED = BASE + "Second question: what does a node do when its lanes are busy?"  # the prompt the importer serves
SEEN = BASE + "First question: what is a lane?"  # what the exporter read: 2 whole blocks in common with ASKED


def llama(**overrides):
    from nodes.agent.engine.llama import LlamaEngine

    return LlamaEngine(EngineConfig(model_path=bundled_model_path(), model_name="smollm2", lanes=2,
                                    max_context=WINDOW, **overrides))


def greedy(gen_id: str, prompt: str, max_tokens: int = 16) -> GenerateSpec:
    return GenerateSpec(gen_id=gen_id, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)


def forget(engine) -> None:
    """Every lane's cache cleared, as a fresh engine's."""
    for lane in engine.lanes:
        engine._trim_lane(lane, 0)
        lane.tokens, lane.holders = [], []


def held(engine, tokens: list[int]) -> int:
    """The most tokens of `tokens` any lane holds."""
    from nodes.agent.engine.scheduler import common_prefix

    return max(common_prefix(lane.tokens, tokens) for lane in engine.lanes)


def tampered(payload: bytes, **changes) -> bytes:
    """The payload with its header changed and its checksum made good again: a well-formed payload that lies."""
    header, data = decode(payload)
    for name, value in changes.items():
        setattr(header, name, value(getattr(header, name)) if callable(value) else value)
    return encode(header, bytes(data))


@pytest.fixture(scope="module")
def exporter():
    engine = llama()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def importer():
    engine = llama()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def exported(exporter):
    """What the exporter answers for ASKED once it has read SEEN: the 2 whole blocks the two prompts share."""
    out = run_local(exporter, [greedy("seen", SEEN, max_tokens=4)])["seen"]
    assert out.accepted.cached_tokens == 0
    asked = exporter.state_op("tokenize", {"text": ASKED})["tokens"]
    answer = exporter.export_prefix(tokens=asked)
    assert answer["ok"] is True, answer
    return {**answer, "asked": asked}


# -- the real model -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_imported_prefix_reads_on_another_engine_exactly_as_on_the_exporter(exporter, importer, exported):
    asked = exported["asked"]
    assert 128 < held(exporter, asked) < 192 and exported["tokens"] == 128  # whole blocks only
    header, _ = decode(exported["payload"])
    assert header.tokens == asked[:128] and header.blocks == block_keys(asked[:128], header.space)
    assert header.model == file_fingerprint(bundled_model_path()) == header.space
    assert header.kv == {"type_k": "f16", "type_v": "f16"} and header.engine == "llama.cpp"
    forget(importer)

    answer = importer.import_prefix(exported["payload"], holder="moved-for")
    assert answer["ok"] is True and answer["tokens"] == 128, answer
    assert importer.lanes[answer["lane"]].holders == [("moved-for", 128)]
    # The reference: the exporter's own cache of the same 128 tokens, so both read exactly the same chunk after it
    lane = exporter.lanes[exported["lane"]]
    exporter._trim_lane(lane, 128)
    del lane.tokens[128:]
    there = run_local(exporter, [greedy("there", ASKED)])["there"]
    here = run_local(importer, [greedy("here", ASKED)])["here"]

    assert here.accepted.cached_tokens == there.accepted.cached_tokens == 128  # it read only the tokens after
    assert here.done.usage["prompt_tokens"] == len(asked)
    assert here.ids == there.ids and len(here.ids) == 16
    assert here.text.strip()


@pytest.mark.slow
@pytest.mark.parametrize(("change", "reason"), [
    ({"tokens": lambda ids: [ids[0] + 1, *ids[1:]]}, KvRefusal.TOKENS_MISMATCH),
    ({"blocks": lambda keys: keys[::-1]}, KvRefusal.TOKENS_MISMATCH),
    ({"model": "0" * 64}, KvRefusal.MODEL_MISMATCH),
    ({"kv": {"type_k": "q8_0", "type_v": "q8_0"}}, KvRefusal.KV_TYPE_MISMATCH),
], ids=["tokens", "blocks", "fingerprint", "kv-type"])
def test_a_payload_that_disagrees_with_the_importer_is_refused_and_no_lane_holds_it(importer, exported, change,
                                                                                      reason):
    forget(importer)
    answer = importer.import_prefix(tampered(exported["payload"], **change))

    assert answer == {"ok": False, "reason": reason.value, "message": answer["message"]} and answer["message"]
    assert held(importer, exported["asked"]) == 0  # so its next generation reads the whole prompt


@pytest.mark.slow
def test_a_corrupted_byte_or_a_cut_payload_is_refused(importer, exported):
    payload = bytearray(exported["payload"])
    payload[len(payload) // 2] ^= 0x40  # a byte of the cells
    forget(importer)

    assert importer.import_prefix(bytes(payload))["reason"] == KvRefusal.CORRUPT
    assert importer.import_prefix(exported["payload"][:-1])["reason"] == KvRefusal.CORRUPT
    assert held(importer, exported["asked"]) == 0


@pytest.mark.slow
def test_cells_that_are_not_the_headers_tokens_are_refused(exporter, importer, exported):
    """A well-formed payload whose cells hold 3 blocks while its header names 2."""
    lane = max(exporter.lanes, key=lambda la: len(la.tokens))
    longer = exporter.export_prefix(tokens=lane.tokens)
    assert longer["tokens"] >= 192
    header, _ = decode(exported["payload"])
    forget(importer)

    answer = importer.import_prefix(encode(header, bytes(decode(longer["payload"])[1])))
    assert answer["reason"] == KvRefusal.CORRUPT and "positions" in answer["message"]
    assert held(importer, exported["asked"]) == 0


@pytest.mark.slow
def test_cells_of_another_kv_layout_are_rejected_by_llama_cpp_and_the_lane_left_empty(exported):
    """The exporter runs flash attention (auto, on for this CPU); a batch-invariant node runs without, and keeps V
    transposed: the same model and types, cells llama.cpp cannot read."""
    other = llama(batch_invariant=True)
    try:
        answer = other.import_prefix(exported["payload"])
        assert answer["reason"] == KvRefusal.REJECTED, answer
        assert held(other, exported["asked"]) == 0
        out = run_local(other, [greedy("cold", ASKED, max_tokens=2)])["cold"]
        assert out.accepted.cached_tokens == 0 and out.done is not None
    finally:
        other.close()


@pytest.mark.slow
def test_a_prefix_the_engine_does_not_hold_or_no_longer_holds_is_said_so(exporter, exported):
    never = exporter.state_op("tokenize", {"text": "Nothing like this was ever read here. " * 12})["tokens"]
    assert exporter.export_prefix(tokens=never)["reason"] == KvRefusal.NOT_HELD
    assert exporter.export_prefix(blocks=["0" * 24])["reason"] == KvRefusal.NOT_HELD

    header, _ = decode(exported["payload"])
    assert exporter.export_prefix(blocks=header.blocks, space=header.space)["tokens"] == 128  # by block keys too
    forget(exporter)
    answer = exporter.export_prefix(tokens=exported["asked"])
    assert answer == {"ok": False, "reason": "not_held", "message": answer["message"]}


# -- the mock, and through the worker process -----------------------------------------------------------------------

WORDS = " ".join(f"word{i}" for i in range(150))


def mock(**params):
    return create_engine(EngineConfig(model_name="mock-model", lanes=2, mock={"decode_tps": 2000, **params}))


def test_the_mock_exports_and_imports_whole_blocks_and_the_importer_reads_only_the_rest():
    source, target = mock(kv_bytes_per_token=100), mock(kv_bytes_per_token=100)
    run_local(source, [GenerateSpec(gen_id="a", prompt=WORDS, max_tokens=4)])
    tokens = source.tokenize(WORDS)

    answer = source.export_prefix(tokens=tokens)
    assert answer["ok"] and answer["tokens"] == 128
    assert len(decode(answer["payload"])[1]) == 128 * 100
    assert target.import_prefix(answer["payload"])["ok"] is True
    out = run_local(target, [GenerateSpec(gen_id="b", prompt=WORDS, max_tokens=4)])["b"]
    assert out.accepted.cached_tokens == 128

    assert target.import_prefix(answer["payload"]).get("already_held") is True
    other = mock(kv_bytes_per_token=100)
    assert other.import_prefix(tampered(answer["payload"], model="mock:other"))["reason"] == KvRefusal.MODEL_MISMATCH
    header, data = decode(answer["payload"])
    cells = bytearray(data)
    cells[0] ^= 1
    assert other.import_prefix(encode(header, bytes(cells)))["reason"] == KvRefusal.CORRUPT  # the mock's own check
    assert source.export_prefix(tokens=source.tokenize("nothing held"))["reason"] == KvRefusal.NOT_HELD


def test_an_import_waits_for_a_free_lane_and_evicts_the_least_recently_used_one():
    source, target = mock(), mock()
    run_local(source, [GenerateSpec(gen_id="a", prompt=WORDS, max_tokens=2)])
    payload = source.export_prefix(tokens=source.tokenize(WORDS))["payload"]
    for gen_id, word in (("old", "alpha"), ("new", "beta")):
        run_local(target, [GenerateSpec(gen_id=gen_id, prompt=f"{word} " * 10, max_tokens=2)])
    busy = [GenerateSpec(gen_id=f"busy{i}", prompt=f"busy {i}", max_tokens=50) for i in range(2)]
    for spec in busy:
        target.submit(spec)

    assert target.import_prefix(payload)["reason"] == KvRefusal.NO_FREE_LANE
    for spec in busy:
        target.cancel(spec.gen_id)
    target.lanes[0].holders, target.lanes[1].holders = [("old", 10)], [("new", 10)]
    target.lanes[0].last_used, target.lanes[1].last_used = 1.0, 2.0
    assert target.import_prefix(payload)["lane"] == 0
    out = run_local(target, [GenerateSpec(gen_id="c", prompt=WORDS, max_tokens=2)])["c"]
    assert "old" in out.accepted.evicted and "new" not in out.accepted.evicted  # told to the head as any eviction


async def test_the_worker_process_exports_and_imports_for_the_agent():
    from nodes.agent.engine import EngineWorker, StateOpError

    config = EngineConfig(model_name="mock-model", lanes=2, mock={"decode_tps": 2000})
    done = asyncio.Event()
    source = EngineWorker(config, lambda event: done.set() if isinstance(event, Done) else None)
    target = EngineWorker(config, lambda event: None)
    await source.start()
    await target.start()
    try:
        tokens = (await source.state_op("tokenize", {"text": WORDS}))["tokens"]
        assert (await source.state_op("kv_export", {"tokens": tokens}))["reason"] == KvRefusal.NOT_HELD
        await source.submit(GenerateSpec(gen_id="a", prompt=WORDS, max_tokens=2))
        await asyncio.wait_for(done.wait(), 30)
        answer = await source.state_op("kv_export", {"tokens": tokens})
        assert answer["tokens"] == 128 and isinstance(answer["payload"], bytes)
        assert await target.state_op("kv_import", {"payload": answer["payload"], "holder": "g"}) == {
            "ok": True, "lane": 0, "tokens": 128, "ms": pytest.approx(0, abs=50)}
        with pytest.raises(StateOpError) as refused:
            await target.state_op("kv_import", {"payload": "not bytes"})
        assert refused.value.code == "invalid_request"
    finally:
        await source.stop()
        await target.stop()


# -- the payload's format -------------------------------------------------------------------------------------------


def header(**changes) -> KvHeader:
    tokens = list(range(64))
    return KvHeader(**{"model": "m", "engine": "e", "kv": {"type_k": "f16", "type_v": "f16"}, "space": "s",
                       "tokens": tokens, "blocks": block_keys(tokens, "s"), **changes})


def test_a_payload_reads_back_as_written_and_anything_else_is_named():
    payload = encode(header(), b"cells")
    read, data = decode(payload)
    assert read == header() and bytes(data) == b"cells"

    def reason(raw: bytes) -> KvRefusal:
        with pytest.raises(PayloadError) as caught:
            decode(raw)
        return caught.value.reason

    assert reason(b"XXXX" + payload[4:]) == KvRefusal.CORRUPT
    assert reason(payload[:4] + b"\x02\x00" + payload[6:]) == KvRefusal.UNSUPPORTED  # another version
    assert reason(payload + b"\x00") == KvRefusal.CORRUPT
    assert reason(payload[:10]) == KvRefusal.CORRUPT
    flipped = bytearray(payload)
    flipped[20] ^= 1  # a header byte
    assert reason(bytes(flipped)) == KvRefusal.CORRUPT
