"""A prompt prefix's KV cache as bytes that can leave the node: a versioned JSON header, the engine's raw cells, and a
checksum over both (docs/protocol.md, *KV payloads*).

    offset 0   magic  b"FLKV"
           4   u16    version (1)
           6   u32    header length H
          10   u64    data length D
          18   H bytes  header: UTF-8 JSON object (KvHeader)
        18+H   D bytes  data: the engine's cells (llama.cpp: one sequence's state, as llama_state_seq_get_data writes)
      18+H+D   32 bytes SHA-256 of every byte before it

All integers little-endian. The checksum finds a cut or damaged payload; it authenticates nothing (the channel that
carries the payload does). What the header claims is checked by the importer against itself (model, KV type) and
against its own token ids (the block hashes), so a payload whose checksum holds can still be refused.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from nodes.link.codes import KvRefusal

MAGIC = b"FLKV"
VERSION = 1
_FIXED = struct.Struct("<4sHIQ")  # magic, version, header length, data length
CHECKSUM_BYTES = 32
MAX_HEADER_BYTES = 8 << 20  # a header is JSON ids: ~7 bytes a token, so this holds over a million tokens


class PayloadError(Exception):
    """A payload that cannot be read as one: `reason` is a KvRefusal."""

    def __init__(self, reason: KvRefusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class KvHeader:
    """What a payload says about its cells. `model`: the model file's fingerprint (nodes.agent.gguf_info); `kv`: the
    K and V cache types; `tokens`: the prefix's token ids, whole 64-token blocks; `blocks`: their chained keys in
    `space` (nodes.link.prefix.block_keys)."""

    model: str
    engine: str
    kv: dict[str, str]
    space: str
    tokens: list[int]
    blocks: list[str]
    engine_version: str = ""
    tokenizer: str = ""
    n_layer: int = 0
    n_ctx: int = 0  # the exporter's per-lane window (what it could hold, not what this prefix needs)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> KvHeader:
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or not {"model", "engine", "kv", "space", "tokens", "blocks"} <= set(data):
            raise PayloadError(KvRefusal.CORRUPT, "the payload's header lacks model, engine, kv, space, tokens or "
                               "blocks")
        header = cls(**{k: v for k, v in data.items() if k in names})
        if not (isinstance(header.tokens, list) and all(type(t) is int for t in header.tokens)
                and isinstance(header.blocks, list) and all(isinstance(b, str) for b in header.blocks)
                and isinstance(header.kv, dict) and isinstance(header.space, str)):
            raise PayloadError(KvRefusal.CORRUPT, "the payload's header has tokens, blocks, kv or space of a wrong "
                               "type")
        return header


def encode(header: KvHeader, data: bytes | bytearray | memoryview) -> bytes:
    """The payload of `header` and the engine's cells `data`."""
    head = json.dumps(asdict(header), separators=(",", ":")).encode()
    body = b"".join((_FIXED.pack(MAGIC, VERSION, len(head), len(data)), head, data))
    return body + hashlib.sha256(body).digest()


def decode(payload: bytes | bytearray | memoryview) -> tuple[KvHeader, memoryview]:
    """The header and a view of the cells; raises PayloadError (corrupt, unsupported) for anything else."""
    view = memoryview(payload).cast("B")
    if len(view) < _FIXED.size + CHECKSUM_BYTES:
        raise PayloadError(KvRefusal.CORRUPT, f"a KV payload is at least {_FIXED.size + CHECKSUM_BYTES} bytes, "
                           f"this one {len(view)}")
    magic, version, head_len, data_len = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise PayloadError(KvRefusal.CORRUPT, "not a KV payload (its first bytes are not FLKV)")
    if version != VERSION:
        raise PayloadError(KvRefusal.UNSUPPORTED, f"KV payload version {version}; this node reads version {VERSION}")
    if head_len > MAX_HEADER_BYTES or len(view) != _FIXED.size + head_len + data_len + CHECKSUM_BYTES:
        raise PayloadError(KvRefusal.CORRUPT, f"the payload is {len(view)} bytes, not the {_FIXED.size} + {head_len} + "
                           f"{data_len} + {CHECKSUM_BYTES} its lengths say (cut short?)")
    end = len(view) - CHECKSUM_BYTES
    if hashlib.sha256(view[:end]).digest() != view[end:]:
        raise PayloadError(KvRefusal.CORRUPT, "the payload's checksum does not match its bytes")
    try:
        data = json.loads(bytes(view[_FIXED.size : _FIXED.size + head_len]))
    except ValueError as exc:
        raise PayloadError(KvRefusal.CORRUPT, f"the payload's header is not JSON: {exc}") from None
    return KvHeader.from_json(data), view[_FIXED.size + head_len : end]
