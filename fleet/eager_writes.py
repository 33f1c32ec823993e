"""The head's TCP connections send a write at once when nothing is waiting to go out.

Twisted (daphne's server) buffers every write, asks the event loop to watch the socket for writability, sends the
buffer on the loop's next turn and stops watching: for every chunk a stream gets, two epoll changes (asyncio's
`add_writer` and `remove_writer`), a handle and a turn of the loop: under many streams, the largest single
mechanism in the head's profile (docs/benchmarks.md, *Scale*). asyncio's own transports send at once when
nothing is buffered and watch the socket only for what it could not take; the head's connections now do the same.

Only a plain TCP connection whose buffer is empty, still open for writing, with no pull producer (which Twisted
asks for more each time its buffer drains, from that loop turn) writes at once; anything the socket does not take,
or a send that fails, goes through Twisted's own buffer and loop turn, which report a lost connection as before.
Both daphne's HTTP channel and autobahn's websocket protocol turn Nagle's algorithm off, so a small send is not held
back either way.
"""

from __future__ import annotations

from collections.abc import Iterable

_installed: dict[str, object] = {}


def _idle(connection) -> bool:
    """Whether a write may go to the socket now: nothing buffered before it, nothing closing, plain TCP, no pull
    producer waiting to be resumed by the loop."""
    return (connection.connected and not connection.disconnecting and not connection._writeDisconnecting
            and not connection._writeDisconnected and not connection.TLS
            and not connection._tempDataBuffer and connection.offset == len(connection.dataBuffer)
            and (connection.producer is None or connection.streamingProducer))


def _send_now(connection, data: bytes) -> bytes:
    """Send what the socket takes of `data` now; what is left (all of it when the send failed)."""
    sent = connection.writeSomeData(data)
    if isinstance(sent, int) and sent > 0:
        return data[sent:]
    return data


def _write(self, data: bytes) -> None:
    if data and type(data) is bytes and _idle(self):
        data = _send_now(self, data)
        if not data:
            return
    _installed["write"](self, data)


def _write_sequence(self, iovec: Iterable[bytes]) -> None:
    if isinstance(iovec, list | tuple) and iovec and _idle(self) and all(type(part) is bytes for part in iovec):
        rest = _send_now(self, b"".join(iovec))
        if rest:
            _installed["write"](self, rest)
        return
    _installed["writeSequence"](self, iovec)


def eager_tcp_writes() -> bool:
    """Make Twisted's TCP connections send at once when idle (once per process); False where this Twisted's
    connection lacks what the check reads (a release that changed it), which leaves Twisted as it is."""
    from twisted.internet import tcp

    connection = tcp.Connection
    if "write" in _installed:
        return True
    needed = ("write", "writeSequence", "writeSomeData", "dataBuffer", "offset", "TLS", "_writeDisconnecting",
              "_writeDisconnected", "streamingProducer")
    if not all(hasattr(connection, name) for name in needed):
        return False
    _installed["write"], _installed["writeSequence"] = connection.write, connection.writeSequence
    connection.write, connection.writeSequence = _write, _write_sequence
    return True
