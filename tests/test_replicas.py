"""ReplicaSet routing among a node's engine workers, with stand-in workers (no processes)."""

import asyncio

from nodes.agent.replicas import ReplicaSet
from nodes.link.spec import GenerateSpec

SYSTEM = {"role": "system", "content": "You answer questions about bicycles. " * 20}


class StandInWorker:
    """Just enough of EngineWorker for routing: records what it was given."""

    def __init__(self, lanes: int = 2):
        self.lanes, self.alive, self.pid, self.submitted = lanes, True, 1, []

    async def start(self, on_progress=None):
        return {"model_name": "m", "context_window": 2048, "lanes": self.lanes, "capabilities": {},
                "engine": "mock", "engine_version": "1"}

    async def submit(self, spec):
        self.submitted.append(spec.gen_id)

    def stats(self):
        return {"lanes_busy": 0, "lanes": self.lanes}


def spec(gen_id: str, *turns: str) -> GenerateSpec:
    return GenerateSpec(gen_id=gen_id, model="m", messages=[SYSTEM, *({"role": "user", "content": t} for t in turns)])


def done(replicas: ReplicaSet, index: int, gen_id: str, prompt_tokens: int = 200) -> None:
    replicas.on_event(index, {"type": "done", "gen_id": gen_id, "usage": {"prompt_tokens": prompt_tokens},
                              "evicted": []})


def test_a_conversation_returns_to_the_replica_holding_it_and_evictions_at_accepted_are_honoured():
    workers = [StandInWorker(), StandInWorker()]
    replicas = ReplicaSet(workers, model_name="m")
    asyncio.run(replicas.start())
    asyncio.run(replicas.submit(spec("g1", "hi")))
    first = 0 if workers[0].submitted else 1
    done(replicas, first, "g1")
    asyncio.run(replicas.submit(spec("g2", "hi", "and brakes?")))
    assert "g2" in workers[first].submitted  # back to the replica that holds the conversation
    # The replica reports at admission that g2 took g1's lane: the index forgets what only g1 put there.
    replicas.on_event(first, {"type": "accepted", "gen_id": "g2", "prompt_tokens": 220, "evicted": ["g1"]})
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
