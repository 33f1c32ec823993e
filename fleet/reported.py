"""What a node reports about a generation's usage, checked before it reaches a client, a quota or a metric.

A node holding a valid token is still only trusted for the tokens it streams: the head counts completion tokens
itself (the ids it relayed), and a count the node reports is kept within what the head can bound: never negative,
no more prompt tokens than the request sent, no more completion tokens than were streamed.
"""

from __future__ import annotations

import logging
from typing import Any

from nodes.link.spec import GenerateSpec

log = logging.getLogger("fleet")

# Tokens a chat template may add beyond the text the request sent (role markers, a template's default system prompt).
TEMPLATE_TOKENS = 256
# Tokens an image or an audio clip may become in the model (its bytes never travel in the spec: the node fetches them).
MEDIA_TOKENS = 8192


def count_checked(value: Any, bound: int, *, what: str, node: str, gen_id: str = "") -> int:
    """`value` as a count within 0..bound; a node reporting anything else is logged and its figure clamped."""
    try:
        count = int(value or 0)
    except (TypeError, ValueError, OverflowError):
        count = -1
    if 0 <= count <= bound:
        return count
    log.warning("fleet: node %r reported %s %r for generation %s (allowed 0 to %d); counted as %d", node, what,
                value, gen_id or "-", bound, min(max(count, 0), bound), extra={"gen_id": gen_id})
    return min(max(count, 0), bound)


def prompt_tokens_bound(spec: GenerateSpec) -> int:
    """The most prompt tokens a node can have read for `spec`: a token is at least one byte of the text sent, plus
    the template's own tokens, the resumed ids, and each image's or clip's allowance."""
    sent = len((spec.prompt or "").encode())
    for message in spec.messages or []:
        sent += _text_bytes(message)
    media = len(spec.images()) + (spec.audio is not None)
    return sent + len(spec.resume_ids) + TEMPLATE_TOKENS + media * MEDIA_TOKENS


def embedding_tokens_bound(texts: list[str]) -> int:
    """The most tokens a node can have read embedding `texts` (a begin and an end token each, beyond the bytes)."""
    return sum(len(text.encode()) + 2 for text in texts)


def _text_bytes(value: Any) -> int:
    """The bytes of every string in a message (its content, its parts, a tool call's arguments): what the template
    renders from."""
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, dict):
        return sum(_text_bytes(v) + len(str(k)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return sum(_text_bytes(v) for v in value)
    return len(str(value))
