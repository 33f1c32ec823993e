"""Lanes, prefix reuse and the step loop shared by the llama.cpp engine and the mock.

A subclass supplies the model: `_prepare` (tokenize, validate, build the sampler), `_trim_lane` (drop a
lane's KV from a position on), `_copy_lane` (give a lane another lane's KV), `_decode` (read one batch of work,
sample where asked), `_piece` and `_is_eog`. Everything else — admission, lane choice, prefix copies,
cached-token accounting, evictions, stop strings, deadlines, cancel, flushing and stats — lives here, so both
engines behave the same.

Prefix copies: a prompt's longest cached prefix may sit in a lane that is busy, or that holds another
conversation worth keeping (a shared system prompt followed by someone's history). Rather than read that
prefix again, or throw the other conversation away, admission copies the prefix into the lane it picks
(llama.cpp's `seq_cp`), so a node that holds a prefix in any lane can serve it from every lane, which is
what the head's placement index assumes.

Busy lanes side by side: each lane is a KV stream of its own, and llama.cpp reads in one pass (one ubatch) only
sequences whose ids follow one another (`split_equal`, sequential); generations on lanes 0,1,5,6 cost two passes
of the weights a step, 1.4-1.5x the step time of lanes 0-3 (bench/server_settings.py). So admission puts a
generation next to the busy lanes: the cache it reuses is chosen as above, and when that cache sits in a lane
that would open a gap, the two free lanes swap caches first (`_swap_lanes`), so no cached conversation is lost.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nodes.agent.engine.adapters import AdapterKey, adapter_key
from nodes.agent.engine.base import (
    FINISH_CANCELLED,
    FINISH_DEADLINE,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineConfig,
    EngineError,
    Event,
    accepted_event,
    error_event,
)
from nodes.agent.engine.beside import Preparations
from nodes.agent.engine.pace import Pace
from nodes.agent.engine.runs import Run, clock
from nodes.link.codes import ErrorCode
from nodes.link.spec import GenerateSpec
from nodes.link.thinking import THINK_END

PREPARE_WAIT_S = 0.02  # how long an idle step waits for a preparation to end

# A sampled token id and its logprob entry, or the error that stopped that lane's generation.
Sample = tuple[int, dict[str, Any] | None] | EngineError


@dataclass
class Lane:
    """One llama sequence id: the tokens its KV cache holds and the generation using it, if any."""

    index: int
    tokens: list[int] = field(default_factory=list)  # KV contents, position order
    run: Run | None = None
    holders: list[tuple[str, int]] = field(default_factory=list)  # (gen_id, prompt length) cached here
    last_used: float = 0.0
    adapters: AdapterKey = ()  # the LoRA adapter set its KV was computed under


@dataclass
class Work:
    """What one lane reads in a step: `tokens` at positions `pos`..; `sample` asks for the next token."""

    lane: Lane
    tokens: list[int]
    pos: int
    sample: bool


# A prefix copy costs a KV buffer copy; below this many tokens it is cheaper to read them again.
COPY_MIN_TOKENS = 32


@dataclass
class LanePick:
    """Where a queued generation goes: its lane, the tokens it keeps cached, how many of them match the lane's
    own cache, and the lane they are copied from (None: the lane's own cache)."""

    lane: Lane
    keep: int
    common: int
    source: Lane | None = None
    moved_from: Lane | None = None  # a free lane whose cache moves into `lane` first, to keep busy lanes together


def gaps(busy: set[int]) -> int:
    """How many runs of consecutive lane indices `busy` makes (one pass of the weights each, per step)."""
    return sum(1 for i in busy if i - 1 not in busy)


def lora_asked(spec: GenerateSpec, names: set[str]) -> list[list]:
    """The request's `lora` pairs, and the adapter its model name picks (MODEL:ADAPTER, at scale 1), of `names`."""
    named = spec.model.rpartition(":")[2] if ":" in spec.model else ""
    if named in names and all(name != named for name, _ in spec.lora):
        return [*spec.lora, [named, 1.0]]
    return spec.lora


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case on a warm lane: one C-level comparison
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class LaneEngine(ABC):
    """The engine skeleton: FIFO admission into lanes, one batched `_decode` per `step`."""

    engine_name = "base"

    def __init__(self, config: EngineConfig, window: int, n_batch: int) -> None:
        if n_batch < config.lanes:
            raise ValueError(f"n_batch ({n_batch}) must be at least the number of lanes ({config.lanes})")
        self.config = config
        self.window = window
        self.n_batch = n_batch
        self.lanes = [Lane(i) for i in range(config.lanes)]
        self.queue: deque[Run] = deque()
        self._rate: deque[tuple[float, int]] = deque()
        self.prefix_copies = 0
        self.lane_swaps = 0
        self._copy_sources: set[int] = set()  # lanes a copy queued since the last decode reads from
        self._lost: list[str] = []  # holders of caches a failed swap dropped, told to the head with the next accept
        self.pace = Pace()  # its prefill rate and decode slowdown, from the steps' own timings
        self._step_adapters: AdapterKey = ()  # the adapter set of the last step, when sets take turns
        self.preparing = Preparations(self._release_run)

    # -- what a model supplies ------------------------------------------------------------------------

    @abstractmethod
    def _prepare(self, spec: GenerateSpec, submitted_at: float) -> Run:
        """Tokenize and validate `spec`, build its sampler; raise EngineError for bad input."""

    @abstractmethod
    def _trim_lane(self, lane: Lane, keep: int) -> None:
        """Drop the lane's KV from position `keep` on (`lane.tokens` is cut by the caller)."""

    @abstractmethod
    def _copy_lane(self, source: Lane, lane: Lane, keep: int) -> None:
        """Make `lane`'s KV hold `source`'s first `keep` tokens (`lane.tokens` is set by the caller)."""

    @abstractmethod
    def _swap_lanes(self, a: Lane, b: Lane) -> bool:
        """Exchange the KV of two idle lanes (the caller swaps their fields). False: it failed and both
        lanes' KV is gone."""

    @abstractmethod
    def _decode(self, works: list[Work]) -> dict[int, Sample]:
        """Read every work item in one batch; return {lane index: sample} for items with `sample`."""

    @abstractmethod
    def _piece(self, token_id: int) -> bytes: ...

    @abstractmethod
    def _is_eog(self, token_id: int) -> bool: ...

    def _prepares_beside(self, spec: GenerateSpec) -> bool:
        """Whether `_prepare` runs on a thread beside the step loop (nodes.agent.engine.beside): the llama engine's
        generations with a grammar, whose compile and cost probe may take long."""
        return False

    def _new_run(self, spec: GenerateSpec, tokens: list[int], submitted_at: float, sampler: Any) -> Run:
        """A run with this engine's flush policy; `_prepare` implementations end with it."""
        return Run(spec=spec, tokens=tokens, submitted_at=submitted_at, flush_tokens=self.config.flush_tokens,
                   flush_s=self.config.flush_ms / 1000, sampler=sampler)

    def _release_run(self, run: Run) -> None:  # noqa: B027 - optional hook
        """Free per-generation resources (the sampler)."""

    def _lane_idle(self, lane: Lane) -> None:  # noqa: B027 - optional hook
        """A lane just went idle (the llama engine marks it for parking here)."""

    def idle_work(self) -> None:  # noqa: B027 - optional hook
        """Housekeeping the worker runs when no lane is busy (the llama engine parks lanes to disk)."""

    def _chunk_end(self, run: Run, start: int, budget: int) -> int:
        """Where a prompt chunk that starts at `start` ends, given `budget` tokens of room (the llama engine keeps an
        image's tokens in a chunk of their own)."""
        return start + budget

    def _forced(self, run: Run, text: str, room: int) -> list[int]:
        """`text`'s tokens fed to `run`'s sampler as if sampled, when at most `room` (else none): a thinking budget's
        end (Run.end_thinking). An engine without this never forces one."""
        return []

    def adapter_names(self) -> set[str]:
        """The LoRA adapters a request may name here."""
        return set(self.config.adapters)

    # -- the Engine interface -------------------------------------------------------------------------

    def submit(self, spec: GenerateSpec) -> list[Event]:
        if self._find(spec.gen_id) is not None or spec.gen_id in self.preparing:
            return [error_event(spec.gen_id, ErrorCode.INVALID_REQUEST, f"generation {spec.gen_id} is already running")]
        if spec.batch_invariant and not self.config.batch_invariant:
            # the head places such requests only on batch-invariant nodes; never serve one without the guarantee
            return [error_event(spec.gen_id, ErrorCode.INVALID_REQUEST, "this node is not batch-invariant (it was not "
                                "started with node_join --batch-invariant)")]
        submitted_at = clock()
        try:
            adapters = adapter_key(lora_asked(spec, self.adapter_names()), self.adapter_names())
            if self._prepares_beside(spec):
                self.preparing.start(spec, adapters, lambda: self._prepare(spec, submitted_at))
                return []
            run = self._prepare(spec, submitted_at)
        except EngineError as exc:
            return [error_event(spec.gen_id, exc.code, exc.message, exc.retryable)]
        return self._enqueue(run, adapters)

    def _enqueue(self, run: Run, adapters: AdapterKey) -> list[Event]:
        """A prepared run joins the queue (unless its deadline passed meanwhile) and lanes are handed out."""
        run.adapters = adapters
        if run.spec.deadline is not None and time.time() >= run.spec.deadline:
            self._release_run(run)
            return [run.done_event(FINISH_DEADLINE, clock())]
        self.queue.append(run)
        return self._admit()

    def cancel(self, gen_id: str) -> list[Event]:
        spec = self.preparing.drop(gen_id)
        if spec is not None:  # its preparation's run, when it comes, is released
            return [Run(spec=spec, tokens=[], submitted_at=clock()).done_event(FINISH_CANCELLED, clock())]
        for run in self.queue:
            if run.gen_id == gen_id:
                self.queue.remove(run)
                self._release_run(run)
                return [run.done_event(FINISH_CANCELLED, clock())]
        for lane in self.lanes:
            if lane.run is not None and lane.run.gen_id == gen_id:
                return self._finish(lane, FINISH_CANCELLED, clock())
        return []

    def busy(self) -> bool:
        return bool(self.queue) or bool(self.preparing) or any(lane.run is not None for lane in self.lanes)

    def stats(self) -> dict[str, Any]:
        now = clock()
        while self._rate and now - self._rate[0][0] > 2.0:
            self._rate.popleft()
        span = now - self._rate[0][0] if len(self._rate) > 1 else 0.0
        produced = sum(n for _, n in list(self._rate)[1:])
        return {
            "lanes_busy": sum(1 for lane in self.lanes if lane.run is not None),
            "lanes": len(self.lanes),
            "queued": len(self.queue) + len(self.preparing),
            "kv_used": sum(len(lane.tokens) for lane in self.lanes),
            "kv_total": self.window * len(self.lanes),
            "prefix_copies": self.prefix_copies,
            "lane_swaps": self.lane_swaps,
            "tokens_per_s": round(produced / span, 2) if span > 0 else 0.0,
            "prefill_tps": self.pace.prefill_tps(),
            "decode_slowdown_ms": self.pace.decode_slowdown_ms(),
        }

    def step(self) -> list[Event]:
        """One decode step: every busy lane's prompt chunk or next token, read in one batch."""
        events = self._prepared() + self._expire()
        works = self._plan()
        if works:
            prefill = sum(len(w.tokens) for w in works if len(w.lane.tokens) < len(w.lane.run.tokens))
            started = clock()
            try:
                samples = self._decode(works)
            except EngineError as exc:
                return events + self._fail_batch(works, exc)
            finally:
                self._copy_sources.clear()  # llama.cpp made the queued copies at the start of that decode
            ended = clock()
            self.pace.step(sum(1 for w in works if len(w.lane.tokens) >= len(w.lane.run.tokens)), prefill,
                           ended - started)
            events += self._absorb(works, samples, started, ended)
        now = clock()
        for lane in self.lanes:
            if lane.run is not None:
                batch = lane.run.take_batch(now)
                if batch is not None:
                    events.append(batch)
        return events + self._admit()

    # -- internals ------------------------------------------------------------------------------------

    def _prepared(self) -> list[Event]:
        """The generations prepared beside the loop since the last step, queued or refused. With no lane decoding
        the step waits a little for one, rather than spin."""
        idle = not self.queue and all(lane.run is None for lane in self.lanes)
        events: list[Event] = []
        for prepared in self.preparing.ended(wait_s=PREPARE_WAIT_S if idle else 0.0):
            if isinstance(prepared.outcome, EngineError):
                exc = prepared.outcome
                events.append(error_event(prepared.spec.gen_id, exc.code, exc.message, exc.retryable))
            else:
                events += self._enqueue(prepared.outcome, prepared.adapters)
        return events

    def _find(self, gen_id: str) -> Run | None:
        for run in self.queue:
            if run.gen_id == gen_id:
                return run
        for lane in self.lanes:
            if lane.run is not None and lane.run.gen_id == gen_id:
                return lane.run
        return None

    def _pick_lane(self, tokens: list[int], adapters: AdapterKey = ()) -> LanePick | None:
        """The free lane where `tokens` cost least: most tokens reused less tokens of the lane's cache thrown away.

        Tokens reused are the lane's own common prefix with the prompt or, when some other lane (busy or not)
        holds at least COPY_MIN_TOKENS more of it, that lane's, copied over. So a prefix held anywhere on the
        node is reused from every lane, the choice among free lanes comes down to what each would discard, and
        a token or two in common never throws away another conversation's cache while an empty lane is free.
        Equal scores go to the lane that discards least, then to one that needs no copy, then to the least
        recently used. At least the last prompt token is always read again: its logits give the first sample.
        Only lanes computed under the same LoRA adapter set hold anything the prompt can reuse."""
        commons = [common_prefix(lane.tokens, tokens) if lane.adapters == adapters else 0 for lane in self.lanes]
        shared = max(commons)
        source = self.lanes[commons.index(shared)] if shared else None
        best: tuple[tuple[int, int, bool, float], LanePick] | None = None
        for lane, common in zip(self.lanes, commons, strict=True):
            if lane.run is not None:
                continue
            pick = LanePick(lane, min(common, len(tokens) - 1), common)
            if source is not None and source is not lane and shared >= common + COPY_MIN_TOKENS:
                pick = LanePick(lane, min(shared, len(tokens) - 1), common, source)
            discarded = len(lane.tokens) - common  # tokens of the lane's cache the new prompt does not hold
            key = (pick.keep - discarded, -discarded, pick.source is None, -lane.last_used)
            if best is None or key > best[0]:
                best = (key, pick)
        if best is None:
            return None
        pick = best[1]
        target = self._beside_busy(pick.lane)
        if target is not None:
            # the two swap caches: `target` gets the chosen one, so a copy source that was `target` is now there
            pick.moved_from, pick.lane = pick.lane, target
            if pick.source is target:
                pick.source = pick.moved_from
        return pick

    def _beside_busy(self, lane: Lane) -> Lane | None:
        """The free lane to move `lane`'s cache into so the busy lanes stay in as few runs as they can, or None
        when `lane` already does. Among such lanes the emptiest, then the least recently used, gives up its
        place; lanes a queued copy still reads from stay where they are."""
        busy = {other.index for other in self.lanes if other.run is not None}
        if not busy or lane.index in self._copy_sources:
            return None
        free = [other for other in self.lanes if other.run is None and other.index not in self._copy_sources]
        if not free:
            return None
        fewest = min(gaps(busy | {other.index}) for other in free)
        if gaps(busy | {lane.index}) <= fewest:
            return None
        return min((other for other in free if gaps(busy | {other.index}) == fewest),
                   key=lambda other: (len(other.tokens), other.last_used))

    def _move_cache(self, source: Lane, lane: Lane) -> bool:
        """Swap two idle lanes' caches and what the scheduler knows of them. False: the swap failed, both lanes
        start empty, and their holders go to the head as evicted with the next accepted generation."""
        moving = bool(source.tokens or lane.tokens)
        ok = not moving or self._swap_lanes(source, lane)
        if ok:
            for name in ("tokens", "holders", "adapters", "last_used"):
                mine, theirs = getattr(lane, name), getattr(source, name)
                setattr(lane, name, theirs)
                setattr(source, name, mine)
            self.lane_swaps += moving
        else:
            for emptied in (source, lane):
                self._lost += [gen_id for gen_id, _ in emptied.holders]
                emptied.tokens, emptied.holders, emptied.adapters = [], [], ()
        self._lane_idle(source)
        self._lane_idle(lane)
        return ok

    def _admit(self) -> list[Event]:
        events: list[Event] = []
        while self.queue:
            pick = self._pick_lane(self.queue[0].tokens, self.queue[0].adapters)
            if pick is None:
                break
            lane, keep, common = pick.lane, pick.keep, pick.common
            if pick.moved_from is not None and not self._move_cache(pick.moved_from, lane):
                continue  # both lanes are empty now: choose again
            run = self.queue.popleft()
            if pick.source is not None:
                self._copy_lane(pick.source, lane, keep)
                lane.tokens = pick.source.tokens[:keep]
                self._copy_sources.add(pick.source.index)
                self.prefix_copies += 1
            elif keep < len(lane.tokens):
                self._trim_lane(lane, keep)
                del lane.tokens[keep:]
            # A holder whose prompt lies within `common` keeps it: this generation reads those tokens back.
            run.evicted = self._lost + [gen_id for gen_id, n in lane.holders if n > common]
            self._lost = []
            lane.holders = [(gen_id, n) for gen_id, n in lane.holders if n <= common and gen_id != run.gen_id]
            lane.holders.append((run.gen_id, len(run.tokens)))
            run.lane, run.cached_tokens = lane.index, keep
            lane.run, lane.adapters = run, run.adapters
            events.append(accepted_event(run.gen_id, run.prompt_tokens, keep, lane.index, run.evicted))
        return events

    def _expire(self) -> list[Event]:
        events: list[Event] = []
        wall = time.time()
        for lane in self.lanes:
            run = lane.run
            if run is not None and run.spec.deadline is not None and wall >= run.spec.deadline:
                events += self._finish(lane, FINISH_DEADLINE, clock())
        return events

    def _plan(self) -> list[Work]:
        """Decode tokens first (one per lane, so decoding never stalls behind a long prompt), then
        prompt chunks in arrival order while the batch has room. Only lanes of one LoRA adapter set share a step."""
        works: list[Work] = []
        prefills: list[Lane] = []
        adapters = self._next_adapters()
        for lane in self.lanes:
            run = lane.run
            if run is None or run.adapters != adapters:
                continue
            if len(lane.tokens) < len(run.tokens):
                prefills.append(lane)
            elif run.next_token is not None:
                works.append(Work(lane, [run.next_token, *run.take_forced()], len(lane.tokens), True))
        budget = self.n_batch - sum(len(work.tokens) for work in works)
        for lane in sorted(prefills, key=lambda item: item.run.submitted_at if item.run else 0.0):
            if budget <= 0:
                break
            run = lane.run
            assert run is not None
            start = len(lane.tokens)
            chunk = run.tokens[start : self._chunk_end(run, start, budget)]
            works.append(Work(lane, chunk, start, start + len(chunk) == len(run.tokens)))
            budget -= len(chunk)
        return works

    def _next_adapters(self) -> AdapterKey:
        """The adapter set this step runs: the only one in use, else the next in turn after the last step's."""
        sets = sorted({lane.run.adapters for lane in self.lanes if lane.run is not None})
        if len(sets) > 1:
            later = [key for key in sets if key > self._step_adapters]
            self._step_adapters = later[0] if later else sets[0]
        elif sets:
            self._step_adapters = sets[0]
        return self._step_adapters

    def _absorb(self, works: list[Work], samples: dict[int, Sample], started: float, now: float) -> list[Event]:
        events: list[Event] = []
        produced = 0
        for work in works:
            lane, run = work.lane, work.lane.run
            assert run is not None
            lane.tokens.extend(work.tokens)
            if run.prefill_started_at is None:
                run.prefill_started_at = started
            if work.sample:
                sample = samples[lane.index]
                if isinstance(sample, EngineError):
                    events += self._abort(lane, sample, now)
                    continue
                produced += 1
                events += self._take(lane, run, *sample, now)
        self._rate.append((now, produced))
        return events

    def _take(self, lane: Lane, run: Run, token_id: int, logprob: dict[str, Any] | None, now: float) -> list[Event]:
        """Account one sampled token and finish the generation when it ends here."""
        if self._is_eog(token_id):
            return self._finish(lane, FINISH_STOP, now)
        run.next_token = token_id
        if run.add_token(token_id, self._piece(token_id), logprob, now) or (run.thinking_due() and run.end_thinking(
                self._forced(run, THINK_END, self.window - len(lane.tokens) - 1), self._piece, now)):
            return self._finish(lane, FINISH_STOP, now)
        # The next token would be read at position len(lane.tokens): it must fit the lane's window.
        if run.completion_tokens >= run.spec.max_tokens or len(lane.tokens) >= self.window:
            return self._finish(lane, FINISH_LENGTH, now)
        return []

    def _finish(self, lane: Lane, reason: str, now: float) -> list[Event]:
        return self._end(lane, now, lambda run: run.done_event(reason, now))

    def _abort(self, lane: Lane, exc: EngineError, now: float) -> list[Event]:
        """One lane's generation failed (its sampler refused): stream what it had, then the error."""
        return self._end(lane, now, lambda run: error_event(run.gen_id, exc.code, exc.message, exc.retryable))

    def _end(self, lane: Lane, now: float, final: Callable[[Run], Event]) -> list[Event]:
        """Flush what the lane's generation still holds, close it with `final` and free the lane."""
        run = lane.run
        assert run is not None
        run.release_all(now)
        run.finished = True
        batch = run.take_batch(now, force=True)
        events = [batch] if batch is not None else []
        events.append(final(run))  # after the flush: `done` carries the next seq
        lane.run = None
        lane.last_used = now
        self._release_run(run)
        self._lane_idle(lane)
        return events

    def _fail_batch(self, works: list[Work], exc: EngineError) -> list[Event]:
        """A decode the model refused: stop every generation in it and forget those lanes' caches."""
        events: list[Event] = []
        for work in works:
            lane, run = work.lane, work.lane.run
            assert run is not None
            events.append(error_event(run.gen_id, ErrorCode.ENGINE_FAILED, exc.message, retryable=True))
            lane.run = None
            self._release_run(run)
            self._trim_lane(lane, 0)
            lane.tokens = []
            lane.holders = []
        return events
