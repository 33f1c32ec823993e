"""ReplicaSet routing among a node's engine workers, with stand-in workers (no processes)."""

import asyncio

from nodes.agent.models import resolve_model
from nodes.agent.replicas import ReplicaSet
from nodes.agent.vocab import tokenizer_fingerprint
from nodes.link.lifecycle import placement_keys
from nodes.link.messages import Accepted, Done, TokenBatch
from nodes.link.spec import GenerateSpec

SYSTEM = {"role": "system", "content": "You answer questions about bicycles. " * 20}


class StandInWorker:
    """Just enough of EngineWorker for routing: records what it was given."""

    def __init__(self, lanes: int = 2, model: dict | None = None):
        self.lanes, self.alive, self.pid, self.submitted = lanes, True, 1, []
        self.figures: dict = {}  # what its engine measured of its speed
        self.model = model or {}  # its model's tokenizer and file, as a llama.cpp engine reports them

    async def start(self, on_progress=None):
        return {"model_name": "m", "context_window": 2048, "lanes": self.lanes, "capabilities": {},
                "engine": "mock", "engine_version": "1", **self.model}

    async def submit(self, spec):
        self.submitted.append(spec.gen_id)

    def stats(self):
        return {"lanes_busy": 0, "lanes": self.lanes, **self.figures}


def spec(gen_id: str, *turns: str) -> GenerateSpec:
    return GenerateSpec(gen_id=gen_id, model="m", messages=[SYSTEM, *({"role": "user", "content": t} for t in turns)])


def done(replicas: ReplicaSet, index: int, gen_id: str, prompt_tokens: int = 200) -> None:
    replicas.on_event(index, Done(gen_id=gen_id, seq=1, finish_reason="stop", usage={"prompt_tokens": prompt_tokens},
                                  timings={}))


def two_replicas_running_g1() -> tuple[list[StandInWorker], ReplicaSet, int]:
    """Two started replicas, a first generation "g1" submitted; and the index of the replica it went to."""
    workers = [StandInWorker(), StandInWorker()]
    replicas = ReplicaSet(workers, model_name="m")
    asyncio.run(replicas.start())
    asyncio.run(replicas.submit(spec("g1", "hi")))
    return workers, replicas, 0 if workers[0].submitted else 1


def test_a_conversation_returns_to_the_replica_holding_it_and_evictions_at_accepted_are_honoured():
    workers, replicas, first = two_replicas_running_g1()
    done(replicas, first, "g1")
    asyncio.run(replicas.submit(spec("g2", "hi", "and brakes?")))
    assert "g2" in workers[first].submitted  # back to the replica that holds the conversation
    # The replica reports at admission that g2 took g1's lane: the index forgets what only g1 put there.
    replicas.on_event(first, Accepted(gen_id="g2", prompt_tokens=220, evicted=["g1"]))
    key = replicas.keys["g2"][-1].key
    assert replicas.placement.holders(key) == set()
    done(replicas, first, "g2")
    assert replicas.placement.holders(key) == {f"r{first}"}


def test_a_dead_replica_takes_no_work():
    workers = [StandInWorker(), StandInWorker()]
    replicas = ReplicaSet(workers, model_name="m")
    asyncio.run(replicas.start())
    workers[0].alive = False
    for i in range(3):
        asyncio.run(replicas.submit(spec(f"g{i}", f"question {i}")))
    assert workers[0].submitted == [] and len(workers[1].submitted) == 3


def test_a_replica_holds_the_answer_too_so_the_next_turn_matches_the_whole_conversation():
    _, replicas, first = two_replicas_running_g1()
    replicas.on_event(first, TokenBatch(gen_id="g1", seq=1, text=[" Hello", " rider"], ids=[1, 2]))
    replicas.on_event(first, Done(gen_id="g1", seq=2, finish_reason="stop", usage={"completion_tokens": 2}, timings={}))

    answered = [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello rider"}]
    key = placement_keys(GenerateSpec(gen_id="g2", model="m", messages=answered), replicas.tokenizer)[-1].key
    assert replicas.placement.holders(key) == {f"r{first}"}
    assert [s.running for s in replicas.placement.nodes()] == [0, 0]


def test_each_replicas_measured_speed_reaches_its_placement_and_the_nodes_heartbeat():
    workers, replicas, _ = two_replicas_running_g1()
    workers[0].figures = {"prefill_tps": 500.0, "decode_slowdown_ms": 8.0}
    asyncio.run(replicas.submit(spec("g2", "hello")))  # the figures go to placement as each generation is placed

    slots = {s.node_id: s for s in replicas.placement.nodes()}
    assert (slots["r0"].prefill_tps, slots["r0"].decode_slowdown_ms) == (500.0, 8.0)
    assert replicas.stats()["prefill_tps"] == 500.0  # the node's heartbeat: the mean of the replicas that measured


def test_replicas_key_prompts_with_the_models_own_tokenizer_as_the_head_does():
    # Given replicas of a llama.cpp model (its engine reports its tokenizer's fingerprint and its file)
    from nodes.agent.vocab import Vocab

    path, _ = resolve_model("smollm2")
    model = {"tokenizer": tokenizer_fingerprint(path), "model_path": str(path)}
    workers = [StandInWorker(model=model), StandInWorker(model=model)]
    replicas = ReplicaSet(workers, model_name="m")
    asyncio.run(replicas.start())
    asyncio.run(replicas.submit(spec("g1", "hi")))
    first = 0 if workers[0].submitted else 1
    replicas.on_event(first, TokenBatch(gen_id="g1", seq=1, text=[" Hello", " rider"], ids=[1, 2]))
    replicas.on_event(first, Done(gen_id="g1", seq=2, finish_reason="stop", usage={"completion_tokens": 2}, timings={}))

    # Then what they hold is keyed by the model's real tokens: the keys the head makes with the same vocabulary
    head = Vocab(path, model["tokenizer"])
    answered = [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello rider"}]
    keys = placement_keys(GenerateSpec(gen_id="g2", model="m", messages=answered), head)
    assert replicas.placement.holders(keys[-1].key) == {f"r{first}"}
    assert keys[-1].tokens == sum(len(head.tokenize(t)) for t in (
        "system\x1e" + SYSTEM["content"].strip() + "\x1e", "user\x1ehi\x1e", "assistant\x1eHello rider\x1e"))


def test_each_replica_gets_its_own_cores_and_its_own_gpus(monkeypatch):
    """`node_join --replicas 2 --gpus 0,1,2,3` on a 4-core host: disjoint cores (each worker's threads fit its
    share) and each worker sees only its GPUs."""
    from nodes.agent.main import NodeOptions, engine_configs

    monkeypatch.setattr("nodes.agent.replicas.os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    configs, _, _ = engine_configs(NodeOptions(head=None, model="m", mock={}, replicas=2, gpus="0,1,2,3"))
    assert [c.cpu_affinity for c in configs] == [[0, 1], [2, 3]]
    assert [c.threads for c in configs] == [2, 2]
    assert [c.env for c in configs] == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    one, _, _ = engine_configs(NodeOptions(head=None, model="m", mock={}))
    assert one[0].cpu_affinity is None and one[0].threads == 4 and one[0].env == {}  # one replica: the whole host


async def test_a_worker_process_runs_on_the_cores_it_was_given():
    import os

    from nodes.agent.engine import EngineConfig, EngineWorker

    core = min(os.sched_getaffinity(0))
    worker = EngineWorker(EngineConfig(model_name="mock", lanes=1, mock={}, cpu_affinity=[core]), lambda event: None)
    await worker.start()
    try:
        assert os.sched_getaffinity(worker.pid) == {core}
    finally:
        await worker.stop()
