"""The head's TCP connections send an idle write at once, and anything else through Twisted's buffer, in order
(fleet/eager_writes.py). Real sockets (a socketpair) under Twisted's own TCP connection; the reactor is a recorder
of what the connection asks it to watch."""

from __future__ import annotations

import contextlib
import socket

import pytest
from twisted.internet import tcp
from twisted.internet.protocol import Protocol

from fleet.eager_writes import eager_tcp_writes


class Watches:
    """The reactor calls a connection makes: which sockets it asked to have watched for writability."""

    def __init__(self):
        self.writers: list = []

    def addWriter(self, writer):
        if writer not in self.writers:  # as a reactor's: watched once, however often asked
            self.writers.append(writer)

    def removeWriter(self, writer):
        if writer in self.writers:
            self.writers.remove(writer)

    def addReader(self, reader):
        pass

    def removeReader(self, reader):
        pass


@pytest.fixture
def pair():
    import fleet.asgi  # noqa: F401 - the head as daphne loads it

    ours, theirs = socket.socketpair()
    watches = Watches()
    connection = tcp.Connection(ours, Protocol(), reactor=watches)
    connection.connected = 1
    theirs.settimeout(2)
    yield connection, theirs, watches
    ours.close()
    theirs.close()


def _drain(connection, peer, watches, expected: int) -> bytes:
    """What the peer reads, running the connection's buffered writes as the loop would, until `expected` bytes."""
    got = bytearray()
    while len(got) < expected:
        if connection in watches.writers:
            assert connection.doWrite() is None
        peer.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            got += peer.recv(1 << 20)
    return bytes(got)


def test_a_write_with_nothing_buffered_goes_to_the_socket_without_a_watch(pair):
    connection, peer, watches = pair
    connection.write(b"data: one\n\n")
    connection.writeSequence([b"b\r\n", b"data: two\n\n", b"\r\n"])
    assert watches.writers == []
    assert peer.recv(100) == b"data: one\n\nb\r\ndata: two\n\n\r\n"


def test_what_the_socket_does_not_take_waits_and_later_writes_queue_behind_it(pair):
    connection, peer, watches = pair
    big = bytes(range(256)) * 40_000  # 10 MB: more than a socket's buffer
    connection.write(big)
    assert watches.writers == [connection]  # the rest waits for writability
    connection.write(b"tail")  # must not overtake what is buffered
    connection.writeSequence([b"-", b"end"])
    assert _drain(connection, peer, watches, len(big) + 8) == big + b"tail-end"
    assert watches.writers == []
    connection.writeSequence([big, b"!"])  # the same through a sequence
    assert watches.writers == [connection]
    assert _drain(connection, peer, watches, len(big) + 1) == big + b"!"
    assert watches.writers == []


def test_a_pull_producer_is_still_resumed_by_the_loop(pair):
    connection, peer, watches = pair

    class Pull:
        resumed = 0

        def resumeProducing(self):
            self.resumed += 1

        def stopProducing(self):
            pass

    producer = Pull()
    connection.registerProducer(producer, False)
    connection.write(b"chunk")
    assert watches.writers == [connection]  # so that doWrite asks the producer for more
    assert _drain(connection, peer, watches, 5) == b"chunk"
    assert producer.resumed >= 2  # once at registration, once when the buffer drained


def test_a_closing_connection_keeps_twisteds_order(pair):
    connection, peer, watches = pair
    connection.disconnecting = 1  # loseConnection was called: the loop flushes, then closes
    connection.write(b"last")
    assert watches.writers == [connection]


def test_a_twisted_without_what_the_check_reads_is_left_as_it_is(monkeypatch):
    from twisted.internet import abstract

    from fleet import eager_writes

    monkeypatch.setattr(eager_writes, "_installed", {})
    monkeypatch.delattr(abstract.FileDescriptor, "_writeDisconnecting")
    monkeypatch.setattr(tcp.Connection, "write", tcp.Connection.write)
    before = tcp.Connection.write
    assert eager_tcp_writes() is False
    assert tcp.Connection.write is before
