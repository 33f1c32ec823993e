"""Finding the head on the local network by mDNS (zeroconf), when node_join is given no address."""

from __future__ import annotations

import socket
import time

SERVICE_TYPE = "_fleet._tcp.local."


def find_head(timeout: float = 5.0) -> str | None:
    """The first head announcing `_fleet._tcp` on the local network, as "host:port", or None."""
    from zeroconf import ServiceBrowser, Zeroconf

    found: list[str] = []

    class Listener:
        def add_service(self, zc, type_, name):
            info = zc.get_service_info(type_, name, timeout=2000)
            if info is None or not info.addresses:
                return
            found.append(f"{socket.inet_ntoa(info.addresses[0])}:{info.port}")

        def update_service(self, zc, type_, name):
            pass

        def remove_service(self, zc, type_, name):
            pass

    zc = Zeroconf()
    try:
        ServiceBrowser(zc, SERVICE_TYPE, Listener())
        deadline = time.monotonic() + timeout
        while not found and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        zc.close()
    return found[0] if found else None
