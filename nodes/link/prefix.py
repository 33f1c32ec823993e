"""Prefix keys: chained hashes of what a prompt starts with, so placement can ask who already holds it.

A chat's keys are its message boundaries (each key covers every message up to it); a raw prompt's keys are
fixed-size character blocks. Each key carries the estimated token count up to it, so the index can say how
many prompt tokens a node would not have to read again. Keys are computed on the head from text (it has no
tokenizer); the token counts are corrected with what nodes report (prompt_tokens per generation).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

BLOCK_CHARS = 256  # about 64 tokens of English text
CHARS_PER_TOKEN = 4.0


@dataclass(frozen=True)
class PrefixKey:
    key: str
    chars: int  # characters of the prompt covered up to and including this key

    def tokens(self, chars_per_token: float = CHARS_PER_TOKEN) -> int:
        return int(self.chars / chars_per_token)


def _chain(previous: str, part: str) -> str:
    return hashlib.blake2b((previous + "\x1f" + part).encode(), digest_size=12).hexdigest()


def _blocks(text: str, start_key: str, start_chars: int) -> list[PrefixKey]:
    keys, key = [], start_key
    for offset in range(0, len(text) - len(text) % BLOCK_CHARS, BLOCK_CHARS):
        key = _chain(key, text[offset : offset + BLOCK_CHARS])
        keys.append(PrefixKey(key, start_chars + offset + BLOCK_CHARS))
    return keys


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    # Stripped: the head records an answer as streamed (often with a leading space), and clients commonly send it
    # back trimmed; both must give the same key, or a conversation's next turn never matches its own answer.
    return f"{message.get('role', '')}\x1e{content.strip()}\x1e{message.get('tool_calls') or ''}"


def prefix_keys(*, model: str, prompt: str | None = None, messages: list[dict] | None = None) -> list[PrefixKey]:
    """The chain of keys for a prompt or a chat, in order; the model is folded into the first key."""
    root = _chain("", model)
    if prompt is not None:
        return _blocks(prompt, root, 0)
    keys: list[PrefixKey] = []
    key, chars = root, 0
    for message in messages or []:
        text = _message_text(message)
        # Long messages (a big system prompt) also get block keys, so a shared head of them still matches.
        keys.extend(_blocks(text, key, chars))
        key = _chain(key, text)
        chars += len(text)
        keys.append(PrefixKey(key, chars))
    return keys
