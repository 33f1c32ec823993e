"""Prefix keys: chained hashes of what a prompt starts with, so placement can ask who already holds it.

Keys are over real token ids, from the model's own tokenizer (nodes.agent.vocab: the head holds each model's).
A raw prompt's keys are its 64-token blocks; a chat's are each message's 64-token blocks (so a long shared system
prompt matches block by block) and a boundary key after each message (each key covers every message up to it).
Every key carries the exact number of tokens it covers, so the index says how many prompt tokens a node would not
have to read again. A message is tokenized on its own (role, content and tool calls, as `_message_text` writes
them), so a conversation's next turn starts with the same keys as the turn before it, answer included. The
tokenizer's fingerprint is folded into the first key with the cache space (model and LoRA adapters): keys made
with two tokenizers never match.

A prompt may also carry a name its client gives it (OpenAI's `prompt_cache_key`): `named_key` is that name's key in
the same index, held where generations that carried it ran, so placement can send the next one there (fleet.placing).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BLOCK_TOKENS = 64

Tokenize = Callable[[str], list[int]]


@dataclass(frozen=True)
class PrefixKey:
    key: str
    tokens: int  # prompt tokens covered up to and including this key


def _chain(previous: str, part: bytes) -> str:
    return hashlib.blake2b(previous.encode() + b"\x1f" + part, digest_size=12).hexdigest()


def _ids(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}i", *ids)  # 4 bytes each, little-endian, signed


def _blocks(ids: list[int], start_key: str, start_tokens: int) -> list[PrefixKey]:
    keys, key = [], start_key
    for offset in range(0, len(ids) - len(ids) % BLOCK_TOKENS, BLOCK_TOKENS):
        key = _chain(key, _ids(ids[offset : offset + BLOCK_TOKENS]))
        keys.append(PrefixKey(key, start_tokens + offset + BLOCK_TOKENS))
    return keys


def block_keys(ids: list[int], space: str) -> list[str]:
    """The chained keys of the whole 64-token blocks of `ids`, read as a raw prompt in `space` (the same chain
    `prefix_keys` makes for a prompt): what a KV payload (nodes.agent.engine.kv_payload) names its blocks by."""
    return [key.key for key in _blocks(ids, _chain("", space.encode()), 0)]


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    # Stripped: the head records an answer as streamed (often with a leading space), and clients commonly send it
    # back trimmed; both must give the same key, or a conversation's next turn never matches its own answer.
    return f"{message.get('role', '')}\x1e{content.strip()}\x1e{message.get('tool_calls') or ''}"


def _image_hashes(message: dict[str, Any]) -> bytes:
    content = message.get("content")
    if not isinstance(content, list):
        return b""
    return b"".join(b"\x1d" + str((part.get("image") or {}).get("sha256", "")).encode()
                    for part in content if isinstance(part, dict) and part.get("type") == "image")


def prefix_keys(*, space: str, tokenize: Tokenize, prompt: str | None = None,
                messages: list[dict] | None = None) -> list[PrefixKey]:
    """The chain of keys for a prompt or a chat, in order. `space`: what the keys are scoped by (the model, its
    adapters and the tokenizer's fingerprint), folded into the first key."""
    root = _chain("", space.encode())
    if prompt is not None:
        return _blocks(tokenize(prompt), root, 0)
    keys: list[PrefixKey] = []
    key, tokens = root, 0
    for message in messages or []:
        ids = tokenize(_message_text(message))
        # A message's images (by hash) key it too, so a chat with another image never matches; their tokens are the
        # projector's, unknown here, so the counts cover the text alone.
        images = _image_hashes(message)
        start = _chain(key, images) if images else key
        keys.extend(_blocks(ids, start, tokens))  # a long message's blocks: a shared head of it still matches
        key = _chain(start, b"\x1e" + _ids(ids))
        tokens += len(ids)
        keys.append(PrefixKey(key, tokens))
    return keys


def named_key(*, space: str, name: str) -> PrefixKey:
    """The key of a prefix its client named (`prompt_cache_key`, scoped by the caller to its API key), in `space` as
    the prompt's own keys are. It covers no tokens: it says where that name's generations ran, not what they read."""
    return PrefixKey(_chain(_chain("", space.encode()), b"\x1bnamed\x1f" + name.encode()), 0)
