"""Websocket consumers that reach the database only through `database_sync_to_async`, and so skip Channels' sweep.

Channels (4.2 and later) runs `close_old_connections` before every message it dispatches to a consumer, through
`sync_to_async`: a hop to a worker thread and back for each websocket frame (a node link's every token batch, a
client socket's every generate frame), under load the head's largest single cost. `database_sync_to_async`
already closes stale connections before and after each use, so a consumer whose database work all goes through it
loses nothing when its frames skip the sweep.

The connect message skips it too. Channels' consumers make their thread-sensitive calls on one thread per process
(no request context gives them one of their own, as Django's HTTP handler does), so a socket's sweep before its
connect waited behind every other socket's database work: with a thousand streams the websocket handshakes came
near daphne's 5 s limit for an application to accept a websocket, and some were lost to it. Other messages
(disconnect, channel-layer events) are swept as before. The consumers that take it: the node link
(nodes.consumers) and the client stream socket (api.consumers).
"""

from __future__ import annotations


class FramesSkipSweep:
    """Mix in before a Channels websocket consumer whose database work goes only through database_sync_to_async."""

    async def dispatch(self, message: dict) -> None:
        if message["type"] == "websocket.receive":
            await self.websocket_receive(message)
        elif message["type"] == "websocket.connect":
            await self.websocket_connect(message)
        else:
            await super().dispatch(message)
