"""Websocket routes. Node links authenticate with their fleet token inside the link; clients with API keys."""

from django.urls import path

from nodes.consumers import NodeLinkConsumer

websocket_urlpatterns = [
    path("ws/node/", NodeLinkConsumer.as_asgi()),
]

try:  # the client stream lives in api/
    from api.consumers import ClientStreamConsumer

    websocket_urlpatterns.append(path("ws/v1/generate", ClientStreamConsumer.as_asgi()))
except ImportError:  # pragma: no cover - before api.consumers exists
    pass
