"""The head announces itself on the local network (`_fleet._tcp`, models served in the TXT record)."""

from __future__ import annotations

import atexit
import logging
import socket

log = logging.getLogger("fleet")

SERVICE_TYPE = "_fleet._tcp.local."


def _local_address() -> str:
    # The address a packet to the LAN would leave from; no packet is sent by a UDP connect.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class Announcer:
    """Registers the head with zeroconf; `update(models)` refreshes the TXT record."""

    def __init__(self, port: int, host: str | None = None):
        self.port, self.host = port, host
        self._zc = None
        self._info = None

    def _service(self, models: list[str]):
        from zeroconf import ServiceInfo

        address = self.host if self.host and self.host not in {"0.0.0.0", "::"} else _local_address()
        name = f"fleet-{socket.gethostname()}-{self.port}.{SERVICE_TYPE}"
        return ServiceInfo(SERVICE_TYPE, name, addresses=[socket.inet_aton(address)], port=self.port,
                           properties={"models": ",".join(models), "path": "/ws/node/"},
                           server=f"{socket.gethostname()}.local.")

    def start(self, models: list[str]) -> None:
        from zeroconf import Zeroconf

        try:
            self._zc = Zeroconf()
            self._info = self._service(models)
            self._zc.register_service(self._info, allow_name_change=True)
            log.info("fleet head announced on the local network as %s", self._info.name)
        except Exception as exc:  # no multicast here: nodes then need the head's address
            log.warning("fleet head could not announce itself by mDNS (%s); nodes need its address", exc)
            self._zc = None

    def update(self, models: list[str]) -> None:
        if self._zc is None:
            return
        self._info = self._service(models)
        self._zc.update_service(self._info)

    def stop(self) -> None:
        if self._zc is not None:
            self._zc.unregister_all_services()
            self._zc.close()
            self._zc = None


_served: Announcer | None = None


def announce_served_head() -> Announcer | None:
    """Announce this head process by mDNS when settings.FLEET_ANNOUNCE says where nodes should dial it (a head
    served by daphne; `manage.py up` announces itself). Once per process; withdrawn at exit."""
    global _served
    from django.conf import settings

    if _served is not None or not settings.FLEET_MDNS or not settings.FLEET_ANNOUNCE:
        return _served
    host, _, port = settings.FLEET_ANNOUNCE.rpartition(":")
    _served = Announcer(int(port), host or None)
    _served.start([])
    atexit.register(_served.stop)
    return _served
