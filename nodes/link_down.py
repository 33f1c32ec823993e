"""A lost link's node out of this process's placement links, tried again, backing off, while Redis is away."""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from fleet import heads

log = logging.getLogger("fleet")

NODE_DOWN_RETRY_FIRST_S, NODE_DOWN_RETRY_MAX_S = 1.0, 30.0
REDIS_AWAY = (RedisError, OSError)  # Redis unreachable: placement and the channel layer raise these


async def node_down(reg, node_id: str) -> bool:
    """Take a lost link's node out of this process's placement links; True while another head process still links
    it. With Redis away (an outage) that failed, and the rest of the link's cleanup with it: the node stayed
    placeable, generations went nowhere (node_stuck) until a restart. Now the rest goes on, and this is tried again,
    backing off, until Redis is back (unless the node rejoined meanwhile)."""
    try:
        return await reg.aplacement.node_down(node_id, heads.PROCESS_ID)
    except REDIS_AWAY as exc:
        log.warning("fleet node %s: placement cannot be told it is gone (%s); again once Redis is back", node_id, exc)
        asyncio.ensure_future(_node_down_later(reg, node_id))
        return False  # not known: the node is marked offline, as a lost link's node is


async def _node_down_later(reg, node_id: str) -> None:
    delay = NODE_DOWN_RETRY_FIRST_S
    while True:
        await asyncio.sleep(delay)
        if node_id in reg.links:
            return  # it rejoined: its new link put it back in placement
        try:
            await reg.aplacement.node_down(node_id, heads.PROCESS_ID)
        except REDIS_AWAY:
            delay = min(delay * 2, NODE_DOWN_RETRY_MAX_S)
            continue
        log.info("fleet node %s: taken out of placement now that Redis is back", node_id)
        return
