"""On-demand models on the node (Django-free): the Deployer under a memory budget (what the heartbeat says is free,
a load that waits for the unloads making its room, one refused past the budget), --no-on-demand, mock deploys, and
how long each served model has been idle."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nodes.agent.deploy import Deployer, footprint
from nodes.agent.dialer import heartbeat_of
from nodes.agent.engine.local import bundled_model_path
from nodes.agent.model_set import ModelSet
from nodes.link.messages import Deploy, Done, ModelState, decode, encode
from nodes.link.spec import GenerateSpec

MODEL = Path(bundled_model_path())  # SmolLM2: 98.4 MB of weights, 23,040 bytes of KV a token
HELD = footprint(MODEL, lanes=2, window=1024)  # what one loaded 2-lane, 1,024-token worker holds


class FakeWorker:
    alive = True

    def __init__(self, config) -> None:
        self.config, self.stopped = config, False

    def info(self):
        return {"model_name": self.config.model_name, "context_window": self.config.max_context or 1024,
                "lanes": self.config.lanes}

    def stats(self):
        return {"lanes": self.config.lanes, "lanes_busy": 0}

    async def start(self, on_progress=None):
        return self.info()

    async def submit(self, spec):
        pass

    async def stop(self):
        self.stopped = True


class Own(FakeWorker):
    def __init__(self) -> None:
        self.config, self.stopped = type("C", (), {"model_name": "own", "lanes": 2, "max_context": 1024})(), False


def deployer(monkeypatch, *, budget: int = 0, on_demand: bool = True, mock: dict | None = None):
    import nodes.agent.deploy as deploy

    monkeypatch.setattr(deploy, "DRAIN_GRACE_S", 0.05)
    sent, made = [], []

    async def fetch(name, progress):
        return MODEL

    def make_worker(config):
        made.append(FakeWorker(config))
        return made[-1]

    models = ModelSet(Own())
    return Deployer(models, fetch=fetch, send=sent.append, make_worker=make_worker, memory_budget=budget,
                    on_demand=on_demand, mock=mock), sent, made


def row(name: str) -> dict:
    return {"name": name, "lanes": 2, "context": 1024}


def test_under_a_budget_the_heartbeat_says_what_is_left_after_each_load(monkeypatch):
    async def run():
        node, _, made = deployer(monkeypatch, budget=HELD * 3, mock={"decode_tps": 50})
        before = await node.memory_free()
        node.apply(Deploy(models=[row("a")]))
        await node.tasks["a"]
        return before, await node.memory_free(), made
    before, after, made = asyncio.run(run())
    assert before == HELD * 3 and after == HELD * 2
    assert made[0].config.mock == {"decode_tps": 50}  # a mock node's deployed models run on the mock engine too


def test_a_load_past_the_budget_fails_with_the_figures(monkeypatch):
    async def run():
        node, sent, _ = deployer(monkeypatch, budget=int(HELD * 1.5))
        node.apply(Deploy(models=[row("a"), row("b")]))
        await asyncio.gather(node.tasks["a"], node.tasks["b"])
        return [m for m in sent if isinstance(m, ModelState) and m.state == "failed"]
    failed = asyncio.run(run())
    assert len(failed) == 1
    assert "not enough memory" in failed[0].detail and "the node's memory budget available" in failed[0].detail


def test_a_load_waits_for_the_unload_that_makes_its_room(monkeypatch):
    async def run():
        node, sent, made = deployer(monkeypatch, budget=int(HELD * 1.5))
        node.apply(Deploy(models=[row("a")]))
        await node.tasks["a"]
        await node.models.submit(GenerateSpec(gen_id="g1", model="a", prompt="hi"))
        node.apply(Deploy(models=[row("b")]))  # the head unloads a (least recently used) to make room for b
        await asyncio.sleep(0.2)
        assert "b" not in node.models.serving and not made[0].stopped  # a still runs g1: b waits
        node.models.on_event(Done(gen_id="g1", seq=1, finish_reason="stop", usage={}, timings={}))
        await node.tasks["b"]
        return [(m.model, m.state) for m in sent if isinstance(m, ModelState)], made
    states, made = asyncio.run(run())
    assert made[0].stopped and "failed" not in {state for _, state in states}
    assert states.index(("a", "unloaded")) < states.index(("b", "serving"))


def test_a_node_started_with_no_on_demand_says_it_has_no_room(monkeypatch):
    node, _, _ = deployer(monkeypatch, budget=HELD * 10, on_demand=False)
    assert asyncio.run(node.memory_free()) == 0 and not node.on_demand
    beat = decode(encode(heartbeat_of({"lanes": 2, "memory_free": 0, "on_demand": False}, engine_ready=True)))
    assert (beat.memory_free, beat.on_demand) == (0, False)


def test_each_deployed_model_says_how_long_it_has_run_nothing(monkeypatch):
    async def run():
        node, _, _ = deployer(monkeypatch)
        node.apply(Deploy(models=[row("a")]))
        await node.tasks["a"]
        node.models.last_used["a"] -= 30  # its last generation ended 30 s ago
        idle = node.models.stats()["models"]["a"]["idle_s"]
        await node.models.submit(GenerateSpec(gen_id="g1", model="a", prompt="hi"))
        node.models.last_used["a"] -= 30
        running = node.models.stats()["models"]["a"]["idle_s"]
        node.models.on_event(Done(gen_id="g1", seq=1, finish_reason="stop", usage={}, timings={}))
        return idle, running, node.models.stats()["models"]["a"]["idle_s"]
    idle, running, ended = asyncio.run(run())
    assert idle >= 30 and running == 0.0 and ended < 30  # idle from the end of its last generation


def test_a_budget_never_promises_more_than_the_device_has_free(monkeypatch):
    import nodes.agent.deploy as deploy

    node, _, _ = deployer(monkeypatch, budget=HELD * 3)
    monkeypatch.setattr(deploy, "device_memory", lambda offload: (HELD, "VRAM"))
    assert asyncio.run(node.available()) == (HELD, "VRAM")
    monkeypatch.setattr(deploy, "device_memory", lambda offload: (HELD * 10, "VRAM"))
    assert asyncio.run(node.available()) == (HELD * 3, "the node's memory budget")
