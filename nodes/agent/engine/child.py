"""The worker process's side: load the engine, then serve the pipe until told to stop or orphaned.

While any lane is busy the loop runs `step()` and drains the pipe without blocking between steps; when idle
it does housekeeping (parking lanes) and blocks on the pipe. Messages are plain tuples:
agent -> child: ("submit", spec_dict), ("cancel", gen_id), ("state_op", op_id, op, args), ("stop",) (a state op's
args and result may hold bytes: a KV payload, `kv_export` and `kv_import`);
child -> agent: ("progress", f), ("ready", info), ("load_error", text), ("events", [event]), ("stats", stats),
("result", op_id, ok, result).
With a speech model (`--transcribe`) a Transcriber lives here too: a spec with audio, or naming that model, goes to it,
and its thread sends its events through the same (locked) pipe.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from nodes.agent.engine.base import (
    Engine,
    EngineConfig,
    EngineLoadError,
    StateOpError,
    error_event,
)
from nodes.agent.engine.factory import create_engine
from nodes.link.codes import ErrorCode
from nodes.link.spec import GenerateSpec, SpecError

if TYPE_CHECKING:
    from nodes.agent.engine.speech import Transcriber

STATS_EVERY_S = 1.0


def child_main(conn: Connection, config_data: dict[str, Any]) -> None:
    """Entry point of the worker process (spawned, so it starts clean of the agent's threads and loop)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the agent, which stops us in order
    config = EngineConfig.from_dict(config_data)
    os.environ.update({str(k): str(v) for k, v in config.env.items()})
    if config.cpu_affinity:
        os.sched_setaffinity(0, config.cpu_affinity)
    pipe = _Pipe(conn)
    try:
        engine = create_engine(config, on_progress=_progress_sender(pipe))
        transcriber = _transcriber(config, pipe)
    except Exception as exc:  # any load failure goes back as a message, never as a silent exit
        pipe.send(("load_error", str(exc) if isinstance(exc, EngineLoadError) else f"{type(exc).__name__}: {exc}"))
        return
    pipe.send(("ready", _info(engine, transcriber)))
    try:
        _ChildLoop(pipe, engine, transcriber).run()
    except (EOFError, OSError):
        pass  # the agent went away: nothing left to serve
    finally:
        engine.close()
        if transcriber is not None:
            transcriber.close()


class _Pipe:
    """The child's end of the pipe, its sends locked: a transcription's thread sends events too."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock = conn, threading.Lock()
        self.poll, self.recv = conn.poll, conn.recv

    def send(self, message: tuple) -> None:
        with self.lock:
            self.conn.send(message)


def _transcriber(config: EngineConfig, pipe: _Pipe) -> Transcriber | None:
    if not config.speech_model_path:
        return None
    from nodes.agent.engine.speech import Transcriber

    return Transcriber(config.speech_model_path, config.speech_model_name,
                       lambda events: pipe.send(("events", events)), threads=config.threads)


def _info(engine: Engine, transcriber: Transcriber | None) -> dict[str, Any]:
    """The engine's info, plus the speech model and the `transcribe` capability when this worker has one."""
    info = engine.info()
    if transcriber is not None:
        # `speech_models`: the head never renames these to (or names another model after) a text model
        capabilities = {**info["capabilities"], "transcribe": True, "speech_models": [transcriber.name]}
        info = {**info, "speech_model": transcriber.name, "capabilities": capabilities}
    return info


def _progress_sender(conn: _Pipe) -> Callable[[float], None]:
    last = [-1.0]

    def send(fraction: float) -> None:
        if fraction - last[0] >= 0.01 or fraction >= 1.0:
            last[0] = fraction
            conn.send(("progress", fraction))

    return send


class _ChildLoop:
    """Serves the pipe: steps while busy, blocks while idle, reports stats about once a second."""

    def __init__(self, conn: _Pipe, engine: Engine, transcriber: Transcriber | None = None) -> None:
        self.conn = conn
        self.engine = engine
        self.transcriber = transcriber
        self.last_stats_at = 0.0
        self.last_load: tuple[int, int] | None = None
        self.last_rate = 0.0  # the tokens/s of the last report

    def run(self) -> None:
        self.report_stats()  # once loaded: an idle engine's heartbeat says its lanes, not 0 / 0, before any work
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
            events = self.submit(spec)
        elif kind == "cancel":
            if self.transcriber is not None:
                self.transcriber.cancel(message[1])
            events = self.engine.cancel(message[1])
        elif kind == "state_op":
            self.conn.send(("result", message[1], *self.state_op(message[2], message[3])))
            return True
        else:
            return kind != "stop"
        if events:
            self.conn.send(("events", events))
        return True

    def submit(self, spec: GenerateSpec) -> list:
        """A transcription (or a generation naming the speech model) to the transcriber, the rest to the engine."""
        speech = self.transcriber is not None and spec.model == self.transcriber.name
        if spec.audio is None and not speech:
            return self.engine.submit(spec)
        if self.transcriber is None:
            return [error_event(spec.gen_id, ErrorCode.INVALID_REQUEST, "this node has no speech model")]
        return self.transcriber.submit(spec)

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
        # Lanes that just started report 0 tokens/s; their first rate goes out at once, not a second later, since the
        # node's heartbeat may sample that report and the pages show it for a whole heartbeat.
        rate_came = bool(load[0] and stats.get("tokens_per_s") and not self.last_rate)
        if load != self.last_load or rate_came or (load[0] and now - self.last_stats_at >= STATS_EVERY_S):
            device = getattr(self.engine, "device", None)  # asked only when sent: not once a decode step
            if device is not None:
                stats["device"] = device()
            self.conn.send(("stats", stats))
            self.last_stats_at, self.last_load, self.last_rate = now, load, stats.get("tokens_per_s", 0.0)
