"""The head's websocket frames go out without autobahn building coloured debug lines (fleet/autobahn_logs.py)."""

from __future__ import annotations

from autobahn.websocket import protocol

from fleet.autobahn_logs import plain_frame_logs


def test_the_head_sends_frames_with_plain_log_helpers():
    import fleet.asgi  # noqa: F401 - the head as daphne loads it

    assert protocol.hlval(123) == "123"  # click.style would wrap it in ANSI escapes
    assert protocol.hltype(protocol.WebSocketProtocol.sendData) == (
        "<autobahn.websocket.protocol.WebSocketProtocol.sendData>")
    assert "\x1b" not in protocol.hltype(protocol.WebSocketProtocol.sendData) + protocol.hlval("peer")


def test_an_autobahn_without_the_helpers_is_left_as_it_is(monkeypatch):
    monkeypatch.delattr(protocol, "hltype")
    assert plain_frame_logs() is False
    assert not hasattr(protocol, "hltype")
