"""The worker process's side: load the engine, then serve the pipe until told to stop or orphaned.

While any lane is busy the loop runs `step()` and drains the pipe without blocking between steps; when idle
it does housekeeping (parking lanes) and blocks on the pipe. Messages are plain tuples:
agent -> child: ("submit", spec_dict), ("cancel", gen_id), ("state_op", op_id, op, args), ("stop",);
child -> agent: ("progress", f), ("ready", info), ("load_error", text), ("events", [event]), ("stats", stats),
("result", op_id, ok, result).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from nodes.agent.engine.base import (
    Engine,
    EngineConfig,
    EngineLoadError,
    StateOpError,
    create_engine,
    error_event,
)
from nodes.link.codes import ErrorCode
from nodes.link.spec import GenerateSpec, SpecError

STATS_EVERY_S = 1.0


def child_main(conn: Connection, config_data: dict[str, Any]) -> None:
    """Entry point of the worker process (spawned, so it starts clean of the agent's threads and loop)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the agent, which stops us in order
    config = EngineConfig.from_dict(config_data)
    os.environ.update({str(k): str(v) for k, v in config.env.items()})
    if config.cpu_affinity:
        os.sched_setaffinity(0, config.cpu_affinity)
    try:
        engine = create_engine(config, on_progress=_progress_sender(conn))
    except Exception as exc:  # any load failure goes back as a message, never as a silent exit
        conn.send(("load_error", str(exc) if isinstance(exc, EngineLoadError) else f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", engine.info()))
    try:
        _ChildLoop(conn, engine).run()
    except (EOFError, OSError):
        pass  # the agent went away: nothing left to serve
    finally:
        engine.close()


def _progress_sender(conn: Connection) -> Callable[[float], None]:
    last = [-1.0]

    def send(fraction: float) -> None:
        if fraction - last[0] >= 0.01 or fraction >= 1.0:
            last[0] = fraction
            conn.send(("progress", fraction))

    return send


class _ChildLoop:
    """Serves the pipe: steps while busy, blocks while idle, reports stats about once a second."""

    def __init__(self, conn: Connection, engine: Engine) -> None:
        self.conn = conn
        self.engine = engine
        self.last_stats_at = 0.0
        self.last_load: tuple[int, int] | None = None

    def run(self) -> None:
        while True:
            if self.engine.busy():
                while self.conn.poll():
                    if not self.handle(self.conn.recv()):
                        return
                events = self.engine.step()
            else:
                idle_work = getattr(self.engine, "idle_work", None)
                if idle_work is not None:
                    idle_work()
                if not self.handle(self.conn.recv()):
                    return
                events = []
            if events:
                self.conn.send(("events", events))
            self.report_stats()

    def handle(self, message: tuple) -> bool:
        kind = message[0]
        if kind == "submit":
            try:
                spec = GenerateSpec.from_dict(message[1])
            except (SpecError, TypeError) as exc:
                gen_id = str(message[1].get("gen_id", ""))
                self.conn.send(("events", [error_event(gen_id, ErrorCode.INVALID_REQUEST, str(exc))]))
                return True
            events = self.engine.submit(spec)
        elif kind == "cancel":
            events = self.engine.cancel(message[1])
        elif kind == "state_op":
            self.conn.send(("result", message[1], *self.state_op(message[2], message[3])))
            return True
        else:
            return kind != "stop"
        if events:
            self.conn.send(("events", events))
        return True

    def state_op(self, op: str, args: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        try:
            return True, self.engine.state_op(op, args)
        except StateOpError as exc:
            return False, {"code": exc.code, "message": exc.message}
        except Exception as exc:  # a failed state op answers the caller instead of killing the engine
            return False, {"code": ErrorCode.ENGINE_FAILED, "message": f"{type(exc).__name__}: {exc}"}

    def report_stats(self) -> None:
        stats = self.engine.stats()
        load = (stats["lanes_busy"], stats.get("queued", 0))
        now = time.monotonic()
        if load != self.last_load or (load[0] and now - self.last_stats_at >= STATS_EVERY_S):
            self.conn.send(("stats", stats))
            self.last_stats_at, self.last_load = now, load
