"""The head's tokenizers: each model's own, so placement keys prompts by real token ids (nodes.link.prefix).

A tokenizer is named by its fingerprint (nodes.agent.vocab). Its file is a metadata-only GGUF under
`$FLEET_HOME/tokenizers/<fingerprint>.gguf`, shared by every head process: written from the registry's blob for a
model the registry stores (when a node registers it, or a generation needs it), or sent by the node at join for one
it does not. Each process loads a file once, vocabulary only, and keeps it. The mock engine's tokenizer is builtin;
an engine that reports none is keyed by UTF-8 bytes (`bytes`). Which tokenizer keys a model's prompts: the one the
nodes serving it reported (the most common, if they differ: keys made with another never match its nodes), else the
registry's, else bytes.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import zlib
from collections import Counter
from pathlib import Path

from cachetools import TTLCache
from django.conf import settings

from fleet.links import registry
from nodes.agent.vocab import BUILTINS, BYTES, Builtin, Vocab, VocabError, tokenizer_fingerprint, vocab_gguf
from nodes.blobs import blob_path
from nodes.models import Model

log = logging.getLogger("fleet")

FINGERPRINT_RE = re.compile(r"[0-9a-f]{64}")
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024  # a metadata-only GGUF: a 256k vocabulary is some 10 MB

_lock = threading.Lock()


def _loaded() -> dict[str, Vocab]:
    """The tokenizers this process loaded, by file path (on the registry)."""
    return registry().own("tokenizers", dict)


def _registry_fingerprints() -> TTLCache:
    """Registry models' tokenizer fingerprints, by name, as read in the last 30 s (on the registry)."""
    return registry().own("registry-fingerprints", lambda: TTLCache(maxsize=1024, ttl=30))


class TokenizerRefused(Exception):
    """A tokenizer file a node sent is not the one it named; the message says why."""


def valid_fingerprint(value: object) -> bool:
    return isinstance(value, str) and (value in BUILTINS or bool(FINGERPRINT_RE.fullmatch(value)))


def tokenizer_path(fingerprint: str) -> Path:
    return Path(settings.FLEET_HOME) / "tokenizers" / f"{fingerprint}.gguf"


def tokenizer_known(fingerprint: str) -> bool:
    """The head can tokenize with it: builtin, or its file is here."""
    return fingerprint in BUILTINS or tokenizer_path(fingerprint).exists()


def tokenizer_store(fingerprint: str, data: bytes) -> Path:
    """Keep a tokenizer file a node sent, once its content proves to be the tokenizer it named."""
    target = tokenizer_path(fingerprint)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".part", delete=False) as out:
        out.write(data)
    staged = Path(out.name)
    try:
        got = tokenizer_fingerprint(staged)
    except VocabError as exc:
        staged.unlink(missing_ok=True)
        raise TokenizerRefused(f"the tokenizer file sent for {fingerprint[:12]} is unreadable: {exc}") from None
    if got != fingerprint:
        staged.unlink(missing_ok=True)
        raise TokenizerRefused(f"the tokenizer file sent for {fingerprint[:12]} has fingerprint {got[:12] or 'none'}")
    os.replace(staged, target)  # atomic: another head process reads the whole file or none
    return target


def tokenizer_receive(fingerprint: str, compressed: bytes) -> Path:
    """A tokenizer file as a node sends it (zlib-compressed): unpacked, at most MAX_TOKENIZER_BYTES, and kept."""
    unpacker = zlib.decompressobj()
    try:
        data = unpacker.decompress(compressed, MAX_TOKENIZER_BYTES)
    except zlib.error as exc:
        raise TokenizerRefused(f"the tokenizer file sent for {fingerprint[:12]} is not zlib data: {exc}") from None
    if unpacker.unconsumed_tail or not unpacker.eof:
        raise TokenizerRefused(f"the tokenizer file sent for {fingerprint[:12]} is cut short or over "
                               f"{MAX_TOKENIZER_BYTES} bytes")
    return tokenizer_store(fingerprint, data)


def model_tokenizer(model: Model) -> str:
    """The registry model's tokenizer fingerprint, filled in (with its file) the first time it is asked for, so
    rows added before fingerprints existed get theirs. "" for a file with no tokenizer (an adapter)."""
    if not model.tokenizer:
        fingerprint = tokenizer_fingerprint(blob_path(model.sha256))
        if not fingerprint:
            return ""
        Model.objects.filter(pk=model.pk).update(tokenizer=fingerprint)
        model.tokenizer = fingerprint
    path = tokenizer_path(model.tokenizer)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".part", delete=False) as out:
            out.write(vocab_gguf(blob_path(model.sha256)))
        os.replace(out.name, path)
    return model.tokenizer


def registry_fingerprint(name: str) -> str:
    """The tokenizer of the registry model `name` ("" when the registry has no such model), cached a while."""
    found = _registry_fingerprints().get(name)
    if found is None:
        model = Model.objects.filter(name=name).first()
        try:
            found = model_tokenizer(model) if model is not None else ""
        except VocabError as exc:  # its blob is gone or unreadable: its prompts are keyed as its nodes report
            log.warning("fleet cannot read the tokenizer of registry model %r: %s", name, exc)
            found = ""
        _registry_fingerprints()[name] = found
    return found


def tokenizer_get(fingerprint: str) -> Builtin | Vocab:
    """The tokenizer with this fingerprint (loaded on its first tokenize); bytes when its file is not here."""
    if fingerprint in BUILTINS:
        return BUILTINS[fingerprint]
    path = tokenizer_path(fingerprint)
    with _lock:
        loaded = _loaded()
        vocab = loaded.get(str(path))
        if vocab is None:
            if not path.exists():
                log.warning("fleet has no tokenizer file %s; keying its prompts by bytes", fingerprint[:12])
                return BUILTINS[BYTES]
            vocab = loaded[str(path)] = Vocab(path, fingerprint)
        return vocab


def fingerprint_served(model: str, reported: list[dict[str, str]]) -> str:
    """The fingerprint the nodes serving `model` reported (each node's model -> fingerprint map), the most common
    one when they differ; a `BASE:ADAPTER` name has its base's tokenizer. "" when none reported one."""
    base = model.partition(":")[0]
    counts = Counter(fp for tokenizers in reported for name, fp in tokenizers.items() if name in (model, base) and fp)
    return max(sorted(counts), key=counts.__getitem__) if counts else ""
