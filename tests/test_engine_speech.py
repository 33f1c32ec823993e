"""A speech model in the engine worker process (nodes.agent.engine.speech), alone (`node_join --transcribe` without
`--model`): the real faster-whisper model transcribes a WAV the test speaks, as a generation's events."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodes.agent.engine import EngineConfig, EngineWorker
from nodes.agent.main import NodeOptions, engine_configs
from nodes.agent.models import resolve_speech_model
from nodes.link.messages import Done
from nodes.link.spec import GenerateSpec
from tests.speech import SENTENCE, heard, speak
from tests.test_engine_worker import Recorder

ROOT = Path(__file__).resolve().parent.parent

MODEL = "whisper-tiny.en"


def test_a_node_without_a_text_model_gets_one_worker_with_only_the_speech_model(tmp_path):
    configs, name, _ = engine_configs(NodeOptions(head=None, model="", transcribe=MODEL, home=tmp_path))
    assert name == MODEL and len(configs) == 1
    assert configs[0].model_path is None and Path(configs[0].speech_model_path, "model.bin").is_file()


@pytest.fixture
async def worker():
    path, name = resolve_speech_model(MODEL)
    recorder = Recorder()
    worker = EngineWorker(EngineConfig(model_name=name, lanes=2, speech_model_path=str(path),
                                       speech_model_name=name), on_event=recorder)
    info = await worker.start()
    yield worker, recorder, info
    await worker.stop()


async def test_the_worker_transcribes_by_segments_and_refuses_a_chat(worker, tmp_path):
    worker, recorder, info = worker
    assert info["capabilities"] == {"transcribe": True, "speech_models": [MODEL]} and info["speech_model"] == MODEL
    wav = speak(SENTENCE, tmp_path / "speech.wav")
    await worker.submit(GenerateSpec(gen_id="t1", model=MODEL, prompt="", audio={"local_path": str(wav)}))
    done = await recorder.wait_for("t1", ("done", "error"))
    assert isinstance(done, Done) and done.timings["audio_s"] > 1, done
    tokens = recorder.of("t1", "tokens")
    assert tokens and all(t.segments[0]["end"] > t.segments[0]["start"] for t in tokens)
    assert heard("".join(t.text[0] for t in tokens))
    await worker.submit(GenerateSpec(gen_id="t2", model=MODEL, messages=[{"role": "user", "content": "Hi"}]))
    refused = await recorder.wait_for("t2", ("done", "error"))
    assert refused.code == "invalid_request" and "/v1/audio/transcriptions" in refused.message


STOP_AFTER_A_TRANSCRIPTION = """
import asyncio, sys
from pathlib import Path
from nodes.agent.engine import EngineWorker
from nodes.agent.main import NodeOptions, engine_configs
from nodes.link.messages import Done, Error
from nodes.link.spec import GenerateSpec
from tests.speech import SENTENCE, speak

async def main(home):
    wav = speak(SENTENCE, home / "speech.wav")
    configs, _, _ = engine_configs(NodeOptions(head=None, model="smollm2", transcribe="whisper-tiny.en", home=home,
                                               max_context=512))
    done = asyncio.Event()
    worker = EngineWorker(configs[0], on_event=lambda e: isinstance(e, Done | Error) and done.set())
    await worker.start()
    await worker.submit(GenerateSpec(gen_id="t1", model="whisper-tiny.en", prompt="", audio={"local_path": str(wav)}))
    await asyncio.wait_for(done.wait(), 120)
    await worker.stop()
    print("stopped", worker._proc.exitcode)

asyncio.run(main(Path(sys.argv[1])))
"""


@pytest.mark.timeout(240)
def test_a_worker_stopped_after_a_transcription_exits_without_a_backtrace(tmp_path):
    """ggml's crash handler printed a gdb backtrace of the worker (about 90 lines, before `Fleet stopped.`) when the
    speech model was left to the process's exit: the worker frees it first."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", STOP_AFTER_A_TRANSCRIPTION, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=200)
    assert out.stdout.strip() == "stopped 0", out.stderr
    assert out.stderr == ""
