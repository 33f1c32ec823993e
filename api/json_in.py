"""JSON from clients that the rest of the head can handle: nested at most MAX_DEPTH deep, and no lone surrogate.

Python's parser takes `[[[...]]]` about 1,000 deep and a `"\\ud800"` escape (a lone surrogate, which is not a
character): both parse, and then whatever walks or encodes the value (the tool schema's grammar, the link's msgpack,
PostgreSQL) raised, which was a 500. They are refused here, as the parse fails, with the reason. Both checks look at
the raw bytes first, so a body that cannot hold either costs nothing more than the parse.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser
from rest_framework.settings import api_settings

MAX_DEPTH = 64  # far deeper than any real request (a JSON schema of 10 levels is unusual)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class JsonRefused(ValueError):
    """Valid JSON the head does not take; the message says why."""


def json_loads(raw: bytes | str, **options: Any) -> Any:
    """`json.loads`, refusing (JsonRefused) what the head cannot handle; a ValueError for invalid JSON."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    try:
        value = json.loads(raw, **options)
    except RecursionError:
        raise JsonRefused(f"the JSON is nested more than {MAX_DEPTH} levels deep") from None
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH and _depth_over(value, MAX_DEPTH):
        raise JsonRefused(f"the JSON is nested more than {MAX_DEPTH} levels deep")
    if _SURROGATE_ESCAPE.search(data) and _has_surrogate(value):  # a frame's text is valid UTF-8: escapes only
        raise JsonRefused("a string holds a lone surrogate (\\ud800-\\udfff alone is not a character)")
    return value


def _depth_over(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _has_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class ClientJSONParser(JSONParser):
    """DRF's JSON parser (/api/...), with these refusals as its 400 (a RecursionError was a 500)."""

    def parse(self, stream, media_type=None, parser_context=None):
        raw = stream.read() if stream is not None else b""
        try:
            return json_loads(raw, parse_constant=None if api_settings.STRICT_JSON is False else _no_constant)
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")
