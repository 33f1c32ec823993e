"""The engine worker process: events over the pipe, state operations, and surviving a crashed child."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from nodes.agent.engine import EngineConfig, EngineLoadError, EngineWorker, StateOpError
from nodes.agent.engine.local import bundled_model_path
from nodes.link.messages import Accepted, Done, Error, TokenBatch
from nodes.link.spec import GenerateSpec

KINDS = {"accepted": Accepted, "tokens": TokenBatch, "done": Done, "error": Error}


class Recorder:
    """Collects worker events and lets a test wait for a generation's end."""

    def __init__(self) -> None:
        self.events: list = []
        self._changed = asyncio.Event()

    def __call__(self, event) -> None:
        self.events.append(event)
        self._changed.set()

    def of(self, gen_id: str, kind: str | None = None) -> list:
        """The events of `gen_id` (of one kind: accepted, tokens, done, error), in order."""
        return [e for e in self.events if e.gen_id == gen_id and (kind is None or isinstance(e, KINDS[kind]))]

    async def wait_for(self, gen_id: str, kinds: tuple[str, ...], timeout: float = 60):
        async def waiter():
            while True:
                found = [e for e in self.of(gen_id) if isinstance(e, tuple(KINDS[k] for k in kinds))]
                if found:
                    return found[0]
                self._changed.clear()
                await self._changed.wait()

        return await asyncio.wait_for(waiter(), timeout)


async def wait_until(predicate, timeout: float = 60) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout)


def mock_config(**params) -> EngineConfig:
    return EngineConfig(model_name="mock", lanes=2, mock={"decode_tps": 500, **params})


async def test_mock_worker_streams_events_and_answers_state_ops():
    events = Recorder()
    progress: list[float] = []
    worker = EngineWorker(mock_config(load_s=0.1), events, restart_cooldown=0.5)
    info = await worker.start(on_progress=progress.append)
    try:
        assert info["engine"] == "mock" and info["lanes"] == 2
        assert worker.alive and worker.pid and worker.pid != os.getpid()
        assert progress and progress[-1] == 1.0

        await worker.submit(GenerateSpec(gen_id="a", prompt="hello there", max_tokens=10))
        done = await events.wait_for("a", ("done", "error"))

        assert isinstance(done, Done) and done.finish_reason == "length"
        kinds = [type(e) for e in events.of("a")]
        assert kinds[0] is Accepted and kinds[-1] is Done
        assert sum(len(e.ids) for e in events.of("a", "tokens")) == 10
        assert [e.seq for e in events.of("a") if isinstance(e, TokenBatch | Done)] == list(range(1, done.seq + 1))

        assert len((await worker.state_op("tokenize", {"text": "one two"}))["tokens"]) == 2
        assert len((await worker.state_op("embed", {"texts": ["x", "y"]}))["embeddings"]) == 2
        with pytest.raises(StateOpError) as failure:
            await worker.state_op("no-such-op", {})
        assert failure.value.code == "unknown_op"
        await wait_until(lambda: "lanes_busy" in worker.stats())
        assert worker.stats()["lanes"] == 2
    finally:
        await worker.stop()
    assert not worker.alive


async def test_mock_worker_cancel_reaches_the_child():
    events = Recorder()
    worker = EngineWorker(mock_config(decode_tps=100), events)
    await worker.start()
    try:
        await worker.submit(GenerateSpec(gen_id="long", prompt="x", max_tokens=1000))
        await events.wait_for("long", ("tokens",))
        await worker.cancel("long")
        done = await events.wait_for("long", ("done",))
        assert done.finish_reason == "cancelled"
    finally:
        await worker.stop()


async def test_load_failure_raises_with_a_clear_message():
    worker = EngineWorker(EngineConfig(model_path="/nonexistent/model.gguf"), Recorder())
    with pytest.raises(EngineLoadError, match="could not load"):
        await worker.start()
    assert not worker.alive

    bad_mock = EngineWorker(EngineConfig(mock={"no_such_knob": 1}), Recorder())
    with pytest.raises(EngineLoadError, match="no_such_knob"):
        await bad_mock.start()


async def test_killed_mock_worker_fails_its_generations_and_restarts():
    events = Recorder()
    restarts: list[dict] = []
    worker = EngineWorker(mock_config(decode_tps=50), events, on_restart=restarts.append, restart_cooldown=0.5)
    await worker.start()
    try:
        await worker.submit(GenerateSpec(gen_id="victim", prompt="x", max_tokens=1000))
        await events.wait_for("victim", ("tokens",))
        first_pid = worker.pid
        os.kill(first_pid, signal.SIGKILL)

        error = await events.wait_for("victim", ("error", "done"))
        assert error == Error(gen_id="victim", code="engine_crashed",
                              message="the engine worker died (exit code -9); the generation was stopped",
                              retryable=True)
        await wait_until(lambda: worker.alive)
        assert worker.pid != first_pid
        assert restarts and restarts[0]["cache_cleared"] is True
        assert worker.info().get("cache_cleared") is True
        assert "cache_cleared" not in worker.info()  # reported once

        await worker.submit(GenerateSpec(gen_id="after", prompt="y", max_tokens=5))
        assert isinstance(await events.wait_for("after", ("done", "error")), Done)
    finally:
        await worker.stop()


async def test_an_abort_inside_the_engine_is_a_crash_not_an_agent_death():
    events = Recorder()
    worker = EngineWorker(mock_config(abort_on="BOOM"), events, restart_cooldown=0.3)
    await worker.start()
    try:
        await worker.submit(GenerateSpec(gen_id="running", prompt="fine", max_tokens=10_000))
        await events.wait_for("running", ("tokens",))
        await worker.submit(GenerateSpec(gen_id="boom", prompt="BOOM", max_tokens=5))
        crashed = await events.wait_for("boom", ("error",))
        assert crashed.code == "engine_crashed" and "exit code -6" in crashed.message
        assert (await events.wait_for("running", ("error",))).code == "engine_crashed"

        while_down = Recorder()
        worker.on_event = while_down
        if not worker.alive:
            await worker.submit(GenerateSpec(gen_id="early", prompt="z"))
            assert (await while_down.wait_for("early", ("error",))).code == "engine_unavailable"
        await wait_until(lambda: worker.alive)
    finally:
        await worker.stop()


@pytest.mark.slow
async def test_real_model_worker_generates_and_survives_kill_9():
    events = Recorder()
    config = EngineConfig(model_path=bundled_model_path(), model_name="smollm2", lanes=2, max_context=512)
    worker = EngineWorker(config, events, restart_cooldown=1.0)
    info = await worker.start()
    try:
        assert info["engine"] == "llama.cpp" and info["context_window"] == 512

        question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        await worker.submit(GenerateSpec(gen_id="paris", messages=question, max_tokens=16, temperature=0))
        done = await events.wait_for("paris", ("done", "error"))
        assert isinstance(done, Done)
        assert "Paris" in "".join(t for e in events.of("paris", "tokens") for t in e.text)

        story = GenerateSpec(gen_id="story", prompt="Once upon a time", max_tokens=400, ignore_eos=True)
        await worker.submit(story)
        await events.wait_for("story", ("tokens",))
        os.kill(worker.pid, signal.SIGKILL)
        error = await events.wait_for("story", ("error", "done"))
        assert error.code == "engine_crashed" and error.retryable is True

        await wait_until(lambda: worker.alive, timeout=120)
        await worker.submit(GenerateSpec(gen_id="again", messages=question, max_tokens=16, temperature=0))
        again = await events.wait_for("again", ("done", "error"))
        assert isinstance(again, Done) and again.usage["cached_tokens"] == 0
        assert worker.stats().get("cache_cleared") is True
    finally:
        await worker.stop()


async def test_a_crashed_worker_is_restarted_after_the_2_s_cooldown(monkeypatch):
    """Not at once: a model that aborts llama.cpp at load would otherwise respawn in a tight loop."""
    import time

    worker = EngineWorker(mock_config(), Recorder())
    pauses: list[float] = []

    async def sleep(seconds):
        pauses.append(seconds)

    async def launch():
        return {"model_name": "mock"}

    monkeypatch.setattr("nodes.agent.engine.worker.asyncio.sleep", sleep)
    monkeypatch.setattr(worker, "_launch", launch)
    worker._started_at = time.monotonic()  # it had just started when it died
    await worker._restart()
    assert len(pauses) == 1 and 1.9 < pauses[0] <= 2.0 and worker.restarts == 1
    worker._started_at = time.monotonic() - 60  # it ran a minute: still not at once
    await worker._restart()
    assert pauses[1] == 2.0


def test_an_idle_engine_reports_no_tokens_a_second_whatever_its_last_report_said():
    worker = EngineWorker(mock_config(), on_event=lambda event: None)
    worker._on_message(0, ("stats", {"lanes_busy": 1, "lanes": 2, "queued": 0, "tokens_per_s": 7.8}))
    assert worker.stats()["tokens_per_s"] == 7.8
    worker._on_message(0, ("stats", {"lanes_busy": 0, "lanes": 2, "queued": 0, "tokens_per_s": 7.8}))  # as it went idle
    assert worker.stats()["tokens_per_s"] == 0.0


async def test_a_worker_reports_its_lanes_and_kv_from_the_moment_it_has_loaded():
    """Before its first generation too: a node idle since it started heartbeats its real lanes, not 0 / 0."""
    worker = EngineWorker(mock_config(context_window=1024), on_event=lambda event: None)
    await worker.start()
    try:
        await wait_until(lambda: "lanes" in worker.stats(), timeout=10)
        stats = worker.stats()
        assert (stats["lanes"], stats["lanes_busy"], stats["kv_total"]) == (2, 0, 2048)
    finally:
        await worker.stop()


def test_lanes_that_start_streaming_report_their_rate_once_tokens_flow_not_a_second_later():
    """The report as lanes start says 0 tokens/s (none made yet); the next report goes out as soon as they have a rate,
    so a heartbeat taken while they stream says it (a 5 s heartbeat after the start showed `–` while 5 lanes ran)."""
    from nodes.agent.engine import create_engine
    from nodes.agent.engine.child import _ChildLoop

    class Pipe:
        def __init__(self):
            self.sent = []

        def send(self, message):
            self.sent.append(message)

        def poll(self):
            return False

    pipe, engine = Pipe(), create_engine(EngineConfig(model_name="mock", lanes=8, mock={"decode_tps": 2000}))
    loop = _ChildLoop(pipe, engine)
    for i in range(5):
        loop.handle(("submit", GenerateSpec(gen_id=f"g{i}", prompt="hello there", max_tokens=50).to_dict()))
    loop.report_stats()
    for _ in range(3):
        engine.step()
        loop.report_stats()
    reports = [m[1] for m in pipe.sent if m[0] == "stats"]
    assert reports[0]["lanes_busy"] == 5 and reports[0]["tokens_per_s"] == 0.0
    assert reports[-1]["lanes_busy"] == 5 and reports[-1]["tokens_per_s"] > 0
