"""JSON for what the head streams to clients: each SSE chunk and each websocket frame.

orjson encodes a chat chunk about ten times faster than the standard library, whose encoder showed in the head's
profiles under many streams (docs/benchmarks.md, *Scale*). orjson writes
what the standard library wrote with `ensure_ascii=False` and compact separators (UTF-8, not escaped), byte for
byte but for a float's exponent (`1e-7` where it wrote `1e-07`; pinned by tests/test_json_out.py). What orjson
refuses (a key that is not a string, an integer beyond 64 bits) goes through the standard library as before.
orjson writes a NaN or an infinity as `null`, where the standard library wrote `NaN`, which no JSON parser reads.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def json_bytes(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def json_text(value: Any) -> str:
    """`value` as compact JSON text (for a websocket text frame)."""
    return json_bytes(value).decode()
