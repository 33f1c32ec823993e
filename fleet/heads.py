"""This head process and the fleet's live head processes, each with the link URL nodes reach it at.

Every head process links every node: a node that registers with one is told the link URL of each live one
(`registered.heads`, then `heads` when they change) and dials them all. A process is named by an id new at each
start (so a restarted one never inherits what its predecessor held) and says where nodes reach it:
settings.FLEET_LINK_URL, else the address daphne serves (its -b/-p), else FLEET_ANNOUNCE, else the address the first
node link reached. With Redis each process renews itself every BEAT_S (a sorted set of expiry times in the placement
state, which also reaps a process whose beats stopped: the lanes it held, its links); on the embedded default there
is one process, this one.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from datetime import UTC, datetime

from django.conf import settings

log = logging.getLogger("fleet")

BEAT_S = 2.0
TTL_S = 6.0  # three beats missed: the process is dead (a SIGKILL costs its streams, and its lanes this long at most)
PROCESS_ID = uuid.uuid4().hex[:12]

_served = ""  # learned from the first node link when nothing else says where this process is served
_live: list[str] = []  # the live heads' link URLs, as the last beat read them
_beating: threading.Thread | None = None


def link_url() -> str:
    """Where nodes reach this head process."""
    if settings.FLEET_LINK_URL:
        return settings.FLEET_LINK_URL
    served = _daphne_address(sys.argv) or settings.FLEET_ANNOUNCE or _served
    return _ws_url(served) if served else ""


def served_at(scope: dict) -> None:
    """A node link reached this process: its server address is where it serves, if nothing said so before."""
    global _served
    server = scope.get("server") or ()
    if not _served and len(server) == 2 and isinstance(server[1], int):  # (host, port); a test's has no port
        _served = f"{server[0]}:{server[1]}"


def heads_live() -> list[str]:
    """Every live head process's link URL (this one's included), sorted."""
    own = link_url()
    if not settings.REDIS_URL:
        return [own] if own else []
    heads_start()
    return sorted(set(_live) | ({own} if own else set()))


def alive_until(head: str) -> float | None:
    """Until when head process `head` counts as alive unless it beats again (epoch seconds; this one: forever);
    None: it is dead. On the embedded default there is no other process: any other id is this one's predecessor."""
    if head == PROCESS_ID:
        return float("inf")
    if not settings.REDIS_URL:
        return None
    from fleet.links import registry

    return registry().placement.head_expiry(head)


def node_links(node_id: str) -> list[tuple[str, datetime]]:
    """The head processes holding a link to the node: (link URL, since), oldest first (the node's admin page)."""
    from fleet.links import registry

    own = {PROCESS_ID: link_url() or "this head process", "": link_url() or "this head process"}
    links = registry().placement.links_of(node_id)
    return sorted(((own.get(head, head), datetime.fromtimestamp(since, UTC)) for head, since in links.items()),
                  key=lambda row: row[1])


def heads_start() -> None:
    """Start this process's beat (once; a daemon thread on the synchronous Redis client, off the event loop)."""
    global _beating
    if not settings.REDIS_URL or (_beating is not None and _beating.is_alive()):
        return
    _beating = threading.Thread(target=_beat_forever, name="fleet-head-beat", daemon=True)
    _beating.start()


def heads_beat() -> list[str]:
    """One beat: renew this process, reap dead ones, read the live ones."""
    global _live
    from fleet.links import registry

    url = link_url()
    if not url:
        return _live
    _live = registry().placement.head_beat(PROCESS_ID, url, TTL_S)
    return _live


def _beat_forever() -> None:
    while True:
        try:
            heads_beat()
        except Exception:  # Redis away: beat again; the others reap this process only after TTL_S
            log.warning("fleet head: its heartbeat to Redis failed; retrying", exc_info=True)
        time.sleep(BEAT_S)


def _daphne_address(argv: list[str]) -> str:
    """host:port from daphne's own command line (`daphne -b HOST -p PORT ...`), else ''."""
    if not argv or "daphne" not in argv[0]:
        return ""
    host, port = "127.0.0.1", "8000"
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag in ("-b", "--bind"):
            host = value
        elif flag in ("-p", "--port"):
            port = value
    return f"{host}:{port}"


def _ws_url(address: str) -> str:
    if address.startswith(("ws://", "wss://")):
        return address
    host, _, port = address.rpartition(":")
    if host in ("", "0.0.0.0", "::", "[::]"):  # noqa: S104 - a wildcard bind names no address a node can dial
        import socket

        host = socket.gethostname()
    return f"ws://{host}:{port}/ws/node/"
