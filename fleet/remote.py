"""Generations (and state operations) whose node link lives in another head process: they ride the channel
layer (Redis), in batches.

Each head process listens on one channel of its own. A generation placed on a node held by another process
goes there as `link.generate` with this process's channel as `reply_to`; that process's link consumer sends the
node's frames back as `relay.frames` messages (each frame the msgpack bytes the node sent; one message for what
one of the node's bundles holds for this process), which land in the same in-process Relay a local generation
uses. So the dispatcher does not know which path it is on.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from channels.exceptions import ChannelFull
from channels.layers import get_channel_layer

from fleet.links import NodeLost, registry
from nodes.link.messages import LinkError, decode

log = logging.getLogger("fleet")


class ProcessChannel:
    """This head process's own channel, and the task that delivers what arrives on it."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    async def ensure(self) -> str:
        async with self._lock:
            if self.name is None or self._task is None or self._task.done():
                layer = get_channel_layer()
                # The default prefix matters: channels-redis reads every process-local channel of a layer through
                # one shared list, and a second prefix starves the consumers' channels (messages were lost).
                self.name = await layer.new_channel()
                self._task = asyncio.ensure_future(self._read(layer, self.name))
        return self.name

    async def _read(self, layer, name: str) -> None:
        while True:
            try:
                message = await layer.receive(name)
            except asyncio.CancelledError:
                raise
            except Exception:  # a broken Redis connection: retry rather than lose every remote stream
                log.warning("fleet head: reading its channel failed; retrying", exc_info=True)
                await asyncio.sleep(0.5)
                continue
            deliver(message)


# op_id -> the future a RemoteLink.state_op waits on, answered by the holding process's `state.result`
_pending_ops: dict[str, asyncio.Future] = {}


def deliver(message: dict[str, Any]) -> None:
    if message.get("type") == "state.result":
        future = _pending_ops.get(str(message.get("op_id", "")))
        if future is not None and not future.done():
            future.set_result(message)
        return
    node_id = str(message.get("node_id", ""))
    if message.get("type") == "relay.lost":
        registry().relay_push(str(message.get("gen_id", "")), NodeLost(node_id, message.get("reason", "link closed")),
                              node_id=node_id)
        return
    if message.get("type") != "relay.frames":
        log.warning("fleet head: dropped a %r message on its channel (is another head process of another version?)",
                    message.get("type"))
        return
    reg = registry()
    for part in message.get("frames", ()):
        try:
            gen_id, frame = part
            reg.relay_push(str(gen_id), decode(frame), node_id=node_id)
        except (LinkError, TypeError, ValueError):
            log.warning("fleet head: dropped a malformed relay frame from node %s", node_id)


_process_channel = ProcessChannel()


class RemoteLink:
    """A LinkHandle for a node whose link is held by another head process."""

    def __init__(self, node_id: str, identity: str, channel: str):
        self.node_id, self.identity, self.channel = node_id, identity, channel

    async def send_generate(self, gen_id: str, spec: dict[str, Any]) -> None:
        """Raises LinkError when the process holding the link is not keeping up with its channel (it is full): the
        dispatcher then places the generation on another node."""
        reply_to = await _process_channel.ensure()
        try:
            await get_channel_layer().send(self.channel, {"type": "link.generate", "gen_id": gen_id, "spec": spec,
                                                          "reply_to": reply_to})
        except ChannelFull:
            raise LinkError(f"the head process holding node {self.identity!r} is not keeping up (its channel is "
                            "full)") from None

    async def send_cancel(self, gen_id: str, reason: str) -> None:
        await get_channel_layer().send(self.channel, {"type": "link.cancel", "gen_id": gen_id, "reason": reason})

    async def state_op(self, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run a state operation (embed, tokenize, ...) on the node through the process that holds its link."""
        reply_to = await _process_channel.ensure()
        op_id = uuid.uuid4().hex
        future = _pending_ops[op_id] = asyncio.get_running_loop().create_future()
        try:
            await get_channel_layer().send(self.channel, {"type": "link.state_op", "op_id": op_id, "op": op,
                                                          "args": args, "timeout": timeout, "reply_to": reply_to})
            reply = await asyncio.wait_for(future, timeout)
        finally:
            _pending_ops.pop(op_id, None)
        if not reply.get("ok"):
            raise LinkError(reply.get("error") or f"{op} failed on node {self.identity!r}")
        return reply.get("result") or {}


async def aremote_link(node_id: str, identity: str) -> RemoteLink | None:
    """A handle on node `identity` whose link another head process holds (None: no process holds it)."""
    channel = await registry().aplacement.channel_of(node_id)
    return RemoteLink(node_id, identity, channel) if channel else None
