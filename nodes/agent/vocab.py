"""A model's tokenizer, the same on the head and the node: its fingerprint, a metadata-only copy, and tokenizing.

The fingerprint is the sha256 of every `tokenizer.ggml.*` key of the GGUF (the tokenizer model and pre-tokenizer,
tokens, merges, token types, scores, special token ids), each hashed as its name and its value's bytes exactly as
the file stores them, in name order. Two files with the same fingerprint split any text into the same token ids.

A metadata-only GGUF is the file's header with every key and no tensor (about a megabyte for a 50k vocabulary):
what a node sends the head for a model the head's registry does not store, and what llama.cpp loads with
`vocab_only`. Its keys are copied byte for byte, so its fingerprint is the model's by construction.

Builtin tokenizers need no file: `mock` (the mock engine's own word pieces) and, for an engine that reports no
tokenizer at all, `bytes` (UTF-8 bytes as ids). Django-free: the head and the node both use it.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import threading
import zlib
from collections.abc import Callable
from typing import Any

MOCK = "mock"
BYTES = "bytes"
BUILTIN = (MOCK, BYTES)
TOKENIZER_PREFIX = "tokenizer.ggml."
ALIGNMENT = 32


class VocabError(Exception):
    """The file's tokenizer cannot be read or loaded; the message says why."""


def _kv_spans(path: str | os.PathLike) -> list[tuple[str, bytes]]:
    """Every key of the GGUF at `path`, as (name, its bytes as stored: key, type and value), in file order."""
    from nodes.agent.gguf_info import GgufError, _reader

    try:
        reader = _reader(path, os.path.getsize(path))
    except (GgufError, ValueError, IndexError, KeyError, OverflowError, TypeError, OSError) as exc:
        raise VocabError(f"cannot read the GGUF header of {os.fspath(path)!r}: {exc}") from None
    spans = []
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue  # the reader's own pseudo-fields (version, counts)
        value_at = field.offset + 8 + len(field.name.encode()) + 4
        size = reader._get_field_parts(value_at, int(field.types[0]))[0]
        spans.append((field.name, bytes(reader.data[field.offset:value_at + size])))
    return spans


def fingerprint_of_spans(spans: list[tuple[str, bytes]]) -> str:
    digest = hashlib.sha256()
    for _, raw in sorted(s for s in spans if s[0].startswith(TOKENIZER_PREFIX)):
        digest.update(len(raw).to_bytes(8, "little") + raw)
    return digest.hexdigest() if any(n.startswith(TOKENIZER_PREFIX) for n, _ in spans) else ""


def tokenizer_fingerprint(path: str | os.PathLike) -> str:
    """The fingerprint of the GGUF's tokenizer; "" when the file has none (a LoRA adapter)."""
    return fingerprint_of_spans(_kv_spans(path))


def vocab_gguf(path: str | os.PathLike) -> bytes:
    """The GGUF at `path` with all its keys and no tensor: enough for llama.cpp to load its vocabulary."""
    spans = _kv_spans(path)
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, len(spans)) + b"".join(raw for _, raw in spans)
    return body + b"\0" * (-len(body) % ALIGNMENT)


class Vocab:
    """A vocabulary-only llama.cpp model, loaded on first use. Tokenizing is serialised by a lock: llama.cpp's
    tokenizer keeps caches inside the vocabulary, and the head tokenizes from several threads."""

    def __init__(self, path: str | os.PathLike, fingerprint: str) -> None:
        self.path, self.fingerprint = os.fspath(path), fingerprint
        self.inline = False  # tokenizing may take milliseconds (loading longer): an event loop uses a thread
        self._lock = threading.Lock()
        self._llama: Any = None

    def tokenize(self, text: str) -> list[int]:
        with self._lock:
            if self._llama is None:
                self._llama = _load(self.path)
            return self._llama.tokenize(text.encode(), False, True)  # no BOS; special tokens as such


def _load(path: str) -> Any:
    # llama-cpp-python's model alone: `Llama` would also make a context (a KV cache) that tokenizing never uses.
    import llama_cpp
    from llama_cpp._internals import LlamaModel

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    try:
        return LlamaModel(path_model=path, params=params, verbose=False)
    except (ValueError, RuntimeError) as exc:
        raise VocabError(f"llama.cpp cannot load the vocabulary in {path!r}: {exc}") from None


class Builtin:
    """A tokenizer that needs no file: cheap enough to run on an event loop."""

    inline = True

    def __init__(self, fingerprint: str, tokenize: Callable[[str], list[int]]) -> None:
        self.fingerprint, self.tokenize = fingerprint, tokenize


MOCK_PIECE = re.compile(r"\s*\S+|\s+")  # the mock engine's pieces: each word with its leading white space


def mock_token_id(piece: str) -> int:
    return zlib.crc32(piece.encode()) % 1_000_000 + 1  # 0 is the end-of-generation token


def mock_tokenize(text: str) -> list[int]:
    """The mock engine's tokenizer (word pieces, each with its leading spaces): the head keys prompts with it too."""
    return [mock_token_id(piece) for piece in MOCK_PIECE.findall(text)]


BUILTINS = {MOCK: Builtin(MOCK, mock_tokenize), BYTES: Builtin(BYTES, lambda text: list(text.encode()))}


def tokenizer_of(info: dict[str, Any]) -> Builtin | Vocab:
    """The tokenizer of an engine, from its info (`tokenizer`: its fingerprint; `model_path`: its GGUF file)."""
    fingerprint = info.get("tokenizer") or BYTES
    if fingerprint in BUILTINS:
        return BUILTINS[fingerprint]
    return Vocab(info["model_path"], fingerprint)
