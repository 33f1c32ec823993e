"""What a node's own values must be before the head stores them: its register (identity, engine, models, lanes,
tokenizers, warm generations) and its heartbeats' replicas and per-model figures. The link's decoder checked the
outer field types; these check what msgpack can carry and a database or the cache cannot (NUL characters, bytes,
NaN, depth, sizes)."""

from __future__ import annotations

import json
from typing import Any

from nodes import tokenizers
from nodes.link.messages import Heartbeat, Register
from nodes.models import Node


def text_problem(name: str, text: str) -> str | None:
    if (not text and name == "identity") or "\x00" in text or len(text) > Node._meta.get_field(name).max_length:
        return f"{name} {text[:40]!r} is empty, too long or holds a NUL character"
    return None


def json_problem(**values: Any) -> str | None:
    """Why node-sent values cannot be stored as JSON (msgpack also carries bytes, NaN, extension types, depth)."""
    try:
        stored = json.dumps(values, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return f"{', '.join(values)} must be plain JSON (no bytes, NaN, infinity or extension types, little nesting)"
    return f"{', '.join(values)} must hold no NUL character" if "\\u0000" in stored else None


def model_files(models: list[dict[str, Any]]) -> dict[str, str]:
    """The models' file fingerprints a register names (64 hex digits each; anything else is left out)."""
    return {m["name"]: m["file"] for m in models if isinstance(m.get("file"), str) and len(m["file"]) == 64
            and all(c in "0123456789abcdef" for c in m["file"])}


def register_problem(msg: Register) -> str | None:
    """What makes a Register unstorable beyond the outer field types that messages.decode checked; None if nothing."""
    engine = f"{msg.engine} {msg.engine_version}".strip()
    for problem in (text_problem("identity", msg.identity), text_problem("engine", engine),
                    text_problem("version", msg.version)):
        if problem:
            return problem
    if not all(isinstance(m, dict) and isinstance(m.get("name"), str) and m["name"] for m in msg.models):
        return "every model must be a map with a non-empty string name"
    if not (0 <= msg.lanes < 2**31 and 0 <= msg.context_window < 2**31):
        return "lanes and context window must be from 0 to 2**31-1"
    if not all(isinstance(r, dict) for r in msg.replicas):
        return "every replica must be a map"
    if not all(isinstance(k, str) and tokenizers.valid_fingerprint(v) for k, v in msg.tokenizers.items()):
        return "tokenizers must map model names to tokenizer fingerprints (64 hex digits, or mock or bytes)"
    if not all(isinstance(g, str) and 0 < len(g) <= 64 for g in msg.warm) or len(msg.warm) > 64 * max(msg.lanes, 1):
        return "warm must list generation ids (at most 64 per lane)"
    return json_problem(models=msg.models, capabilities=msg.capabilities, labels=msg.labels, replicas=msg.replicas,
                        device=msg.device)


def heartbeat_problem(msg: Heartbeat) -> str | None:
    """What makes a Heartbeat's replicas or per-model figures unstorable; None if nothing."""
    if not all(isinstance(r, dict) for r in msg.replicas) or json_problem(replicas=msg.replicas):
        return "every replica must be a map of plain JSON"
    if not all(isinstance(f, dict) for f in msg.models.values()) or json_problem(models=msg.models):
        return "each model's figures must be a map of plain JSON"
    return None
