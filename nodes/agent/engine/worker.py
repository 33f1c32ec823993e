"""The engine in a process of its own, so a llama.cpp abort or a kill takes down one worker, not the agent.

The child (`child.child_main`) loads the engine and serves the pipe. The agent side (`EngineWorker`, here)
reads the pipe on a background thread and hands every message to the event loop. When the child dies,
each generation it was running gets an `engine_crashed` error and the worker is restarted after a cooldown.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from nodes.agent import tracing
from nodes.agent.engine.base import (
    ENDS,
    EngineConfig,
    EngineLoadError,
    Event,
    StateOpError,
    error_event,
)
from nodes.agent.engine.child import child_main
from nodes.link import trace
from nodes.link.codes import ErrorCode
from nodes.link.spec import GenerateSpec

log = logging.getLogger(__name__)


class EngineWorker:
    """The agent's handle on one engine worker process (asyncio).

    Events (accepted/tokens/done/error dicts) go to `on_event`, called on the event loop. `on_progress`
    gets load progress 0..1; `on_restart(info)` is called after the worker came back from a crash (its
    KV caches are gone, which `info()` and `stats()` also report once as `cache_cleared`).
    """

    def __init__(
        self,
        config: EngineConfig,
        on_event: Callable[[Event], Any],
        *,
        on_progress: Callable[[float], Any] | None = None,
        on_restart: Callable[[dict[str, Any]], Any] | None = None,
        restart_cooldown: float = 2.0,
        state_op_timeout: float = 60.0,
        load_timeout: float | None = None,
    ) -> None:
        self.config = config
        self.on_event = on_event
        self.on_progress = on_progress
        self.on_restart = on_restart
        self.restart_cooldown = restart_cooldown
        self.state_op_timeout = state_op_timeout
        self.load_timeout = load_timeout
        self.restarts = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: Any = None
        self._conn: Connection | None = None
        self._epoch = 0
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._info: dict[str, Any] = {}
        self._stats: dict[str, Any] = {}
        self._in_flight: set[str] = set()
        self._pending_ops: dict[int, asyncio.Future[tuple[bool, dict[str, Any]]]] = {}
        self._op_ids = itertools.count(1)
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-send")
        self._alive = False
        self._stopping = False
        self._started_at = 0.0
        self._restart_task: asyncio.Task[None] | None = None
        self._cleared_info = self._cleared_stats = False

    # -- public ---------------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._alive

    def info(self) -> dict[str, Any]:
        info = dict(self._info)
        if self._cleared_info:
            info["cache_cleared"], self._cleared_info = True, False
        return info

    def stats(self) -> dict[str, Any]:
        stats = {**self._stats, "alive": self._alive, "restarts": self.restarts}
        if "device" not in stats and "device" in self._info:  # the child reports stats once it has work
            stats["device"] = self._info["device"]
        if not stats.get("lanes_busy") and not stats.get("queued"):
            # the child's last report as it went idle still held its last two seconds' rate, and an idle child
            # reports nothing more: idle generates nothing
            stats["tokens_per_s"] = 0.0
        if self._cleared_stats:
            stats["cache_cleared"], self._cleared_stats = True, False
        return stats

    async def start(self, on_progress: Callable[[float], Any] | None = None) -> dict[str, Any]:
        """Spawn the worker and wait for its model to load; raises EngineLoadError when it cannot.

        `on_progress(fraction)`, when given, replaces the constructor's load-progress callback."""
        if on_progress is not None:
            self.on_progress = on_progress
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        return await self._launch()

    async def submit(self, spec: GenerateSpec) -> None:
        if not self._alive:
            self._emit(
                error_event(
                    spec.gen_id,
                    ErrorCode.ENGINE_UNAVAILABLE,
                    "the engine worker is not running (starting or restarting); retry on another node",
                    retryable=True,
                )
            )
            return
        # Counted before sending: if the child dies meanwhile, the exit handler reports this generation too.
        self._in_flight.add(spec.gen_id)
        if trace.ENABLED:
            tracing.submitted(spec.gen_id, self.pid)
        await self._send(("submit", spec.to_dict()))

    async def cancel(self, gen_id: str) -> None:
        if self._alive and gen_id in self._in_flight:
            await self._send(("cancel", gen_id))

    async def state_op(self, op: str, args: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Run `op` (embed, tokenize, capabilities, kv_export, ...) in the worker; raises StateOpError on failure."""
        if not self._alive:
            raise StateOpError(ErrorCode.ENGINE_UNAVAILABLE, "the engine worker is not running")
        assert self._loop is not None
        op_id = next(self._op_ids)
        future: asyncio.Future[tuple[bool, dict[str, Any]]] = self._loop.create_future()
        self._pending_ops[op_id] = future
        try:
            await self._send(("state_op", op_id, op, args))
            ok, result = await asyncio.wait_for(future, timeout or self.state_op_timeout)
        finally:
            self._pending_ops.pop(op_id, None)
        if not ok:
            raise StateOpError(result["code"], result["message"])
        return result

    async def adapter(self, name: str, path: str | None) -> None:
        """Load (`path`) or unload (None) a LoRA adapter while serving; a restarted worker loads it again. Raises
        StateOpError (an unload refused while a generation uses it, a file llama.cpp refuses)."""
        op, args = ("lora_load", {"name": name, "path": path}) if path else ("lora_unload", {"name": name})
        result = await self.state_op(op, args)
        if path:
            self.config.adapters[name] = path
        else:
            self.config.adapters.pop(name, None)
        kept = {k: v for k, v in (self._info.get("capabilities") or {}).items() if not k.startswith("lora:")}
        lora = {k: v for k, v in result.get("capabilities", {}).items() if k.startswith("lora:")}
        self._info = {**self._info, "capabilities": {**kept, **lora}}

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker (no restart); running generations get an `engine_unavailable` error."""
        self._stopping = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        proc, self._alive = self._proc, False
        if proc is not None:
            await self._send(("stop",))
            await asyncio.to_thread(_reap, proc, timeout)
        self._fail_in_flight(ErrorCode.ENGINE_UNAVAILABLE, "the engine worker was stopped; the generation was stopped")
        if self._conn is not None:
            self._conn.close()
        self._sender.shutdown(wait=False)

    # -- process lifecycle ----------------------------------------------------------------------------

    async def _launch(self) -> dict[str, Any]:
        assert self._loop is not None
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=child_main, args=(child_conn, self.config.to_dict()), daemon=True)
        proc.start()
        child_conn.close()
        self._epoch += 1
        self._proc, self._conn, self._started_at = proc, parent_conn, time.monotonic()
        self._ready = self._loop.create_future()
        threading.Thread(
            target=self._read, args=(self._epoch, proc, parent_conn), name="engine-reader", daemon=True
        ).start()
        try:
            info = await asyncio.wait_for(asyncio.shield(self._ready), self.load_timeout)
        except TimeoutError:
            await asyncio.to_thread(_reap, proc, 0)
            raise EngineLoadError(f"the engine did not load its model within {self.load_timeout} s") from None
        self._info, self._alive = info, True
        return info

    def _read(self, epoch: int, proc: Any, conn: Connection) -> None:
        """Reader thread: every message goes to the loop in order; EOF means the child is gone."""
        assert self._loop is not None
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            self._loop.call_soon_threadsafe(self._on_message, epoch, message)
        proc.join(timeout=10)
        code = proc.exitcode
        with contextlib.suppress(RuntimeError):  # a closed loop: the agent is shutting down
            self._loop.call_soon_threadsafe(self._on_exit, epoch, code)

    def _on_message(self, epoch: int, message: tuple) -> None:
        if epoch != self._epoch:
            return
        kind = message[0]
        if kind == "events":
            for event in message[1]:
                if isinstance(event, ENDS):
                    self._in_flight.discard(event.gen_id)
                self._emit(event)
        elif kind == "stats":
            self._stats = message[1]
        elif kind == "result":
            future = self._pending_ops.get(message[1])
            if future is not None and not future.done():
                future.set_result((message[2], message[3]))
        elif kind == "progress" and self.on_progress is not None:
            self.on_progress(message[1])
        elif kind == "ready" and self._ready is not None and not self._ready.done():
            self._ready.set_result(message[1])
        elif kind == "load_error" and self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineLoadError(f"the engine could not load its model: {message[1]}"))

    def _on_exit(self, epoch: int, code: int | None) -> None:
        if epoch != self._epoch:
            return
        was_alive, self._alive = self._alive, False
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(
                EngineLoadError(f"the engine worker died while loading the model (exit code {code})")
            )
        message = f"the engine worker died (exit code {code}); the generation was stopped"
        self._fail_in_flight(ErrorCode.ENGINE_CRASHED, message)
        for future in self._pending_ops.values():
            if not future.done():
                future.set_exception(StateOpError(ErrorCode.ENGINE_CRASHED, message))
        if self._stopping or not was_alive:
            return
        log.error("engine worker %s exited with code %s; restarting", self.pid, code)
        self._restart_task = asyncio.ensure_future(self._restart())

    async def _restart(self) -> None:
        """Start a new worker, at most once per cooldown, retrying with a growing pause while loads fail."""
        delay = max(self.restart_cooldown, self._started_at + self.restart_cooldown - time.monotonic())
        while not self._stopping:
            await asyncio.sleep(delay)
            try:
                info = await self._launch()
            except EngineLoadError as exc:
                log.error("engine worker restart failed: %s", exc)
                delay = min(delay * 2, 60.0)
                continue
            self.restarts += 1
            self._cleared_info = self._cleared_stats = True
            self._stats = {}
            if self.on_restart is not None:
                self.on_restart({**info, "cache_cleared": True})
            return

    # -- helpers --------------------------------------------------------------------------------------

    async def _send(self, message: tuple) -> None:
        conn = self._conn
        if conn is None:
            return
        assert self._loop is not None
        # One sending thread keeps messages in order and the loop free while the child finishes a step. A send
        # to a dead child fails quietly: the reader thread reports the death and fails what was in flight.
        with contextlib.suppress(OSError, ValueError):
            await self._loop.run_in_executor(self._sender, conn.send, message)

    def _emit(self, event: Event) -> None:
        try:
            self.on_event(event)
        except Exception:
            log.exception("on_event failed for %s of %s", type(event).__name__, event.gen_id)

    def _fail_in_flight(self, code: str, message: str) -> None:
        gen_ids, self._in_flight = sorted(self._in_flight), set()
        for gen_id in gen_ids:
            self._emit(error_event(gen_id, code, message, retryable=True))


def _reap(proc: Any, timeout: float) -> None:
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(2)
    if proc.is_alive():
        proc.kill()
        proc.join(2)
