"""Transcription end to end: a real head, a real node started with `--transcribe whisper-tiny.en` (faster-whisper
in its engine worker), the official `openai` client, and a WAV the test speaks itself (tests/speech.py)."""

from __future__ import annotations

import contextlib
import re

import httpx
import numpy as np
import pytest
from openai import BadRequestError, OpenAI

from tests.live import blob_bytes_served, make_head, start_node, wait_for
from tests.speech import SENTENCE, heard, speak, write_wav

MODEL = "whisper-tiny.en"
AUDIO_LIMIT = 400_000


@pytest.fixture(scope="module")
def speech_head(tmp_path_factory):
    head = make_head(tmp_path_factory.mktemp("speech"), extra_env={"FLEET_MAX_AUDIO_BYTES": str(AUDIO_LIMIT)})
    head.start()
    node = start_node(head, "--transcribe", MODEL, "--max-batch", "2", "--max-context", "512", identity="ears")
    alone = start_node(head, "--transcribe", MODEL, identity="ears-only", model="",  # no text model
                       extra_env={"FLEET_HOME": str(tmp_path_factory.mktemp("ears-only"))})  # a node key of its own
    head.wait_nodes(2, timeout=180)
    yield head
    alone.stop()
    node.stop()
    head.stop()


@pytest.fixture(scope="module")
def wav(tmp_path_factory):
    return speak(SENTENCE, tmp_path_factory.mktemp("audio") / "speech.wav")


def client_of(head) -> OpenAI:
    return OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0)


@contextlib.contextmanager
def only_on(head, identity: str):
    """Every other node cordoned (no new generation goes there) while the block runs; the node rows by identity."""
    api = httpx.Client(base_url=head.url, headers={"Authorization": f"Bearer {head.api_key}"})
    nodes = {n["identity"]: n for n in api.get("/api/nodes/").json()["results"]}
    others = [n["id"] for name, n in nodes.items() if name != identity]
    for node_id in others:
        api.post(f"/api/nodes/{node_id}/cordon/").raise_for_status()
    try:
        yield nodes
    finally:
        for node_id in others:
            api.post(f"/api/nodes/{node_id}/uncordon/").raise_for_status()


def test_the_models_list_names_the_speech_model_beside_the_text_model(speech_head):
    client = client_of(speech_head)
    wait_for(lambda: {MODEL, "smollm2"} <= {m.id for m in client.models.list()}, 30,
             f"/v1/models lacks {MODEL} or smollm2: {speech_head.log()}")


def test_a_wav_comes_back_as_its_words_and_its_second_use_moves_no_bytes(speech_head, wav):
    client = client_of(speech_head)
    with only_on(speech_head, "ears"):
        with open(wav, "rb") as audio:
            first = client.audio.transcriptions.create(model=MODEL, file=audio)
        assert heard(first.text), first.text
        served = wait_for(lambda: blob_bytes_served(speech_head), 10, "the node fetched no blob bytes")
        assert served == wav.stat().st_size  # the audio went to the node once, by its hash
        with open(wav, "rb") as audio:
            again = client.audio.transcriptions.create(model=MODEL, file=audio, response_format="verbose_json",
                                                       timestamp_granularities=["word", "segment"])
        assert blob_bytes_served(speech_head) == served  # the node had it: nothing moved
    assert heard(again.text)
    assert again.segments and again.segments[-1].end > again.segments[0].start
    assert again.duration == pytest.approx(wav.stat().st_size / 32_000, abs=0.1)
    assert heard(" ".join(w.word for w in again.words))


def test_a_streamed_transcription_sends_deltas_before_done(speech_head, wav):
    with open(wav, "rb") as audio:
        stream = client_of(speech_head).audio.transcriptions.create(model=MODEL, file=audio, stream=True)
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[-1] == "transcript.text.done" and "transcript.text.delta" in kinds[:-1], kinds
    assert "".join(e.delta for e in events[:-1]).strip() == events[-1].text
    assert heard(events[-1].text)


def test_subtitles_have_cues_with_times(speech_head, wav):
    client = client_of(speech_head)
    with open(wav, "rb") as audio:
        srt = client.audio.transcriptions.create(model=MODEL, file=audio, response_format="srt")
    assert re.match(r"1\n00:00:00,000 --> 00:00:0\d,\d{3}\n", srt), srt
    with open(wav, "rb") as audio:
        vtt = client.audio.transcriptions.create(model=MODEL, file=audio, response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")


def test_a_file_that_is_no_audio_is_a_400_naming_the_formats_read(speech_head, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not audio at all, just words")
    with open(text, "rb") as upload, pytest.raises(BadRequestError) as caught:
        client_of(speech_head).audio.transcriptions.create(model=MODEL, file=upload)
    error = caught.value.body
    assert error["code"] == "unsupported_audio_format" and error["param"] == "file"
    assert "wav" in error["message"] and "flac" in error["message"]


def test_a_file_over_the_limit_is_a_413(speech_head, tmp_path):
    big = write_wav(tmp_path / "long.wav", np.zeros(AUDIO_LIMIT, dtype=np.int16))  # 2 bytes a sample
    with open(big, "rb") as upload, pytest.raises(Exception) as caught:
        client_of(speech_head).audio.transcriptions.create(model=MODEL, file=upload)
    assert caught.value.status_code == 413 and caught.value.body["code"] == "file_too_large"


def test_a_node_that_serves_the_speech_model_alone_transcribes_too(speech_head, wav):
    with only_on(speech_head, "ears-only") as nodes, open(wav, "rb") as audio:
        raw = client_of(speech_head).audio.transcriptions.with_raw_response.create(model=MODEL, file=audio)
    assert nodes["ears-only"]["models_served"] == [MODEL] and nodes["ears-only"]["capabilities"]["transcribe"]
    assert raw.headers["x-fleet-node"] == "ears-only"
    assert heard(raw.parse().text)
