"""What an engine measures of its own speed (nodes/agent/engine/pace.py), which its node's heartbeat carries and the
head's load cost comes from: from given step timings, then from the mock engine's own steps on a fake clock."""

from __future__ import annotations

import pytest

import nodes.agent.engine.mock as mock_module
import nodes.agent.engine.scheduler as scheduler_module
from nodes.agent.dialer import heartbeat_of
from nodes.agent.engine.base import EngineConfig
from nodes.agent.engine.mock import MockEngine
from nodes.agent.engine.pace import Pace
from nodes.link.spec import GenerateSpec


def test_the_slowdown_is_the_slope_of_step_time_over_decoding_lanes():
    pace = Pace()
    assert (pace.prefill_tps(), pace.decode_slowdown_ms()) == (0.0, 0.0)  # nothing measured yet
    for _ in range(5):
        pace.step(1, 0, 0.040)
    assert pace.decode_slowdown_ms() == 0.0  # one lane count says nothing about batching
    for lanes, seconds in ((2, 0.048), (4, 0.064), (3, 0.056)):
        pace.step(lanes, 0, seconds)
    assert pace.decode_slowdown_ms() == pytest.approx(8.0)


def test_steps_slowed_by_another_process_do_not_move_the_slowdown():
    pace = Pace()
    for i in range(40):
        for lanes, seconds in ((1, 0.040), (4, 0.064)):
            # every fifth step of one lane count waits for a core another process holds: 3x as long
            pace.step(lanes, 0, seconds * 3 if lanes == 1 and i % 5 == 4 else seconds)
    assert pace.decode_slowdown_ms() == pytest.approx(8.0)


def test_the_prefill_rate_is_prompt_tokens_over_the_time_beyond_the_decode_part_of_their_steps():
    pace = Pace()
    for lanes, seconds in ((1, 0.040), (2, 0.048)):
        pace.step(lanes, 0, seconds)
    pace.step(2, 500, 0.048 + 1.0)  # two lanes decoding while 500 prompt tokens were read: 1 s of reading
    pace.step(0, 250, 0.5)  # nothing else in the step
    pace.step(1, 4, 0.9)  # too few tokens to say anything about reading speed
    assert pace.prefill_tps() == pytest.approx(500.0)


class FakeClock:
    """The mock's sleeps advance this instead of passing, so the test measures exactly what the mock costs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def __call__(self) -> float:
        return self.now


def test_the_mock_engines_stats_and_its_heartbeat_carry_what_its_steps_cost(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(mock_module.time, "sleep", clock.sleep)
    monkeypatch.setattr(scheduler_module, "clock", clock)
    engine = MockEngine(EngineConfig(model_name="m", lanes=4, mock={
        "decode_tps": 25.0, "decode_slowdown_ms": 8.0, "prefill_ms_per_token": 2.0}))
    for batch in (["solo"], ["a", "b", "c", "d"], ["e", "f"]):
        for name in batch:
            prompt = " ".join(f"{name}{i}" for i in range(300))  # 300 distinct words: nothing cached
            engine.submit(GenerateSpec(gen_id=name, model="m", prompt=prompt, max_tokens=20, ignore_eos=True))
        while engine.busy():
            engine.step()

    stats = engine.stats()
    assert stats["decode_slowdown_ms"] == pytest.approx(8.0)
    # within 1%: one mixed step came while only the one-lane step time was known, so its decode part was guessed
    assert stats["prefill_tps"] == pytest.approx(500.0, rel=0.01)
    heartbeat = heartbeat_of(stats, engine_ready=True)
    assert (heartbeat.prefill_tps, heartbeat.decode_slowdown_ms) == (stats["prefill_tps"], 8.0)
