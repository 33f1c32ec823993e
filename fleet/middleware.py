"""Django's stock middleware whose hooks do no I/O, run inline on the event loop.

Under ASGI, Django's `MiddlewareMixin` runs each hook (`process_request`, `process_response`) through
`sync_to_async`: a hop to a worker thread and back for each, about ten per request with the stock list. These
classes' hooks only read and set headers, cookies and attributes in memory (no database, no session load: the CSRF
secret is in a cookie here, and the user is loaded lazily, when a view asks), so they run in place. Each class is
its stock namesake otherwise (settings.MIDDLEWARE lists them; Django's checks see the subclasses). Session and
messages middleware may write the session store when a response goes out, so they keep their thread hops; and
the security middleware runs in WhiteNoise's thread anyway (WhiteNoise is sync-only, so Django runs the middleware
outside it in that thread).
docs/benchmarks.md ("Scale") has what it saved.
"""

from __future__ import annotations

from django.contrib.auth import middleware as auth
from django.middleware import clickjacking, common, csrf


class InlineHooks:
    """`__acall__` calling the middleware's own hooks directly instead of through `sync_to_async`."""

    async def __acall__(self, request):
        response = None
        if hasattr(self, "process_request"):
            response = self.process_request(request)
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            response = self.process_response(request, response)
        return response


class CommonMiddleware(InlineHooks, common.CommonMiddleware):
    pass


class CsrfViewMiddleware(InlineHooks, csrf.CsrfViewMiddleware):
    pass


class AuthenticationMiddleware(InlineHooks, auth.AuthenticationMiddleware):
    pass


class XFrameOptionsMiddleware(InlineHooks, clickjacking.XFrameOptionsMiddleware):
    pass
