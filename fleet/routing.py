"""Websocket routes. Node links authenticate with their fleet token inside the link; clients with API keys, or
(the admin playground) a staff session; the live fleet page with a staff session. Only the client and fleet page
routes read the session cookie (Channels' own session and auth middleware). The client route resolves the
session's user only for a socket with no key, once its handshake is done (api/consumers.py); the fleet page's is
resolved before its consumer starts."""

from channels.auth import AuthMiddlewareStack
from channels.sessions import SessionMiddlewareStack
from django.urls import path

from api.consumers import ClientStreamConsumer
from fleet.consumers import FleetPageConsumer
from nodes.consumers import NodeLinkConsumer

websocket_urlpatterns = [
    path("ws/node/", NodeLinkConsumer.as_asgi()),
    path("ws/v1/generate", SessionMiddlewareStack(ClientStreamConsumer.as_asgi())),
    path("ws/fleet/", AuthMiddlewareStack(FleetPageConsumer.as_asgi())),
]
