"""The generations on one node link: which run there, which ended lately (a straggler frame after a cancel is
dropped, not refused), and the state operations waiting for the node's answer. A generation's frames go to this
process's relay for it (fleet.links), never through the database or the channel layer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from cachetools import TTLCache

from fleet.links import NodeLost, registry
from fleet.live import fleet_changed
from nodes.link.messages import (
    Accepted,
    Cancel,
    Done,
    Error,
    Generate,
    LinkClosed,
    LinkError,
    Message,
    StateOp,
    StateResult,
    TokenBatch,
)
from nodes.link_transport import LinkedNode


class LinkGenerations:
    """What runs on one node link. Owned by the link's session; `send` seals a message onto the link."""

    def __init__(self, node: LinkedNode, send: Callable[[Message], Awaitable[None]]) -> None:
        self.node, self.send = node, send
        self.running: set[str] = set()
        self.ended: TTLCache = TTLCache(maxsize=4096, ttl=60)  # generations that ended: stragglers are dropped
        self.pending_ops: dict[str, asyncio.Future] = {}

    async def start(self, gen_id: str, spec: dict[str, Any]) -> None:
        self.running.add(gen_id)
        try:
            await self.send(Generate(gen_id=gen_id, spec=spec))
        except Exception:
            await self.end(gen_id)
            raise

    async def cancel(self, gen_id: str, reason: str) -> None:
        if gen_id in self.running:
            await self.send(Cancel(gen_id=gen_id, reason=reason))

    async def state_op(self, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        op_id = f"{op}-{time.monotonic_ns()}"
        fut = asyncio.get_running_loop().create_future()
        self.pending_ops[op_id] = fut
        await self.send(StateOp(op_id=op_id, op=op, args=args))
        try:
            result: StateResult = await asyncio.wait_for(fut, timeout)
        finally:
            self.pending_ops.pop(op_id, None)
        if not result.ok:
            raise LinkError(result.error or f"{op} failed on node {self.node.identity!r}")
        return result.result

    async def on_frame(self, msg: Accepted | TokenBatch | Done | Error) -> None:
        """A generation's frame from the node, to its relay; one for a generation the node does not run here is a
        protocol error."""
        if msg.gen_id not in self.running:
            if msg.gen_id in self.ended:
                return  # a straggler after a cancel raced the node's own end of the generation
            raise LinkError(f"{type(msg).__name__} for generation {msg.gen_id[:40]!r}, which this node lacks")
        if isinstance(msg, Done | Error):
            await self.end(msg.gen_id)
        registry().relay_push(msg.gen_id, msg, node_id=self.node.node_id)

    async def on_result(self, msg: StateResult) -> None:
        fut = self.pending_ops.pop(msg.op_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def end(self, gen_id: str) -> None:
        if gen_id in self.running:
            self.running.discard(gen_id)
            self.ended[gen_id] = True
            reg = registry()
            if gen_id not in reg.relays:  # its dispatcher is gone (else it frees the lane itself, with its record)
                await reg.lifecycle.aended(self.node.node_id, gen_id)
            reg.lanes.notify()
            fleet_changed()

    async def lost(self, code: int) -> None:
        """The link closed: each generation's dispatcher is told (it places the generation again), and each state
        operation fails."""
        reg, node_id = registry(), self.node.node_id
        for gen_id in list(self.running):
            if not reg.relay_push(gen_id, NodeLost(node_id, f"link closed (code {code})"), node_id=node_id):
                # its dispatcher is gone (its client left; the cancel found no node): the lane is freed here, as the
                # node's other links keep it in placement
                await reg.lifecycle.aended(node_id, gen_id)
        self.running.clear()
        for fut in self.pending_ops.values():
            if not fut.done():
                fut.set_exception(LinkClosed("the node link closed"))
