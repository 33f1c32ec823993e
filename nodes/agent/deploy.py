"""The node's side of deployments: load what the head's `deploy` lists, each model in an engine worker of its own.

A model the node lacks is pulled first (nodes.agent.pull, through the same grant as `node_join --model NAME`). It is
loaded only when the memory available (VRAM on a GPU, else RAM) holds its weights and its lanes' KV cache (the same
rule as the window sizing in nodes.agent.window); else it fails with the figures. The node serves what it served
meanwhile, and announces the new model (`models`) once its worker is ready. A model no longer listed is unannounced
first, then drained (what runs there finishes), then its worker stops. Each step goes to the head as a `model_state`.
A listed model with an `mmproj` (the registry's projector for it) is loaded with that projector, pulled the same way,
so it reads images.

The registry's LoRA adapters come in the same message, by base model: each model of those names the node serves loads
them in its worker while it serves (pulled first, like a model), announcing BASE:ADAPTER and `lora:ADAPTER`; an
adapter no longer listed is unannounced, then unloaded once no generation uses it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nodes.agent.engine.base import EngineConfig, StateOpError
from nodes.agent.gguf_info import GgufError, read_gguf
from nodes.agent.gpu import OffloadPlan
from nodes.agent.model_set import ModelSet
from nodes.agent.window import WindowError, device_memory, size_window
from nodes.link.codes import ErrorCode, ModelPhase
from nodes.link.messages import Deploy, Models, ModelState

log = logging.getLogger("nodes.agent")

DRAIN_GRACE_S = 2.0  # a generation the head placed before it read the node's new model list may still be on its way
DRAIN_POLL_S = 0.2
PROGRESS_EVERY_S = 0.5


class DeployRefused(Exception):
    """This node cannot serve the model (not on the node and not pullable, or no room for it); says why."""


def footprint(path: Path, *, lanes: int, window: int) -> int:
    """Bytes a loaded model holds: its weights (the file's size) and its lanes' KV cache (0: the file is refused)."""
    try:
        info = read_gguf(path)
    except (GgufError, OSError):
        return 0
    return info.size + lanes * window * info.kv_bytes_per_token


def deployed_window(path: Path, *, lanes: int, context: int, available: int, memory: str = "RAM") -> int:
    """The context window a lane of `path` gets on this device (`context`, or sized when 0); DeployRefused with the
    figures when its weights and KV cache do not fit in the memory available (`memory`: RAM or VRAM)."""
    try:
        info = read_gguf(path)
    except (GgufError, OSError) as exc:
        raise DeployRefused(f"the model file is refused: {exc}") from None
    try:
        window = size_window(kv_bytes_per_token=info.kv_bytes_per_token, trained=context or info.context_length,
                             lanes=lanes, model_bytes=info.size, available=available, memory=memory)
    except WindowError as exc:
        raise DeployRefused(f"not enough memory: {exc}") from None
    if context and window.tokens < context:
        raise DeployRefused(f"not enough memory for {lanes} lanes of {context:,} tokens: {window.why}")
    return window.tokens


class Deployer:
    """Applies `deploy` messages to a ModelSet. `fetch(name, progress)` returns the node's verified copy of a registry
    model (pulling it; progress(fraction) as it goes); `send` puts a message on the link (dropped while it is down);
    `make_worker(config)` builds an engine worker whose events go to the set.

    `memory_budget` (node_join --memory-budget; 0: none) caps the bytes this node's models may hold: a model loads only
    where the budget less what the loaded ones hold (`held`) fits it, and the heartbeat says what is left
    (`memory_free`), which the head places on-demand models by. `on_demand` False (--no-on-demand): the head never
    loads one here. `mock`: deployed models run on the mock engine too (a mock node, for tests and benchmarks)."""

    def __init__(self, models: ModelSet, *, fetch: Callable[[str, Callable[[float], None]], Awaitable[Path]],
                 send: Callable[[Any], None], make_worker: Callable[[EngineConfig], Any],
                 batch_invariant: bool = False, memory_budget: int = 0, on_demand: bool = True,
                 mock: dict | None = None, primary_bytes: int = 0, plan: OffloadPlan | None = None) -> None:
        self.models = models
        self.plan = plan or OffloadPlan("cpu", 0)  # what each model's engine worker loads with (nodes.agent.gpu)
        self.fetch, self.send, self.make_worker = fetch, send, make_worker
        self.batch_invariant = batch_invariant
        self.memory_budget, self.on_demand, self.mock = memory_budget, on_demand, mock
        self.held: dict[str, int] = {"": primary_bytes}  # model -> bytes its loaded worker holds ("": the primary)
        self.unloading: set[asyncio.Task] = set()  # drains under way: a load waits for them (they make its room)
        self.fitting = asyncio.Lock()  # a load's fit check and its reservation in `held`, one load at a time
        self.tasks: dict[str, asyncio.Task] = {}  # name -> its load or unload
        self.last: dict[str, ModelState] = {}  # name -> the last state reported
        self.adapters_wanted: dict[str, dict[str, str]] = {}  # base -> {adapter: sha256}, as the head last said
        self.adapters: dict[tuple[str, str], asyncio.Task] = {}  # (base, adapter) -> its load, kept while loaded

    def apply(self, msg: Deploy) -> None:
        """Start what `msg` adds, unload what it no longer lists; report again where each listed model stands."""
        wanted = {m["name"]: m for m in msg.models if isinstance(m, dict) and isinstance(m.get("name"), str)}
        for name, spec in wanted.items():
            self._want(name, spec)
        for name, last in list(self.last.items()):
            gone = last.state in (ModelPhase.DRAINING, ModelPhase.UNLOADED) or name == self.models.primary_name
            if name not in wanted and not gone:
                self._unwant(name)
        self.adapters_wanted = {base: {a["name"]: a.get("sha256", "") for a in rows if isinstance(a, dict)
                                       and isinstance(a.get("name"), str)}
                                for base, rows in msg.adapters.items() if isinstance(rows, list)}
        self.sync_adapters()

    # -- LoRA adapters --------------------------------------------------------------------------------------------

    def sync_adapters(self) -> None:
        """Load each listed adapter on the engines serving its base; unload those no longer listed."""
        served = [self.models.primary_name, *self.models.serving]
        for base in served:
            for name in self.adapters_wanted.get(base, {}):
                task = self.adapters.get((base, name))
                if task is None:
                    self.adapters[base, name] = asyncio.ensure_future(self._load_adapter(base, name))
                elif task.done() and not task.cancelled() and task.result():
                    self.report(name, ModelPhase.SERVING, keep=False)  # a head that (re)joined us learns it again
        for (base, name), task in list(self.adapters.items()):
            if name not in self.adapters_wanted.get(base, {}) or base not in served:
                del self.adapters[base, name]
                asyncio.ensure_future(self._unload_adapter(base, name, task))

    async def _load_adapter(self, base: str, name: str) -> bool:
        try:
            self.report(name, ModelPhase.PULLING, keep=False)
            path = await self.fetch(name, self._progress(name, keep=False))
            self.report(name, ModelPhase.LOADING, keep=False)
            engine = self.models.engine_of(base)
            if not hasattr(engine, "adapter"):
                raise DeployRefused(f"{base!r} runs in several replicas here; adapters load on one worker only")
            await engine.adapter(name, str(path))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failed pull, a file llama.cpp refuses: reported, never raised
            log.warning("fleet node: could not load LoRA adapter %s on %s: %s", name, base, exc)
            self.report(name, ModelPhase.FAILED, detail=str(exc) or type(exc).__name__, keep=False)
            return False
        self.announce()
        log.info("fleet node: LoRA adapter %s loaded on %s (served as %s:%s)", name, base, base, name)
        self.report(name, ModelPhase.SERVING, keep=False)
        return True

    async def _unload_adapter(self, base: str, name: str, load: asyncio.Task) -> None:
        """Unannounce first, then unload once no queued or running generation uses it."""
        if not load.done():
            load.cancel()
        if not load.done() or load.cancelled() or not load.result():
            self.report(name, ModelPhase.UNLOADED, keep=False)
            return
        self.models.retiring_adapters.add(name)
        self.announce()
        self.report(name, ModelPhase.DRAINING, keep=False)
        await asyncio.sleep(DRAIN_GRACE_S)
        engine = self.models.engine_of(base)
        while engine is not None:
            try:
                await engine.adapter(name, None)
                break
            except StateOpError as exc:
                if exc.code != ErrorCode.ADAPTER_IN_USE:
                    log.warning("fleet node: could not unload LoRA adapter %s: %s", name, exc.message)
                    break
                await asyncio.sleep(DRAIN_POLL_S)
        self.models.retiring_adapters.discard(name)
        self.announce()
        log.info("fleet node: LoRA adapter %s unloaded from %s", name, base)
        self.report(name, ModelPhase.UNLOADED, keep=False)

    def _want(self, name: str, spec: dict[str, Any]) -> None:
        busy = name in self.tasks and not self.tasks[name].done()
        if name == self.models.primary_name or (name in self.models.serving and not busy):
            self.report(name, ModelPhase.SERVING)
        elif busy and self.last[name].state != ModelPhase.DRAINING:
            self.send(self.last[name])
        else:  # new, failed before, or draining (loaded again once drained)
            previous = self.tasks.get(name)
            self.tasks[name] = asyncio.ensure_future(self._load(name, spec, previous))

    def _unwant(self, name: str) -> None:
        """Serving: drain, then unload. Pulling or loading: stop (its worker is stopped in _load). Failed: forget."""
        if name in self.models.serving:
            task = self.tasks[name] = asyncio.ensure_future(self._unload(name))
            self.unloading.add(task)
            task.add_done_callback(self.unloading.discard)
            return
        task = self.tasks.get(name)
        if task is not None and not task.done():
            task.cancel()
        self.report(name, ModelPhase.UNLOADED)

    def report(self, name: str, state: ModelPhase, *, progress: float = 0.0, detail: str = "",
               keep: bool = True) -> None:
        """Tell the head where `name` stands (`keep`: a model, whose last state decides what a deploy changes)."""
        msg = ModelState(model=name, state=state.value, progress=round(progress, 3), detail=detail[:500])
        if keep:
            self.last[name] = msg
        self.send(msg)

    def announce(self) -> None:
        info = self.models.info()
        self.send(Models(models=info["models"], lanes=info["lanes"], context_window=info.get("context_window", 0),
                         capabilities=info["capabilities"]))

    async def _load(self, name: str, spec: dict[str, Any], previous: asyncio.Task | None) -> None:
        if previous is not None and not previous.done():
            await asyncio.shield(previous)  # a drain of the same name: load again once it is done
        worker = None
        try:
            self.report(name, ModelPhase.PULLING)
            path = await self.fetch(name, self._progress(name))
            mmproj = spec.get("mmproj") if isinstance(spec.get("mmproj"), dict) else None
            projector = await self.fetch(str(mmproj["name"]), lambda fraction: None) if mmproj else None
            self.report(name, ModelPhase.LOADING)
            lanes, context = int(spec.get("lanes") or 1), int(spec.get("context") or 0)
            if self.unloading:  # what the head unloaded to make room for this one: gone first
                await asyncio.gather(*self.unloading, return_exceptions=True)
            async with self.fitting:  # two loads at once must not both count the same free bytes
                available, memory = await self.available()
                window = await asyncio.to_thread(deployed_window, path, lanes=lanes, context=context,
                                                 available=available, memory=memory)
                self.held[name] = await asyncio.to_thread(footprint, path, lanes=lanes, window=window)
            worker = self.make_worker(EngineConfig(model_path=str(path), model_name=name, lanes=lanes,
                                                   max_context=window, batch_invariant=self.batch_invariant,
                                                   mmproj_path=str(projector) if projector else None, mock=self.mock,
                                                   gpu_layers=self.plan.gpu_layers,
                                                   host_gpus=list(self.plan.host_gpus),
                                                   split_mode=self.plan.split_mode,
                                                   tensor_split=list(self.plan.tensor_split)))
            info = await worker.start(on_progress=self._progress(name, phase=ModelPhase.LOADING))
        except asyncio.CancelledError:
            self.held.pop(name, None)
            if worker is not None:
                await worker.stop()
            raise
        except Exception as exc:  # DeployRefused, EngineLoadError, a failed pull: reported, never raised
            log.warning("fleet node: could not deploy %s: %s", name, exc)
            self.held.pop(name, None)
            if worker is not None:
                await worker.stop()
            self.report(name, ModelPhase.FAILED, detail=str(exc) or type(exc).__name__)
            return
        self.models.add(name, worker)
        self.announce()  # before `serving`: the head routes the name here when it reads that
        log.info("fleet node: %s deployed, context window %d tokens, %d lanes", name, info["context_window"],
                 info["lanes"])
        self.report(name, ModelPhase.SERVING)
        self.sync_adapters()  # its registry adapters

    async def _unload(self, name: str) -> None:
        engine = self.models.retire(name)
        self.announce()
        self.report(name, ModelPhase.DRAINING)
        await asyncio.sleep(DRAIN_GRACE_S)
        while self.models.running(engine):
            await asyncio.sleep(DRAIN_POLL_S)
        self.models.drop(name)
        await engine.stop()
        self.held.pop(name, None)
        self.sync_adapters()  # the adapters loaded on it went with it
        log.info("fleet node: %s unloaded", name)
        self.report(name, ModelPhase.UNLOADED)

    async def available(self) -> tuple[int, str]:
        """(bytes free for another model, which memory): the budget less what the loaded models (and those loading)
        hold, and never more than the device has free (which already lacks what they hold); else the device's."""
        device, memory = await asyncio.to_thread(device_memory, offload=self.plan.gpu_layers != 0)
        if self.memory_budget and (left := max(self.memory_budget - sum(self.held.values()), 0)) < device:
            return left, "the node's memory budget"
        return device, memory

    async def memory_free(self) -> int:
        """What the heartbeat says is free for another model (0 on a --no-on-demand node: none is placed here)."""
        return (await self.available())[0] if self.on_demand else 0

    def _progress(self, name: str, *, keep: bool = True,
                  phase: ModelPhase = ModelPhase.PULLING) -> Callable[[float], None]:
        """A pull's or a load's progress callback (a pull calls it on its thread, a load on the loop): at most one
        `phase` report each PROGRESS_EVERY_S, and the last."""
        loop = asyncio.get_running_loop()
        last = [0.0]

        def progress(fraction: float) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S or fraction >= 1.0:
                last[0] = now
                loop.call_soon_threadsafe(lambda: self.report(name, phase, progress=fraction, keep=keep))
        return progress
