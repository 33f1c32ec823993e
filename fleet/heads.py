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
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from django.conf import settings

log = logging.getLogger("fleet")

BEAT_S = 2.0
TTL_S = 6.0  # three beats missed: the process is dead (a SIGKILL costs its streams, and its lanes this long at most)
PROCESS_ID = uuid.uuid4().hex[:12]

class HeadBeat:
    """This process's part in the fleet's list of heads (one, on the registry): where it is served, its beat thread
    and the live heads' link URLs as the last beat read them. `placement` gives the placement state in use."""

    def __init__(self, placement: Callable[[], Any]) -> None:
        self._placement = placement
        self.served = ""  # learned from the first node link when nothing else says where this process is served
        self.live: list[str] = []
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def link_url(self) -> str:
        if settings.FLEET_LINK_URL:
            return settings.FLEET_LINK_URL
        served = _daphne_address(sys.argv) or settings.FLEET_ANNOUNCE or self.served
        return _ws_url(served) if served else ""

    def served_at(self, scope: dict) -> None:
        server = scope.get("server") or ()
        if not self.served and len(server) == 2 and isinstance(server[1], int):  # (host, port); a test's has none
            self.served = f"{server[0]}:{server[1]}"

    def heads_live(self) -> list[str]:
        own = self.link_url()
        if not settings.REDIS_URL:
            return [own] if own else []
        self.start()
        return sorted(set(self.live) | ({own} if own else set()))

    def start(self) -> None:
        if not settings.REDIS_URL or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self._beat_forever, name="fleet-head-beat", daemon=True)
        self._thread.start()

    def beat(self) -> list[str]:
        url = self.link_url()
        if url:
            self.live = self._placement().head_beat(PROCESS_ID, url, TTL_S)
        return self.live

    def alive_until(self, head: str) -> float | None:
        if head == PROCESS_ID:
            return float("inf")
        return self._placement().head_expiry(head) if settings.REDIS_URL else None

    def node_links(self, node_id: str) -> list[tuple[str, datetime]]:
        own = {PROCESS_ID: self.link_url() or "this head process", "": self.link_url() or "this head process"}
        links = self._placement().links_of(node_id)
        return sorted(((own.get(head, head), datetime.fromtimestamp(since, UTC)) for head, since in links.items()),
                      key=lambda row: row[1])

    def stop(self) -> None:
        """No more beats (a registry replaced: a test's reset); the others reap this process after TTL_S."""
        self._stopped.set()

    def _beat_forever(self) -> None:
        while not self._stopped.is_set():
            try:
                self.beat()
            except Exception:  # Redis away: beat again; the others reap this process only after TTL_S
                log.warning("fleet head: its heartbeat to Redis failed; retrying", exc_info=True)
            self._stopped.wait(BEAT_S)


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
