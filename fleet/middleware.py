"""Django's stock middleware and WhiteNoise, with the hooks that do no I/O run inline on the event loop.

Under ASGI, Django's `MiddlewareMixin` runs each hook (`process_request`, `process_response`) through
`sync_to_async`: a hop to a worker thread and back for each. WhiteNoise is sync-only, so Django runs it, and the
middleware outside it, in a worker thread and comes back to the event loop for everything inside it. With the stock
list that is about a dozen hops a request, all through the one thread that `thread_sensitive` work shares.

These classes are their stock namesakes (settings.MIDDLEWARE lists them; Django's checks see the subclasses) whose
hooks run in place when they only read and set headers, cookies and attributes in memory: the CSRF secret is in a
cookie here, the user and the session are loaded lazily, when a view asks. What may do I/O still goes to a thread:
saving a modified session, storing messages that were read or added, serving a static file.
docs/benchmarks.md ("Scale", "Relay") has what each step saved.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.sessions import middleware as sessions
from django.middleware import clickjacking, common, csrf, security
from whitenoise import middleware as whitenoise


class InlineHooks:
    """`__acall__` calling the middleware's own hooks directly instead of through `sync_to_async`."""

    async def __acall__(self, request):
        response = None
        if hasattr(self, "process_request"):
            response = self.process_request(request)
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            if self.response_needs_io(request):
                response = await sync_to_async(self.process_response, thread_sensitive=True)(request, response)
            else:
                response = self.process_response(request, response)
        return response

    def response_needs_io(self, request) -> bool:
        return False


class SecurityMiddleware(InlineHooks, security.SecurityMiddleware):
    pass


class SessionMiddleware(InlineHooks, sessions.SessionMiddleware):
    """The session store is made lazily (no read until a view asks); only saving a modified session writes."""

    def response_needs_io(self, request) -> bool:
        session = getattr(request, "session", None)
        return session is not None and (session.modified or settings.SESSION_SAVE_EVERY_REQUEST)


class MessageMiddleware(InlineHooks, messages.MessageMiddleware):
    """Messages nobody read or added are not stored; storing others may load the session."""

    def response_needs_io(self, request) -> bool:
        storage = getattr(request, "_messages", None)
        return storage is not None and (storage.used or storage.added_new)


class CommonMiddleware(InlineHooks, common.CommonMiddleware):
    pass


class CsrfViewMiddleware(InlineHooks, csrf.CsrfViewMiddleware):
    """The view check too: on the event loop for a view exempt from CSRF or a safe method (it reads nothing then),
    in a thread for the others, whose check may read a form body spooled to disk."""

    async def process_view(self, request, callback, callback_args, callback_kwargs):
        check = super().process_view
        if getattr(callback, "csrf_exempt", False) or request.method in ("GET", "HEAD", "OPTIONS", "TRACE"):
            return check(request, callback, callback_args, callback_kwargs)
        return await sync_to_async(check, thread_sensitive=True)(request, callback, callback_args, callback_kwargs)


class AuthenticationMiddleware(InlineHooks, auth.AuthenticationMiddleware):
    pass


class XFrameOptionsMiddleware(InlineHooks, clickjacking.XFrameOptionsMiddleware):
    pass


class WhiteNoiseMiddleware(whitenoise.WhiteNoiseMiddleware):
    """WhiteNoise that, under ASGI, passes every request that is not a static file straight on, on the event loop;
    finding (with autorefresh, as under DEBUG) and serving a static file run in a thread."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response=None, settings=settings):
        super().__init__(get_response, settings)
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.async_mode:
            return self.__acall__(request)
        return super().__call__(request)

    async def __acall__(self, request):
        if self.autorefresh:
            static_file = await sync_to_async(self.find_file, thread_sensitive=False)(request.path_info)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is not None:
            return await sync_to_async(self.serve, thread_sensitive=False)(static_file, request)
        return await self.get_response(request)
