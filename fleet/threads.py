"""Django's HTTP handler for the head, with each request's thread-sensitive work on a pooled thread.

Django runs a request's synchronous parts (every `sync_to_async` call, and always `response.close()` once the last
byte is sent) on one thread of the request's own, so that they share its thread-local database connection. Its
ASGIHandler makes that thread new for every request, starts it on the event loop's thread and joins it there when
the request ends. At 500 streams (`bench/scale.py`) that was a thread started and joined 85 times a second for
`response.close()` alone: starting one waits on the new thread, and the new thread takes the interpreter's lock
from the loop.

Here a request borrows a one-thread executor from a pool and gives it back when Django's handler returns: the
same guarantee (one thread for the request's synchronous work, and no other request's work on it meanwhile) with
no thread started once the pool holds enough for the requests that overlap. A request that ended by an exception
or a cancellation may have left work on its thread; its executor is shut down (without waiting) rather than lent
again. At most POOL_SIZE idle executors are kept.

A request holds its executor from its start to its end, as Django's own context holds its thread's place, but here
the thread exists already: a head with 250 SSE streams open holds up to 250 + POOL_SIZE threads, each idle but for
its request's synchronous steps (Django's own started a request's thread at its first synchronous step: for an SSE
stream, at its end).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import ThreadSensitiveContext
from django.core.handlers.asgi import ASGIHandler

POOL_SIZE = 64
THREAD_PREFIX = "fleet-request"


class ExecutorPool:
    """Idle one-thread executors, lent to one request at a time (used on the event loop's thread only)."""

    def __init__(self, size: int = POOL_SIZE) -> None:
        self.size = size
        self._idle: list[ThreadPoolExecutor] = []

    def borrow(self) -> ThreadPoolExecutor:
        return self._idle.pop() if self._idle else ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_PREFIX)

    def give_back(self, executor: ThreadPoolExecutor) -> None:
        if len(self._idle) < self.size:
            self._idle.append(executor)
        else:
            executor.shutdown(wait=False)

    def discard(self, executor: ThreadPoolExecutor) -> None:
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
