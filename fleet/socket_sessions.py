"""Django sessions for websockets, read from the cookie, with no check on each message the socket sends.

Channels' SessionMiddleware hands the consumer a `send` that, before every message, reads the session's `modified`
and `is_empty()` (through a LazyObject) and a setting, to save the session and set its cookie on
`http.response.start`, a message a websocket never sends: work done for every token batch a client socket
streams. Here the consumer gets the server's own `send`. A websocket consumer that changes
its session saves it itself, as it had to before (Channels' wrapper never saved one for a websocket).
"""

from __future__ import annotations

from channels.auth import AuthMiddleware
from channels.sessions import CookieMiddleware, InstanceSessionWrapper, SessionMiddleware


class SocketSessionMiddleware(SessionMiddleware):
    """The scope's `session`, lazily loaded from the session cookie; the inner application sends directly. For
    websocket routes only (an HTTP response's session would never be saved)."""

    async def __call__(self, scope, receive, send):
        wrapper = InstanceSessionWrapper(scope, send)
        await wrapper.resolve_session()
        return await self.inner(wrapper.scope, receive, send)


def socket_session_stack(inner):
    """Channels' SessionMiddlewareStack for a websocket route."""
    return CookieMiddleware(SocketSessionMiddleware(inner))


def socket_auth_stack(inner):
    """Channels' AuthMiddlewareStack for a websocket route (`scope["user"]` resolved before the consumer starts)."""
    return CookieMiddleware(SocketSessionMiddleware(AuthMiddleware(inner)))
