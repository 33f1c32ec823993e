"""Websocket routes. Node links authenticate with their fleet token inside the link; clients with API keys, or
(the admin playground) a staff session; the live fleet page with a staff session. Only the client and fleet page
routes read the session cookie."""

from channels.auth import AuthMiddlewareStack
from django.urls import path

from api.consumers import ClientStreamConsumer
from fleet.consumers import FleetPageConsumer
from nodes.consumers import NodeLinkConsumer

websocket_urlpatterns = [
    path("ws/node/", NodeLinkConsumer.as_asgi()),
    path("ws/v1/generate", AuthMiddlewareStack(ClientStreamConsumer.as_asgi())),
    path("ws/fleet/", AuthMiddlewareStack(FleetPageConsumer.as_asgi())),
]
