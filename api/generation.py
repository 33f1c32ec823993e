"""One generation served to one client, whatever the interface (JSON, SSE, websocket).

`Run` drives the dispatcher's stream: it hands out events with a timeout (so SSE can send keep-alives without
cancelling the stream), turns dispatcher errors into OpenAIError, cancels the node's lane when the client goes
away, and writes the durable record once, at the end, when it also settles the key's quota ticket (the tokens
the node spent, the stream slot).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from contextlib import suppress
from typing import Any

from django.conf import settings

from api import revocation
from api.errors import OpenAIError
from api.quotas import Ticket, tokens_spent
from api.specs import GenerationRequest
from api.thinking import ThinkingTokens, split_thinking
from fleet import metrics, tracing
from fleet.dispatch import Finished, GenerationError, Started, Tokens, generation_stream
from fleet.links import registry
from fleet.timers import wait_done
from fleet.waiting import Share
from nodes.link.logs import generation_context
from sessions import cuts
from sessions.models import Generation
from sessions.services import GenerationTrace, generation_record_async

log = logging.getLogger("api")

PENDING = object()  # next_event timed out; the stream goes on
_RECORDING: set[asyncio.Task] = set()  # the records being made: held here so that none is collected half-way
# How long an answer's end waits for its record (so the client's next read of it, or of its conversation, finds it);
# past that (the database away: the writer retries for FLEET_RECORD_RETRY_S) the answer ends and the record follows.
RECORD_WAIT_S = 5.0


def share_for(request: GenerationRequest) -> Share:
    """The request's key, class, weight and bound on waiting generations, for the waiting room."""
    key = request.api_key
    if key is None:
        return Share(priority=request.priority)
    bound = key.max_waiting if key.max_waiting is not None else settings.FLEET_MAX_WAITING_PER_KEY
    return Share(key=str(key.pk), label=key.prefix, priority=request.priority, weight=key.weight, max_waiting=bound)


def cache_key_for(request: GenerationRequest) -> str:
    """The request's prompt_cache_key, scoped to its API key: one key's name never steers another key's placement."""
    if not request.cache_key:
        return ""
    owner = str(request.api_key.pk) if request.api_key is not None else "-"
    return f"{owner}\x1f{request.cache_key}"


class Run:
    """Iterate with `next_event`; end with `abandon()` when the client leaves. Records itself exactly once."""

    def __init__(self, request: GenerationRequest, ticket: Ticket | None = None, trace: tracing.GenTrace | None = None):
        self.request = request
        self.ticket = ticket  # the key's quota: settled with the tokens spent when the generation ends
        if ticket is not None:
            ticket.owned = True
        # what another head writes as its record, should this process die before the end (sessions.cuts)
        key = request.api_key.pk if request.api_key is not None else None
        request.spec.record = cuts.record_for(gen_id=request.gen_id, kind=request.api or request.kind,
                                              model=request.spec.model, api_key=key, session=request.session_id,
                                              parameters=request.parameters())
        self.stream = generation_stream(request.spec, deadline=request.deadline, batch=request.batch,
                                        share=share_for(request), cache_key=cache_key_for(request))
        # its spans: those of the request that made it (the /v1 wrapper's, or `trace`), ended when it is recorded
        self.trace = tracing.generation_begin(self, trace)
        self._events = self.stream.__aiter__()
        self._next: asyncio.Future | None = None
        self.started: Started | None = None
        self.finished: Finished | None = None
        self.error: OpenAIError | None = None
        self.logprobs: list[dict[str, Any]] = []
        self.thinking = ThinkingTokens()  # a thinking model's thinking tokens (the Responses API's reasoning_tokens)
        self.seq = 0
        self.over = False
        self.recorded = False
        self._calls: Any = PENDING
        self._shutdown = registry().shutdown
        self._shutdown.track(self)  # a head that stops sees it to its end, and its record written
        self._watched = request.api_key is None

    @property
    def text(self) -> str:
        return self.stream.outcome.text

    @property
    def node(self) -> str:
        return (self.finished.node if self.finished else None) or (self.started.node if self.started else "") or ""

    async def next_event(self, timeout: float | None = None) -> Any:
        """The next Started / Tokens / Finished; PENDING after `timeout` s; None once over. Raises OpenAIError."""
        if not self._watched:  # on the loop that runs it (a sync view makes its Run before there is one)
            self._watched = True
            revocation.watch(self._shutdown)  # a key that stops ends its running generations (api.revocation)
        # The dispatcher's step runs in a task made here, so its log lines carry the generation's id too.
        with generation_context(self.request.gen_id):
            return await self._next_event(timeout)

    async def _next_event(self, timeout: float | None) -> Any:
        if self.over:
            return None
        if self._next is None and (timeout is None or self.stream.ready()):
            # Nothing to time out (no timeout, or the node's frame is here): step the stream in place, without a
            # task and a timer for each event.
            return await self._step(self._events.__anext__())
        if self._next is None:
            self._next = asyncio.ensure_future(self._events.__anext__())
        if not await wait_done(self._next, timeout):  # a timer shared with the other streams' waits
            return PENDING
        task, self._next = self._next, None
        return await self._step(task)

    async def _step(self, step: Awaitable[Any]) -> Any:
        """The stream's next event from `step` (its __anext__, or the task running it), ending the run when the
        stream ended or failed."""
        try:
            try:
                event = await step
            finally:
                # A task keeps the exception it raised, and the exception's traceback this frame: with the task
                # still here, every stream that ended in a task left a cycle for a full collection to find.
                del step
        except StopAsyncIteration:
            await self._end(Generation.Status.DONE)
            return None
        except GenerationError as exc:
            self.error = OpenAIError.from_generation(exc)
            expired = exc.code == "deadline_exceeded" and self.stream.outcome.first_token_at is None
            await self._end(Generation.Status.EXPIRED if expired else Generation.Status.FAILED, exc.message)
            raise self.error from None
        except Exception as exc:
            log.exception("api: generation %s failed", self.request.gen_id)
            self.error = OpenAIError(500, "The generation failed inside the head; it has been logged. Retry.",
                                     code="internal_error")
            await self._end(Generation.Status.FAILED, repr(exc))
            raise self.error from None
        return self._observe(event)

    def _observe(self, event: Any) -> Any:
        if isinstance(event, Started):
            self.started = event
        elif isinstance(event, Tokens):
            self.seq += 1
            self.thinking.feed(event.pieces)
            if event.logprobs:
                pieces = event.pieces + [""] * (len(event.logprobs) - len(event.pieces))
                self.logprobs.extend({"token": p, **(e or {})} for p, e in zip(pieces, event.logprobs, strict=False))
        elif isinstance(event, Finished):
            self.finished = event
        return event

    async def events(self):
        """Every event until the end (for interfaces that need no keep-alive)."""
        while (event := await self.next_event()) is not None:
            yield event

    async def stop(self, code: str, message: str, *, status: int = 503, retry_after: int | None = 2,
                   kind: str = "server_error") -> None:
        """The head ends it (its drain; its key revoked): the node's lane is cancelled and the client's stream ends
        with its API's error event (before the headers went out, a `status` with Retry-After); recorded as failed."""
        if not self.over:
            with generation_context(self.request.gen_id):
                await self.stream.stop(GenerationError(code, message, status=status, retry_after=retry_after,
                                                       kind=kind))

    async def abandon(self, reason: str = "client went away") -> None:
        """The client is gone (or cancelled): stop the node's lane now, and record what was made."""
        with generation_context(self.request.gen_id):
            await self._abandon(reason)

    async def _abandon(self, reason: str) -> None:
        if self.over:
            return
        self.over = True
        with suppress(Exception):
            await self.stream.cancel(reason)
        if self._next is not None and not self._next.done():
            self._next.cancel()
            with suppress(BaseException):
                await self._next
        with suppress(BaseException):
            await self._events.aclose()
        await self._record(Generation.Status.CANCELLED, reason)

    async def _end(self, status: str, error: str = "") -> None:
        self.over = True
        with suppress(Exception):
            await self._events.aclose()
        if status == Generation.Status.DONE and self.finished and self.finished.finish_reason == "cancelled":
            status = Generation.Status.CANCELLED
        await self._record(status, error)

    async def _record(self, status: str, error: str = "") -> None:
        if self.recorded:
            return
        self.recorded = True
        # A client may leave as its answer ends (a socket closed right after its `done` cancels the consumer's task):
        # the quota's settlement, the metrics and the record are made all the same, in a task a cancel cannot reach.
        task = asyncio.ensure_future(self._settle_and_record(status, error))
        _RECORDING.add(task)
        task.add_done_callback(_RECORDING.discard)
        try:
            await asyncio.wait_for(asyncio.shield(task), RECORD_WAIT_S)
        except TimeoutError:  # the client has its answer; a stopping head still waits for the record (shutdown)
            log.warning("api: generation %s: its record waits for the database; the answer ends without it",
                        self.request.gen_id)

    async def _settle_and_record(self, status: str, error: str) -> None:
        request = self.request
        outcome = self.stream.outcome
        if self.ticket is not None:
            await self.ticket.settle(tokens_spent(outcome.prompt_tokens, outcome.cached_tokens,
                                                  outcome.completion_tokens))
        if self.finished is None and not outcome.finish_reason:
            outcome.finish_reason = "cancelled" if status == Generation.Status.CANCELLED else ""
        trace = GenerationTrace(
            gen_id=request.gen_id, kind=request.api or request.kind, model=request.spec.model, status=status,
            outcome=outcome, parameters=request.parameters(), error=error, session_id=request.session_id,
            api_key_id=request.api_key.pk if request.api_key is not None else None,
            new_messages=request.new_messages + [self.answer_message()] if request.session_id else [],
            finished_at=time.time(),
        )
        code = self.error.code if self.error is not None else ""
        label = await metrics.amodel_label(trace.model)  # a made-up name is counted as "other"
        metrics.generation_ended(model=label, status=status, code=code, outcome=outcome,
                                 finished_at=trace.finished_at, api=trace.kind)
        tracing.generation_end(self.trace, outcome, status, code, error)
        log.info("api: generation %s %s on %s: %d prompt tokens (%d cached), %d completion tokens%s", request.gen_id,
                 status, outcome.node or "no node", outcome.prompt_tokens, outcome.cached_tokens,
                 outcome.completion_tokens, f" ({code})" if code else "")
        try:
            await generation_record_async(trace)
        except Exception:  # the client got its answer; a lost record is logged, not turned into an error
            log.exception("api: could not record generation %s", request.gen_id)
        finally:
            self._shutdown.untrack(self)

    # --- the answer ---
    def tool_calls(self) -> list[dict[str, Any]] | None:
        """The calls the answer makes, parsed once: each parse names its calls afresh, and the answer, its stream's
        last events and the stored conversation must all name them alike."""
        plan = self.request.tools
        if plan is None or self.finished is None:
            return None
        if self._calls is PENDING:
            self._calls = plan.parse(split_thinking(self.text)[1])  # a thinking model's calls follow its thinking
        return self._calls

    def answer_message(self) -> dict[str, Any]:
        calls = self.tool_calls()
        if calls:
            return {"role": "assistant", "content": None, "tool_calls": calls}
        return {"role": "assistant", "content": self.text}

    def finish_reason(self) -> str:
        """OpenAI's finish_reason: a node's "deadline" cut is a "length" cut; a parsed call is "tool_calls"."""
        if self.tool_calls():
            return "tool_calls"
        reason = self.finished.finish_reason if self.finished else "stop"
        return {"deadline": "length", "cancelled": "stop"}.get(reason, reason)

    def usage(self) -> dict[str, Any]:
        """The node's usage once it finished; before that (a cancel, a stop), what was read and streamed so far, as
        the record has it."""
        outcome = self.stream.outcome
        usage = dict(self.finished.usage) if self.finished else {
            "prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "cached_tokens": outcome.cached_tokens}
        prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": usage.get("total_tokens", prompt + completion),
            "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
        }
