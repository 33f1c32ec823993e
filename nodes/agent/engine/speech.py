"""Transcription in the engine worker process: a faster-whisper (CTranslate2) Whisper model beside the text engine.

Transcriptions run one at a time on a thread of their own (CTranslate2 releases the GIL), so the text lanes keep
stepping meanwhile. Each reports with a generation's events: accepted, one tokens event a segment (its text, token ids
and a `segments` entry with its times and words), then done or error. A cancel is seen between segments.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from nodes.agent.engine.base import (
    FINISH_CANCELLED,
    FINISH_STOP,
    EngineLoadError,
    Event,
    StateOpError,
    accepted_event,
    error_event,
)
from nodes.link.codes import ErrorCode
from nodes.link.messages import Done, TokenBatch
from nodes.link.spec import GenerateSpec

log = logging.getLogger("nodes.agent")

# What the node reads (PyAV decodes them); the head checks an upload against the same list (api.audio).
AUDIO_FORMATS = ("flac", "m4a", "mp3", "mp4", "mpeg", "mpga", "oga", "ogg", "wav", "webm")


class Transcriber:
    """The worker's speech model. `send(events)` may be called from its thread (the pipe's sender is locked)."""

    def __init__(self, path: str, name: str, send: Callable[[list[Event]], None], threads: int | None = None):
        try:
            self.model = _load(path, threads)
        except Exception as exc:  # a missing package, a folder that is no CTranslate2 model
            raise EngineLoadError(f"the speech model {name!r} could not be loaded from {path}: {exc}") from exc
        self.name, self.send = name, send
        self.jobs: queue.Queue[GenerateSpec | None] = queue.Queue()
        self.cancelled: set[str] = set()
        self.closing = False
        self.thread = threading.Thread(target=self._serve, name="transcriber", daemon=True)
        self.thread.start()

    def submit(self, spec: GenerateSpec) -> list[Event]:
        if spec.model != self.name:
            return [error_event(spec.gen_id, ErrorCode.INVALID_REQUEST, f"{spec.model!r} is no speech model; "
                                f"transcribe with model {self.name!r}")]
        if not spec.audio or not spec.audio.get("local_path"):
            return [error_event(spec.gen_id, ErrorCode.INVALID_REQUEST, f"{self.name!r} is a speech model: send "
                                "audio to /v1/audio/transcriptions")]
        self.jobs.put(spec)
        return []

    def cancel(self, gen_id: str) -> None:
        self.cancelled.add(gen_id)

    def close(self) -> None:
        """Stop after the running transcription's current segment, and wait for the thread to end: the process's exit
        tearing CTranslate2 down under a thread still running in it tripped ggml's crash handler, which printed a gdb
        backtrace of the worker (about 90 lines) at a stop after a transcription."""
        self.closing = True
        self.jobs.put(None)
        self.thread.join(30)

    def _serve(self) -> None:
        while (spec := self.jobs.get()) is not None and not self.closing:
            try:
                self._run(spec)
            except Exception as exc:  # one failed transcription answers its client; the model stays loaded
                log.exception("fleet node: transcription %s failed", spec.gen_id)
                self.send([error_event(spec.gen_id, ErrorCode.ENGINE_FAILED, f"{type(exc).__name__}: {exc}")])
            self.cancelled.discard(spec.gen_id)

    def _run(self, spec: GenerateSpec) -> None:
        started = time.monotonic()
        options = spec.transcribe or {}
        try:
            segments, info = self.model.transcribe(
                spec.audio["local_path"], language=options.get("language") or None, initial_prompt=spec.prompt or None,
                word_timestamps=bool(options.get("word_timestamps")), temperature=float(options.get("temperature", 0)),
            )
        except Exception as exc:  # PyAV could not decode it: the client's file, not the node
            self.send([error_event(spec.gen_id, ErrorCode.INVALID_REQUEST, "the audio could not be decoded "
                                   f"({exc}); send one of: {', '.join(AUDIO_FORMATS)}")])
            return
        self.send([accepted_event(spec.gen_id, 0, 0, 0)])
        # After a failover the head resumes with the text another node already streamed: the same model over the same
        # audio makes the same segments, so those are skipped, not sent twice.
        seq, tokens, reason, skip = 1, 0, FINISH_STOP, len(spec.resume_text)
        for segment in segments:
            if spec.gen_id in self.cancelled or self.closing:
                reason = FINISH_CANCELLED
                break
            if skip > 0:
                skip -= len(segment.text)
                continue
            self.send([_segment_event(spec.gen_id, seq, segment, info.language)])
            seq, tokens = seq + 1, tokens + len(segment.tokens)
        self.send([_done_event(spec.gen_id, seq, reason, tokens, info.duration, time.monotonic() - started)])


def _load(path: str, threads: int | None) -> Any:
    """The model on the GPU when CTranslate2 finds one it can use, else on the CPU (a GPU without CUDA's libraries
    fails to load there, and a node should still serve)."""
    from faster_whisper import WhisperModel

    try:
        return WhisperModel(path, device="auto", compute_type="auto", cpu_threads=threads or 0)
    except (RuntimeError, ValueError) as exc:
        log.warning("fleet node: the speech model could not load on the GPU (%s); loading it on the CPU", exc)
        return WhisperModel(path, device="cpu", compute_type="auto", cpu_threads=threads or 0)


def _segment_event(gen_id: str, seq: int, segment: Any, language: str) -> TokenBatch:
    words = [{"word": w.word, "start": round(float(w.start), 2), "end": round(float(w.end), 2)}
             for w in segment.words or []]
    entry = {"id": segment.id, "start": round(float(segment.start), 2), "end": round(float(segment.end), 2),
             "text": segment.text, "tokens": list(segment.tokens), "temperature": float(segment.temperature),
             "avg_logprob": float(segment.avg_logprob), "compression_ratio": float(segment.compression_ratio),
             "no_speech_prob": float(segment.no_speech_prob), "words": words, "language": language}
    return TokenBatch(gen_id=gen_id, seq=seq, text=[segment.text], ids=list(segment.tokens), logprobs=None,
                      segments=[entry])


def _done_event(gen_id: str, seq: int, reason: str, tokens: int, duration: float, took: float) -> Done:
    return Done(gen_id=gen_id, seq=seq, finish_reason=reason, usage={"prompt_tokens": 0, "completion_tokens": tokens},
                timings={"audio_s": round(float(duration), 3), "total_ms": round(took * 1000, 1)})


class SpeechOnlyEngine:
    """The text engine of a node that serves a speech model alone (`node_join --transcribe` without `--model`): it
    has no text model, so every generation reaches the worker's Transcriber (child.py) and this answers the rest."""

    def __init__(self, config: Any) -> None:
        self.name, self.lanes = config.speech_model_name, config.lanes

    def info(self) -> dict[str, Any]:
        from faster_whisper import __version__

        return {"model_name": self.name, "context_window": 0, "lanes": self.lanes, "capabilities": {},
                "engine": "faster-whisper", "engine_version": __version__}

    def submit(self, spec: GenerateSpec) -> list[Event]:
        return [error_event(spec.gen_id, ErrorCode.INVALID_REQUEST, f"this node serves only the speech model "
                            f"{self.name!r}: send audio to /v1/audio/transcriptions")]

    def cancel(self, gen_id: str) -> list[Event]:
        return []

    def step(self) -> list[Event]:
        return []

    def busy(self) -> bool:
        return False

    def stats(self) -> dict[str, Any]:
        return {"lanes_busy": 0, "lanes": self.lanes}

    def state_op(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        raise StateOpError(ErrorCode.UNKNOWN_OP, f"this node serves only the speech model {self.name!r}")

    def close(self) -> None:
        pass
