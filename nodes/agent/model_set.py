"""A node's engines, one per model it serves, presented to the agent as one engine.

The node's own `--model` (its primary: an EngineWorker or a ReplicaSet) serves from the start; the operator's
deployments add an EngineWorker each (nodes.agent.deploy). A generation goes to the engine of its model. A model being
unloaded is draining: no longer announced, but a generation the head placed before it read that still runs there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nodes.agent.engine.base import ENDS, Event, error_event
from nodes.link.codes import ErrorCode
from nodes.link.spec import GenerateSpec

SUMMED = ("lanes_busy", "lanes", "kv_used", "kv_total", "tokens_per_s")


class ModelSet:
    """The primary engine plus the deployed ones; the agent's `engine`. `forward` gets every engine's events."""

    def __init__(self, primary: Any, *, forward: Callable[[Event], Any] | None = None) -> None:
        self.primary = primary
        self.forward = forward or (lambda event: None)
        self.serving: dict[str, Any] = {}  # name -> EngineWorker, announced to the head
        self.draining: dict[str, Any] = {}  # name -> EngineWorker, unannounced, finishing what runs there
        self.retired: set[str] = set()  # unloaded: a late generation of these is sent elsewhere, not to the primary
        self.where: dict[str, Any] = {}  # gen_id -> the deployed engine running it
        self.retiring_adapters: set[str] = set()  # registry adapters being unloaded: no longer announced
        self.last_used: dict[str, float] = {}  # deployed model -> when a generation of it last started or ended

    # -- what the node serves ------------------------------------------------------------------------------------

    @property
    def primary_name(self) -> str:
        return self.primary.info().get("model_name", "")

    def models(self) -> list[dict[str, Any]]:
        """Every model served, the primary first: what `register` and `models` tell the head."""
        own = self.primary.info()
        rows = [{"name": own.get("model_name", ""), "context_window": own.get("context_window", 0),
                 "lanes": own.get("lanes", 0)}]
        # `--transcribe`: served beside the text model by the same worker (or alone, when it is the worker's model)
        if own.get("speech_model") and own["speech_model"] != rows[0]["name"]:
            rows.append({"name": own["speech_model"], "context_window": own.get("context_window", 0), "lanes": 0})
        rows += self._adapter_rows(rows[0]["name"], own)
        for name, engine in self.serving.items():
            info = engine.info()
            rows.append({"name": name, "context_window": info["context_window"], "lanes": info["lanes"]})
            rows += self._adapter_rows(name, info)
        return rows

    def _adapter_rows(self, base: str, info: dict[str, Any]) -> list[dict[str, Any]]:
        """Each LoRA adapter of an engine (`--lora`, or loaded for the registry) is also served as BASE:ADAPTER, so a
        plain OpenAI client picks it by model name; one being unloaded is no longer announced."""
        return [{"name": f"{base}:{name}", "context_window": info.get("context_window", 0), "lanes": 0}
                for name in _adapters(info) if name not in self.retiring_adapters]

    def capabilities(self) -> dict[str, Any]:
        """The primary's capabilities, with every engine's adapters (`lora:NAME`) but those being unloaded."""
        own = self.primary.info().get("capabilities") or {}
        caps = {k: v for k, v in own.items() if not k.startswith("lora:")}
        for info in (self.primary.info(), *(engine.info() for engine in self.serving.values())):
            caps.update({f"lora:{name}": True for name in _adapters(info) if name not in self.retiring_adapters})
        return caps

    def engine_of(self, name: str) -> Any:
        """The engine serving model `name` (the primary or a deployed one), or None."""
        return self.primary if name == self.primary_name else self.serving.get(name)

    def add(self, name: str, engine: Any) -> None:
        self.retired.discard(name)
        self.serving[name] = engine
        self.last_used[name] = time.monotonic()

    def retire(self, name: str) -> Any:
        """Stop announcing `name`; its engine drains (generations placed before the head knew still run there)."""
        engine = self.draining[name] = self.serving.pop(name)
        return engine

    def drop(self, name: str) -> Any:
        """The drained engine of `name`, no longer routed to (the caller stops it)."""
        self.retired.add(name)
        return self.draining.pop(name)

    def running(self, engine: Any) -> int:
        return sum(1 for e in self.where.values() if e is engine)

    def on_event(self, event: Event) -> None:
        """A deployed engine's event hook."""
        if isinstance(event, ENDS) and (engine := self.where.pop(event.gen_id, None)) is not None:
            self._used(engine)
        self.forward(event)

    # -- the engine interface --------------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        models = self.models()
        return {**self.primary.info(), "models": models, "lanes": sum(m["lanes"] for m in models),
                "capabilities": self.capabilities()}

    @property
    def alive(self) -> bool:
        return self.primary.alive

    def stats(self) -> dict[str, Any]:
        """The node's figures (every engine's summed) and, under "models", each served model's own engine's with its
        context window: the head shows a model's lanes, busy lanes, KV and window from these (nodes.selectors
        .node_figures), not the node's totals repeated per model."""
        own = self.primary.stats()
        stats, per_model = dict(own), {self.primary_name: _figures(own, self.primary)}
        for name, engine in (*self.serving.items(), *self.draining.items()):
            other = engine.stats()
            for key in SUMMED:
                stats[key] = stats.get(key, 0) + other.get(key, 0)
            if name in self.serving:  # idle_s: how long since it last ran a generation (on-demand keep-alive, LRU)
                idle = 0.0 if self.running(engine) else time.monotonic() - self.last_used.get(name, time.monotonic())
                per_model[name] = {**_figures(other, engine), "idle_s": round(idle, 1)}
        stats["models"] = per_model
        return stats

    async def submit(self, spec: GenerateSpec) -> None:
        base = spec.model.partition(":")[0]  # BASE:ADAPTER runs on BASE's engine
        engine = self.serving.get(base) or self.draining.get(base)
        if engine is None and base in self.retired:
            self.forward(error_event(spec.gen_id, ErrorCode.ENGINE_UNAVAILABLE, f"this node unloaded {spec.model!r}; "
                                     "place it on a node serving it", retryable=True))
            return
        if engine is None:
            await self.primary.submit(spec)
            return
        self.where[spec.gen_id] = engine
        await engine.submit(spec)

    def _used(self, engine: Any) -> None:
        for name, other in self.serving.items():
            if other is engine:
                self.last_used[name] = time.monotonic()

    async def cancel(self, gen_id: str) -> None:
        await self.where.get(gen_id, self.primary).cancel(gen_id)

    async def state_op(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        return await self.serving.get(args.get("model") or "", self.primary).state_op(op, args)

    async def stop(self) -> None:
        for engine in (*self.serving.values(), *self.draining.values(), self.primary):
            await engine.stop()


def _figures(stats: dict[str, Any], engine: Any) -> dict[str, Any]:
    """An engine's figures, with the window its lanes run with (a deployed or on-demand model's may differ from the
    node's own model's: the pages show each model's)."""
    return {**{key: stats.get(key, 0) for key in SUMMED}, "context_window": engine.info().get("context_window", 0)}


def _adapters(info: dict[str, Any]) -> list[str]:
    return [key[5:] for key, on in sorted((info.get("capabilities") or {}).items()) if key.startswith("lora:") and on]
