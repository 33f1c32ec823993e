"""A lane's prompt prefix leaving the node and arriving on another: export and import of its KV cache (issue 53).

Prefixes move as whole 64-token blocks, as the head's prefix index keys prompts (nodes.link.prefix): an export is
the longest run of whole blocks of the asked prefix that one lane holds, as a payload (nodes.agent.engine.kv_payload)
naming the model file, the KV type, the token ids and their block keys; an import checks all of them against this
engine and the ids themselves before the cells go into a free lane, which then holds that prefix as if it had read it
(a generation that starts with it reads only the rest). Anything that disagrees is refused with a KvRefusal, and the
lane it would have gone to is left as it was, or empty. The engines supply the cells (`_kv_read`, `_kv_write`) and
what they are (`_kv_identity`); both run on the worker's thread, between steps.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import Any

from nodes.agent.engine.base import StateOpError
from nodes.agent.engine.kv_payload import KvHeader, PayloadError, decode, encode
from nodes.agent.engine.runs import clock
from nodes.agent.engine.scheduler import Lane, LaneEngine, common_prefix
from nodes.link.codes import ErrorCode, KvRefusal
from nodes.link.prefix import BLOCK_TOKENS, block_keys

KV_OPS = ("kv_export", "kv_import")

# What the importer compares with its own: the cells mean the same only on the same model file and KV type.
IDENTITY_CHECKS = (("model", KvRefusal.MODEL_MISMATCH), ("engine", KvRefusal.MODEL_MISMATCH),
                   ("kv", KvRefusal.KV_TYPE_MISMATCH))


def refused(reason: KvRefusal, message: str) -> dict[str, Any]:
    return {"ok": False, "reason": reason.value, "message": message}


class KvTransferEngine(LaneEngine):
    """A lane engine whose lanes' prompt prefixes can be exported and imported."""

    @abstractmethod
    def _kv_identity(self) -> dict[str, Any]:
        """What a payload's cells were computed with: `model` (the file's fingerprint), `engine`, `kv` (types), and
        for the header `engine_version`, `tokenizer`, `n_layer`."""

    @abstractmethod
    def _kv_read(self, lane: Lane, n: int) -> bytes | None:
        """The cells of the lane's first `n` tokens; None when its cache does not hold them (a copy still queued).
        Raises PayloadError (unsupported) for a cache it cannot cut."""

    @abstractmethod
    def _kv_write(self, lane: Lane, data: memoryview, header: KvHeader) -> dict[str, Any] | None:
        """Put a payload's cells into the empty `lane`; a refusal (the lane left empty) when they do not fit."""

    # -- export ---------------------------------------------------------------------------------------

    def export_prefix(self, tokens: list[int] | None = None, blocks: list[str] | None = None,
                      space: str | None = None) -> dict[str, Any]:
        """The payload of the longest whole-block prefix of `tokens` (or of the block keys `blocks`, in `space`) that
        a lane holds: {"ok": True, "payload", "tokens", "bytes", "lane", "ms"}, or a `not_held` refusal."""
        started = time.perf_counter()
        identity = self._kv_identity()
        space = space or identity["model"]
        for lane, n in self._holding(tokens, blocks, space):
            try:
                data = self._kv_read(lane, n)
            except PayloadError as exc:
                return refused(exc.reason, exc.message)
            if data is None:
                continue
            ids = lane.tokens[:n]
            header = KvHeader(space=space, tokens=ids, blocks=block_keys(ids, space), n_ctx=self.window, **identity)
            payload = encode(header, data)
            return {"ok": True, "payload": payload, "tokens": n, "bytes": len(payload), "lane": lane.index,
                    "ms": round((time.perf_counter() - started) * 1000, 3)}
        return refused(KvRefusal.NOT_HELD, "no lane holds a whole 64-token block of that prefix")

    def _holding(self, tokens: list[int] | None, blocks: list[str] | None, space: str) -> list[tuple[Lane, int]]:
        """The lanes that hold a whole block of the prefix, with how many of its tokens, most first."""
        held = []
        for lane in self.lanes:
            if lane.adapters:  # computed under a LoRA adapter set: nothing another node's base model can read
                continue
            ids = lane.tokens[: next((i for i, t in enumerate(lane.tokens) if t < 0), len(lane.tokens))]  # no images
            if blocks is not None:
                keys = block_keys(ids, space)
                n = common_prefix(keys, list(blocks)) * BLOCK_TOKENS
            else:
                n = common_prefix(ids, list(tokens or [])) // BLOCK_TOKENS * BLOCK_TOKENS
            if n:
                held.append((lane, n))
        return sorted(held, key=lambda item: -item[1])

    # -- import ---------------------------------------------------------------------------------------

    def import_prefix(self, payload: bytes, holder: str | None = None) -> dict[str, Any]:
        """Check `payload` against this engine and put its cells into a free lane: {"ok": True, "lane", "tokens",
        "ms"} (`already_held` when a lane had it), or a refusal with its reason. `holder`: the generation the head
        moves it for, whose eviction the node reports like any other's."""
        started = time.perf_counter()
        try:
            header, data = decode(payload)
        except PayloadError as exc:
            return refused(exc.reason, exc.message)
        refusal = self._check(header)
        if refusal is not None:
            return refusal
        n = len(header.tokens)
        for lane in self.lanes:
            if not lane.adapters and common_prefix(lane.tokens, header.tokens) == n:
                return {"ok": True, "lane": lane.index, "tokens": n, "already_held": True, "ms": 0.0}
        lane = self._import_lane()
        if lane is None:
            return refused(KvRefusal.NO_FREE_LANE, "every lane is running a generation; import when one is free")
        self._empty(lane)
        refusal = self._kv_write(lane, data, header)
        if refusal is not None:
            return refusal
        lane.tokens, lane.adapters, lane.last_used = list(header.tokens), (), clock()
        lane.holders = [(holder, n)] if holder else []
        self._lane_idle(lane)
        return {"ok": True, "lane": lane.index, "tokens": n, "ms": round((time.perf_counter() - started) * 1000, 3)}

    def _check(self, header: KvHeader) -> dict[str, Any] | None:
        """A refusal when the payload's cells do not belong here, or its ids do not give the blocks it names."""
        identity = self._kv_identity()
        for name, reason in IDENTITY_CHECKS:
            if getattr(header, name) != identity[name]:
                return refused(reason, f"the payload's {name} is {getattr(header, name)!r}, this node's "
                               f"{identity[name]!r}")
        n = len(header.tokens)
        if not n or n % BLOCK_TOKENS or min(header.tokens) < 0:
            return refused(KvRefusal.TOKENS_MISMATCH, f"the payload holds {n} tokens, not whole 64-token blocks of "
                           "token ids")
        if block_keys(header.tokens, header.space) != header.blocks:
            return refused(KvRefusal.TOKENS_MISMATCH, "the payload's token ids do not give the block keys it names")
        if n >= self.window:
            return refused(KvRefusal.TOO_LONG, f"the prefix is {n} tokens; this node's lanes hold {self.window}")
        return None

    def _import_lane(self) -> Lane | None:
        """The free lane an import goes to: an empty one, else the least recently used; never a lane that a queued
        prefix copy still reads from."""
        free = [lane for lane in self.lanes if lane.run is None and lane.index not in self._copy_sources]
        return min(free, key=lambda lane: (bool(lane.tokens), lane.last_used), default=None)

    def _empty(self, lane: Lane) -> None:
        """Forget what `lane` held; its holders go to the head as evicted with the next accepted generation."""
        self._lost += [gen_id for gen_id, _ in lane.holders]
        self._trim_lane(lane, 0)
        lane.tokens, lane.holders, lane.adapters = [], [], ()

    # -- the state operations -------------------------------------------------------------------------

    def kv_state_op(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """`kv_export` {tokens | blocks [, space]} and `kv_import` {payload [, holder]}, through the worker's pipe."""
        if op == "kv_export":
            tokens, blocks = args.get("tokens"), args.get("blocks")
            if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)) and \
                    not (isinstance(blocks, list) and all(isinstance(b, str) for b in blocks)):
                raise StateOpError(ErrorCode.INVALID_REQUEST, "kv_export needs `tokens` (ids) or `blocks` (keys)")
            return self.export_prefix(tokens=tokens, blocks=blocks if tokens is None else None,
                                      space=args.get("space") or None)
        payload = args.get("payload")
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise StateOpError(ErrorCode.INVALID_REQUEST, "kv_import needs `payload`, the bytes kv_export answered")
        holder = args.get("holder")
        return self.import_prefix(payload, holder=str(holder) if holder else None)
