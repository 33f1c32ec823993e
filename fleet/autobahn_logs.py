"""The head's websocket frames without autobahn's per-frame log colouring.

Autobahn (daphne's websocket protocol) logs a debug line for every frame it sends, and builds that line's
arguments (the sending method's qualified name and two values, each coloured through click) before its logger
drops it: work paid for every token batch a client socket streams, for a line nobody reads (what it measured:
docs/benchmarks.md, *Scale*). The head replaces the two formatting helpers autobahn's websocket protocol
calls with plain ones: the debug lines read the same, uncoloured, for whoever turns autobahn's debug logging on.
"""

from __future__ import annotations

from typing import Any


def plain_value(value: Any, *_: Any, **__: Any) -> str:
    return f"{value}"


def plain_type(obj: Any) -> str:
    return f"<{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}>"


def plain_frame_logs() -> bool:
    """Swap autobahn's colouring helpers for plain ones in its websocket protocol; False where that autobahn has
    none (a later release), which leaves it as it is."""
    from autobahn.websocket import protocol

    if not (callable(getattr(protocol, "hltype", None)) and callable(getattr(protocol, "hlval", None))):
        return False
    protocol.hltype, protocol.hlval = plain_type, plain_value
    return True
