"""Websocket routes. Node links authenticate with their fleet token inside the link; clients with API keys, or
(the admin playground) a staff session; the live fleet page with a staff session. Only the client and fleet page
routes read the session cookie (fleet/socket_sessions.py: Channels' session middleware without its check on
each message sent). The client route resolves the session's user only for a socket with no key, once
its handshake is done (api/consumers.py); the fleet page's is resolved before its consumer starts."""

from django.urls import path

from api.consumers import ClientStreamConsumer
from fleet.consumers import FleetPageConsumer
from fleet.socket_sessions import socket_auth_stack, socket_session_stack
from nodes.consumers import NodeLinkConsumer

websocket_urlpatterns = [
    path("ws/node/", NodeLinkConsumer.as_asgi()),
    path("ws/v1/generate", socket_session_stack(ClientStreamConsumer.as_asgi())),
    path("ws/fleet/", socket_auth_stack(FleetPageConsumer.as_asgi())),
]
