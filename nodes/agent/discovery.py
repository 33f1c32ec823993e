"""Finding the head on the local network by mDNS (zeroconf), when node_join is given no address.

An announcement is unauthenticated: anything on the LAN can announce `_fleet._tcp`. So the node takes only the
addresses and ports from it (never the TXT record) and trusts none of them: the dialer tries each in turn until one
proves it holds the token's secret, and only that one's key is pinned (docs/protocol.md).
"""

from __future__ import annotations

import socket
import time

SERVICE_TYPE = "_fleet._tcp.local."
SETTLE_S = 1.0  # after the first answer, how long more answers are waited for (several heads answering is normal)


def find_heads(timeout: float = 5.0, settle: float = SETTLE_S) -> list[str]:
    """Every head announcing `_fleet._tcp` on the local network, as "host:port", in the order they answered."""
    from zeroconf import ServiceBrowser, Zeroconf

    found: list[str] = []

    class Listener:
        def add_service(self, zc, type_, name):
            info = zc.get_service_info(type_, name, timeout=2000)
            if info is None:
                return
            for address in info.addresses:
                if len(address) == 4 and (head := f"{socket.inet_ntoa(address)}:{info.port}") not in found:
                    found.append(head)

        def update_service(self, zc, type_, name):
            pass

        def remove_service(self, zc, type_, name):
            pass

    zc = Zeroconf()
    try:
        ServiceBrowser(zc, SERVICE_TYPE, Listener())
        deadline = time.monotonic() + timeout
        settled = False
        while time.monotonic() < deadline:
            if found and not settled:
                settled, deadline = True, min(deadline, time.monotonic() + settle)
            time.sleep(0.1)
    finally:
        zc.close()
    return list(found)

