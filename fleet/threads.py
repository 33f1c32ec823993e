"""Django's HTTP handler for the head, with each request's thread-sensitive work on a pooled thread.

Django runs a request's synchronous parts (every `sync_to_async` call, and always `response.close()` once the last
byte is sent) on one thread of the request's own, so that they share its thread-local database connection. Its
ASGIHandler makes that thread new for every request, starts it on the event loop's thread and joins it there when
the request ends. Under many streams that is a thread started and joined for each request's `response.close()`
alone: starting one waits on the new thread, and the new thread takes the interpreter's lock from the loop.

Here a request borrows a one-thread executor from a pool and gives it back when Django's handler returns: the
same guarantee (one thread for the request's synchronous work, and no other request's work on it meanwhile) with
no thread started once the pool holds enough for the requests that overlap. A request that ended by an exception
or a cancellation may have left work on its thread; its executor is shut down (without waiting) rather than lent
again. At most POOL_SIZE idle executors are kept.

A request holds its executor from its start to its end, as Django's own context holds its thread's place, but here
the thread exists already: a head with 250 SSE streams open holds up to 250 + POOL_SIZE threads, each idle but for
its request's synchronous steps (Django's own started a request's thread at its first synchronous step: for an SSE
stream, at its end).

Django's last synchronous step, `response.close()`, runs in place on the event loop for a request that ran nothing
on its thread (an async view that reached the database only through other threads, as every /v1 stream does) and
whose response holds nothing to close (no file, no iterator with a `close`, no uploaded file parsed from the request;
the request's body stream is only marked closed). There it marks the response closed and sends `request_finished`,
whose receivers close the database connections they see where they run (on the event loop, Django keeps them per
context: the request's context there holds none, else the close goes to the thread as before), close the caches
(no-ops for Django's local-memory and Redis caches) and reset the URLconf. That saves each such request a thread
hop (what it measured: docs/benchmarks.md, *Scale*).
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from asgiref.sync import ThreadSensitiveContext
from django.core.handlers.asgi import ASGIHandler
from django.db import connections
from django.http import HttpRequest, HttpResponseBase

POOL_SIZE = 64
THREAD_PREFIX = "fleet-request"


def _closing_response(fn: Any) -> HttpResponseBase | None:
    """The response whose `close` `fn` calls, where `fn` is asgiref's call of `sync_to_async(response.close)()`
    (its thread handler, the bound close last among its arguments); None for anything else."""
    child = fn.args[-1] if isinstance(fn, functools.partial) and fn.args else None
    if not isinstance(child, functools.partial) or child.args or child.keywords:
        return None
    owner = getattr(child.func, "__self__", None)
    if isinstance(owner, HttpResponseBase) and getattr(child.func, "__name__", "") == "close":
        return owner
    return None


def _nothing_to_release(response: HttpResponseBase) -> bool:
    """Whether closing `response` releases nothing: its only closer is its request's own close (which Django adds to
    every response; it marks the body's stream closed), and that request parsed no uploaded files."""
    for closer in response._resource_closers:
        request = getattr(closer, "__self__", None)
        if not isinstance(request, HttpRequest) or getattr(closer, "__name__", "") != "close" or hasattr(
                request, "_files"):
            return False
    return True


class RequestExecutor(ThreadPoolExecutor):
    """One request's thread. The response's close runs in place when the request ran nothing here and the close
    has nothing to release (the module's docstring says why that is safe)."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix=THREAD_PREFIX)
        self.used = False  # whether the request now holding it ran anything on it

    def submit(self, fn, /, *args, **kwargs) -> Future:
        response = None if self.used or args or kwargs else _closing_response(fn)
        if response is not None and _nothing_to_release(response) and not connections.all(initialized_only=True):
            done: Future = Future()
            try:
                response.close()
            except BaseException as exc:  # as the thread would have: the caller's await raises it
                done.set_exception(exc)
            else:
                done.set_result(None)
            return done
        self.used = True
        return super().submit(fn, *args, **kwargs)


class ExecutorPool:
    """Idle one-thread executors, lent to one request at a time (used on the event loop's thread only)."""

    def __init__(self, size: int = POOL_SIZE) -> None:
        self.size = size
        self._idle: list[RequestExecutor] = []

    def borrow(self) -> RequestExecutor:
        executor = self._idle.pop() if self._idle else RequestExecutor()
        executor.used = False
        return executor

    def give_back(self, executor: RequestExecutor) -> None:
        if len(self._idle) < self.size:
            self._idle.append(executor)
        else:
            executor.shutdown(wait=False)

    def discard(self, executor: RequestExecutor) -> None:
        executor.shutdown(wait=False)

    def __len__(self) -> int:
        return len(self._idle)


class PooledThreadsHandler(ASGIHandler):
    """ASGIHandler whose requests run their synchronous parts on a pooled thread instead of a new one each."""

    def __init__(self, pool: ExecutorPool | None = None) -> None:
        super().__init__()
        self.pool = pool if pool is not None else ExecutorPool()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)  # Django's own refusal
        executor = self.pool.borrow()
        try:
            async with ThreadSensitiveContext(executor=executor):
                await self.handle(scope, receive, send)
        except BaseException:
            self.pool.discard(executor)
            raise
        self.pool.give_back(executor)
