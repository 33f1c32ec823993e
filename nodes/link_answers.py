"""What a node that has not joined asks on its link, each answered before the link closes: whether its key may take
an identity (`check`) and where to pull a model from (`pull`). Where it stands on its way in (`preparing`) is
nodes.preparing's."""

from __future__ import annotations

import logging

from channels.db import database_sync_to_async

from nodes import registry as model_registry
from nodes import services
from nodes.link.messages import Check, LinkError, Pull, PullGrant
from nodes.link_checks import text_problem

log = logging.getLogger("fleet")


async def key_check(msg: Check, node_key: str) -> None:
    """Raises JoinRefused (the link's refusal, with its reason) when the key may not take the identity."""
    if problem := text_problem("identity", msg.identity):
        raise LinkError(f"check: {problem}")
    await database_sync_to_async(services.node_key_check)(identity=msg.identity, public_key=node_key)


async def pull_grant(msg: Pull, node_key: str, peer: str | None) -> PullGrant:
    """The grant to pull the model (or why not), for a key that may take the identity."""
    if problem := text_problem("identity", msg.identity):
        raise LinkError(f"pull: {problem}")
    if not msg.model or len(msg.model) > 200 or "\x00" in msg.model:
        raise LinkError("pull: the model name is empty, too long or holds a NUL character")
    await database_sync_to_async(services.node_key_check)(identity=msg.identity, public_key=node_key)
    grant = await database_sync_to_async(model_registry.model_grant)(name=msg.model, identity=msg.identity)
    log.info("fleet node %r from %s asked to pull %r: %s", msg.identity, peer, msg.model,
             grant.error or f"granted {grant.sha256[:12]}")
    return grant
