"""Generations prepared beside the decode loop, under a time limit.

A generation with a grammar is prepared (its prompt tokenized, its grammar compiled and its cost probed, see
nodes/agent/engine/sampling.py) on a thread of its own, so the lanes already decoding keep their steps: a grammar
the head's check let through (nodes.link.gbnf) and that llama.cpp still takes long over costs its own generation, not
the node's other lanes. One whose preparation takes longer than PREPARE_LIMIT_S is refused with `invalid_grammar`
(a 400 the head does not place again).

llama.cpp cannot interrupt a grammar's compile or a filter of the vocabulary: past the limit the engine stops
waiting, and the thread runs on until llama.cpp returns (the probe's chunks keep that short); its sampler is freed
then. ctypes lets go of the GIL inside llama.cpp, so the decode loop runs meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from nodes.agent.engine.base import EngineError
from nodes.agent.engine.runs import Run
from nodes.link.codes import ErrorCode
from nodes.link.spec import GenerateSpec

PREPARE_LIMIT_S = 5.0
WORKERS = 2


@dataclass
class Prepared:
    """A preparation that ended: its run, or why the generation is refused."""

    spec: GenerateSpec
    adapters: tuple
    outcome: Run | EngineError


@dataclass
class _Preparing:
    spec: GenerateSpec
    adapters: tuple
    future: Future
    started: float = field(default_factory=time.monotonic)


class Preparations:
    """The generations being prepared beside the decode loop; called from the engine's one thread only."""

    def __init__(self, release: Callable[[Run], None]) -> None:
        self._release = release
        self._pending: dict[str, _Preparing] = {}
        self._abandoned: list[Future] = []  # past the limit or cancelled: their runs are released when they end
        self._pool: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, gen_id: str) -> bool:
        return gen_id in self._pending

    def start(self, spec: GenerateSpec, adapters: tuple, prepare: Callable[[], Run]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="engine-prepare")
        self._pending[spec.gen_id] = _Preparing(spec, adapters, self._pool.submit(prepare))

    def adapter_sets(self) -> list[tuple]:
        """The LoRA adapter sets the generations being prepared will use."""
        return [p.adapters for p in self._pending.values()]

    def drop(self, gen_id: str) -> GenerateSpec | None:
        """Stop waiting for a generation's preparation (it was cancelled); its spec, or None when it is not here."""
        preparing = self._pending.pop(gen_id, None)
        if preparing is None:
            return None
        self._abandoned.append(preparing.future)
        return preparing.spec

    def ended(self, wait_s: float = 0.0) -> list[Prepared]:
        """The preparations that ended or ran past the limit, waiting up to `wait_s` for one to end."""
        self._sweep()
        if wait_s > 0 and self._pending:
            wait([p.future for p in self._pending.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
        now, ended = time.monotonic(), []
        for gen_id, preparing in list(self._pending.items()):
            if preparing.future.done():
                del self._pending[gen_id]
                ended.append(Prepared(preparing.spec, preparing.adapters, _outcome(preparing.future)))
            elif now - preparing.started > PREPARE_LIMIT_S:
                del self._pending[gen_id]
                self._abandoned.append(preparing.future)
                ended.append(Prepared(preparing.spec, preparing.adapters, EngineError(
                    ErrorCode.INVALID_GRAMMAR, f"the grammar took longer than this node's limit of {PREPARE_LIMIT_S:g} "
                    "s to compile and check; simplify it (fewer or smaller repetitions)")))
        return ended

    def close(self) -> None:
        """Wait for the threads (llama.cpp's calls must end before the model is freed) and release every run."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._abandoned += [p.future for p in self._pending.values()]
        self._pending = {}
        self._sweep()

    def _sweep(self) -> None:
        running = []
        for future in self._abandoned:
            if not future.done():
                running.append(future)
            elif future.exception() is None:
                self._release(future.result())
        self._abandoned = running


def _outcome(future: Future) -> Run | EngineError:
    """The run, or the EngineError the preparation raised; anything else is a bug and raises here, on the engine's
    thread, as it would have in the synchronous path."""
    try:
        return future.result()
    except EngineError as exc:
        return exc
