"""Several engine workers on one node, on disjoint GPU groups and CPU cores, routed with the fleet's cost rule."""

from __future__ import annotations

import os
from typing import Any

from nodes.agent.engine.base import ENDS, Event
from nodes.agent.vocab import BUILTINS, BYTES, tokenizer_of
from nodes.link.codes import ErrorCode
from nodes.link.device import merged_device
from nodes.link.lifecycle import PlacementLifecycle, aplacement_keys
from nodes.link.messages import Accepted, Done, TokenBatch
from nodes.link.placement import NodeSlot, PlacementState
from nodes.link.spec import GenerateSpec


class ReplicaConfigError(ValueError):
    """--replicas / --gpus that cannot be split into disjoint groups."""


def gpu_groups(replicas: int, gpus: str | None) -> list[list[str]]:
    """Split --gpus into one group per replica: "0,1,2,3" evenly, or explicit groups "0,1;2,3"."""
    if replicas < 1:
        raise ReplicaConfigError("--replicas must be at least 1")
    if not gpus:
        return [[] for _ in range(replicas)]
    if ";" in gpus:
        groups = [[g.strip() for g in part.split(",") if g.strip()] for part in gpus.split(";")]
        if len(groups) != replicas:
            raise ReplicaConfigError(f"--gpus names {len(groups)} groups but --replicas is {replicas}")
    else:
        flat = [g.strip() for g in gpus.split(",") if g.strip()]
        if len(flat) % replicas:
            raise ReplicaConfigError(
                f"--replicas {replicas} does not divide the {len(flat)} GPUs in --gpus {gpus}")
        size = len(flat) // replicas
        groups = [flat[i * size:(i + 1) * size] for i in range(replicas)]
    seen: dict[str, int] = {}
    for index, group in enumerate(groups):
        if not group:
            raise ReplicaConfigError(f"GPU group {index} in --gpus {gpus} is empty")
        for gpu in group:
            if gpu in seen:
                raise ReplicaConfigError(f"GPU {gpu} is in two groups ({seen[gpu]} and {index}) of --gpus {gpus}")
            seen[gpu] = index
    return groups


def cpu_groups(replicas: int, cpus: list[int] | None = None) -> list[list[int]]:
    """Disjoint CPU cores per replica (all cores to one replica when there is only one)."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if replicas == 1:
        return [cpus]
    if len(cpus) < replicas:
        raise ReplicaConfigError(
            f"--replicas {replicas} needs at least {replicas} CPU cores; this node has {len(cpus)}")
    size = len(cpus) // replicas
    return [cpus[i * size:(i + 1) * size] for i in range(replicas)]


class ReplicaSet:
    """Presents N EngineWorkers as one engine: the same interface, routed by prompt tokens to re-read + load."""

    def __init__(self, workers: list, *, model_name: str, load_tokens: int | None = None):
        self.workers = workers
        self.model_name = model_name
        self.placement = PlacementState(load_tokens=load_tokens)
        self.lifecycle = PlacementLifecycle(self.placement)
        self.where: dict[str, int] = {}  # gen_id -> replica index
        self.keys: dict[str, list] = {}
        self.specs: dict[str, GenerateSpec] = {}
        self.answers: dict[str, list[str]] = {}  # gen_id -> the answer's pieces so far (its keys are recorded at done)
        self.routed = [0] * len(workers)
        self._info: dict[str, Any] = {}
        # the model's own tokenizer (as the head's keys use it): the same keys on the node as on the head
        self.tokenizer: Any = BUILTINS[BYTES]

    def info(self) -> dict[str, Any]:
        return self._info

    @property
    def alive(self) -> bool:
        return any(w.alive for w in self.workers)

    async def start(self, on_progress=None) -> dict[str, Any]:
        infos = []
        for index, worker in enumerate(self.workers):
            infos.append(await worker.start(on_progress=on_progress))
            self.placement.node_up(NodeSlot(f"r{index}", f"replica-{index}", [self.model_name], infos[-1]["lanes"],
                                            infos[-1]["context_window"]))
        first = infos[0]
        self.tokenizer = tokenizer_of(first)
        self._info = {**first, "lanes": sum(i["lanes"] for i in infos), "replicas": self._replica_states(),
                      "device": merged_device([i.get("device") for i in infos]),
                      "warm_generations": sorted({g for i in infos for g in i.get("warm_generations", [])})}
        return self._info

    def on_event(self, index: int, event: Event) -> Event:
        """Called by each worker's event hook: tags the replica and takes the placement through its lifecycle."""
        gen_id, replica = event.gen_id, f"r{index}"
        if isinstance(event, Accepted):
            event.replica = index
            self.lifecycle.accepted(replica, event.evicted)
        elif isinstance(event, TokenBatch) and gen_id in self.answers:
            self.answers[gen_id].extend(event.text)
        elif isinstance(event, ENDS) and self.where.pop(gen_id, None) is not None:
            spec, keys, answer = self.specs.pop(gen_id), self.keys.pop(gen_id), "".join(self.answers.pop(gen_id))
            if isinstance(event, Done):
                event.replica = index
                self.lifecycle.done(replica, spec, keys, answer=answer, usage=event.usage, tokenizer=self.tokenizer,
                                    evicted=event.evicted)
            else:
                self.lifecycle.lost(replica, gen_id, cache_gone=event.code == ErrorCode.ENGINE_CRASHED)
        return event

    async def submit(self, spec: GenerateSpec) -> None:
        keys = await aplacement_keys(spec, self.tokenizer)
        for index, worker in enumerate(self.workers):
            self.placement.set_schedulable(f"r{index}", worker.alive)
            self.lifecycle.measured(f"r{index}", worker.stats())
        choice = self.lifecycle.choose(spec, keys, model=self.model_name)
        if choice is not None:
            index = int(choice.node_id[1:])
        else:  # every live lane is busy: queue in the engine of the least-routed live replica, never a dead one
            alive = [i for i, w in enumerate(self.workers) if w.alive] or list(range(len(self.workers)))
            index = min(alive, key=lambda i: self.routed[i])
        self.routed[index] += 1
        self.where[spec.gen_id], self.keys[spec.gen_id], self.specs[spec.gen_id] = index, keys, spec
        self.answers[spec.gen_id] = []
        await self.workers[index].submit(spec)

    async def cancel(self, gen_id: str) -> None:
        index = self.where.get(gen_id)
        if index is not None:
            await self.workers[index].cancel(gen_id)

    async def state_op(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        alive = [w for w in self.workers if w.alive] or self.workers
        return await alive[0].state_op(op, args)

    def _replica_states(self) -> list[dict[str, Any]]:
        slots = {s.node_id: s for s in self.placement.nodes()}
        return [
            {"index": i, "alive": w.alive, "running": slots[f"r{i}"].running if f"r{i}" in slots else 0,
             "routed": self.routed[i], "pid": w.pid}
            for i, w in enumerate(self.workers)
        ]

    def stats(self) -> dict[str, Any]:
        per = [w.stats() for w in self.workers]
        fields = ("lanes_busy", "lanes", "kv_used", "kv_total", "tokens_per_s")
        total = {k: sum(p.get(k, 0) for p in per) for k in fields}
        for figure in ("prefill_tps", "decode_slowdown_ms"):  # each replica's own: the mean of those measured
            measured = [p[figure] for p in per if p.get(figure)]
            total[figure] = sum(measured) / len(measured) if measured else 0.0
        total["cache_cleared"] = any(p.get("cache_cleared") for p in per)
        total["device"] = merged_device([p.get("device") for p in per])
        total["replicas"] = self._replica_states()
        return total

    async def stop(self) -> None:
        for worker in self.workers:
            await worker.stop()
