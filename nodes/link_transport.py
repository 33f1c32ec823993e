"""What a node link's session and its collaborators need of the others: the transport (nodes.consumers carries the
frames) and the node as its session knows it. Protocols only, so the session's modules never import the consumer."""

from __future__ import annotations

from typing import Any, Protocol

from nodes.link.messages import Message


class LinkTransport(Protocol):
    """The link's transport (nodes.consumers.NodeLinkConsumer): frames out, groups, close."""

    peer: str | None
    scope: dict
    channel_layer: Any

    async def send_sealed(self, msg: Message) -> None: ...

    async def send_frame(self, frame: bytes) -> None: ...

    async def close(self, code: int | None = None, reason: str | None = None) -> None: ...

    async def refuse(self, code: int, reason: str) -> None: ...

    async def end(self, code: int) -> None: ...

    async def join(self, group: str) -> None: ...

    async def leave(self, group: str) -> None: ...

    def quiet_s(self) -> float: ...

    def budget_lanes(self, lanes: int) -> None: ...


class LinkedNode(Protocol):
    """The node on the link, as its session (nodes.link_session.LinkSession) knows it: empty until it registered."""

    node_id: str
    identity: str
