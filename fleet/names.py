"""The names every head process shares: channel-layer groups and cache keys, each built by one function.

A name is spelled here once, for the code that writes under it and the code that reads it: the node link writes a
node's heartbeat under `liveness_key`, and the fleet page, the metrics, the admin and the API read it. This module
imports nothing, so the data plane, the observers, the apps and their consumers can all use it without importing
each other.
"""

from __future__ import annotations


def liveness_key(node_id: str) -> str:
    """The cache key of a node's last heartbeat (lanes, KV use, tokens/s, replicas), kept with a TTL."""
    return f"fleet:node:{node_id}:heartbeat"


def node_group(node_id: str) -> str:
    """The channel-layer group a node's link listens on (holds, drains, revocation), whichever process holds it."""
    return f"fleet.node.{node_id}"


def token_group(public_id: str) -> str:
    """The channel-layer group of the links that joined with a token, whichever head process holds them."""
    return f"fleet.token.{public_id}"


def fleet_page_group() -> str:
    """The channel-layer group of every open fleet page socket, in every head process."""
    return "fleet.page"
