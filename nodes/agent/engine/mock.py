"""A mock engine with the llama engine's interface, lanes and prefix cache, for routing tests and benchmarks.

Text is deterministic (a cycle of words picked by a hash of the prompt and seed), tokens are whitespace
words, and the configured costs are really spent: each step sleeps one decode step (1 / `decode_tps`, plus
`decode_slowdown_ms` for each decoding lane past the first) plus `prefill_ms_per_token` for every prompt token it
reads, so cached tokens really are cheaper and a busy node really is slower. A lane's prefix exported or imported
(nodes.agent.engine.kv_transfer) costs `kv_ms_per_token` a token each way, and its cells are `kv_bytes_per_token` a
token (the token's id, then zeros), which an import checks as llama.cpp checks its own.
"""

from __future__ import annotations

import json
import math
import os
import time
import zlib
from dataclasses import dataclass, field, fields
from typing import Any

from nodes.agent.engine.base import (
    EngineConfig,
    EngineError,
    StateOpError,
)
from nodes.agent.engine.kv_payload import KvHeader
from nodes.agent.engine.kv_transfer import KV_OPS, KvTransferEngine, refused
from nodes.agent.engine.runs import Run
from nodes.agent.engine.scheduler import Lane, Sample, Work
from nodes.agent.vocab import MOCK, MOCK_PIECE, mock_token_id
from nodes.link.codes import ErrorCode, KvRefusal
from nodes.link.device import DeviceReport
from nodes.link.spec import GenerateSpec

EOG_ID = 0
DEFAULT_WORDS = [
    "the",
    "fleet",
    "serves",
    "every",
    "lane",
    "with",
    "tokens",
    "from",
    "a",
    "small",
    "model",
    "while",
    "the",
    "head",
    "routes",
]


@dataclass
class MockParams:
    """The mock's knobs (EngineConfig.mock holds them as a dict)."""

    decode_tps: float = 200.0  # decode steps a second with one lane decoding (a step gives every busy lane a token)
    decode_slowdown_ms: float = 0.0  # what each further decoding lane adds to a step (batching is not free)
    prefill_ms_per_token: float = 0.2  # cost of reading one uncached prompt token
    context_window: int | None = None  # default: EngineConfig.max_context or 2048
    words: list[str] = field(default_factory=lambda: list(DEFAULT_WORDS))
    eog_after: int | None = None  # end with an end-of-generation token after this many tokens
    abort_on: str | None = None  # a prompt containing this kills the process (simulates a llama.cpp abort)
    load_s: float = 0.0  # pretend loading takes this long (reports progress)
    embedding_dim: int = 8
    engine_version: str = "mock-1"
    kv_bytes_per_token: int = 64  # a prefix's payload size (at least the 4 bytes of its id); llama.cpp's is ~23 KB
    kv_ms_per_token: float = 0.0  # what exporting, and again importing, a prefix costs a token
    # what it says it runs on (a nodes.link.device report), standing in for a GPU node's; default: the CPU
    device: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MockParams:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown mock engine parameters: {', '.join(sorted(unknown))}")
        return cls(**data)


class MockEngine(KvTransferEngine):
    """Deterministic, really-timed stand-in for the llama engine."""

    engine_name = "mock"

    def __init__(self, config: EngineConfig, on_progress: Any = None) -> None:
        self.params = MockParams.from_dict(config.mock or {})
        window = self.params.context_window or config.max_context or 2048
        super().__init__(config, window, config.n_batch)
        self._pieces: dict[int, str] = {}
        self._load(on_progress)

    def _load(self, on_progress: Any) -> None:
        steps = 5
        for i in range(1, steps + 1):
            time.sleep(self.params.load_s / steps)
            if on_progress is not None:
                on_progress(i / steps)

    def info(self) -> dict[str, Any]:
        return {
            "model_name": self.config.model_name or "mock",
            "context_window": self.window,
            "lanes": len(self.lanes),
            "capabilities": {
                "chat": True,
                "completion": True,
                "embeddings": True,
                "grammar": True,
                "logprobs": True,
                "lora": False,
                "batch_invariant": self.config.batch_invariant,
            },
            "engine": "mock",
            "engine_version": self.params.engine_version,
            "tokenizer": MOCK,
            "device": self.device(),
        }

    def device(self) -> dict[str, Any]:
        if self.params.device is not None:
            return dict(self.params.device)
        return DeviceReport("cpu", host_gpus=list(self.config.host_gpus)).to_wire()

    def close(self) -> None:
        """Nothing to free."""

    # -- text -----------------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for piece in MOCK_PIECE.findall(text):
            token_id = mock_token_id(piece)
            self._pieces[token_id] = piece
            ids.append(token_id)
        return ids

    def render(self, spec: GenerateSpec) -> str:
        if spec.messages is None:
            return spec.prompt or ""
        parts = [f"<|{m.get('role', 'user')}|> {m.get('content') or ''}\n" for m in spec.messages]
        return "".join(parts) + "<|assistant|>"

    # -- LaneEngine hooks -----------------------------------------------------------------------------

    def _prepare(self, spec: GenerateSpec, submitted_at: float) -> Run:
        _validate(spec)
        text = self.render(spec)
        if self.params.abort_on and self.params.abort_on in text:
            os.abort()
        resume = list(spec.resume_ids) or self.tokenize(spec.resume_text)
        tokens = self.tokenize(text) + resume
        if len(tokens) + 1 > self.window:
            raise EngineError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt is {len(tokens)} tokens and this model's context window is {self.window} tokens; "
                "shorten the prompt",
            )
        # a resumed generation goes on with the words after the ones another node already sent
        start = (zlib.crc32(f"{spec.seed}|{text}".encode()) + len(resume)) % len(self.params.words)
        return self._new_run(spec, tokens, submitted_at, start)

    def _trim_lane(self, lane: Lane, keep: int) -> None:
        """The mock's cache is just `lane.tokens`."""

    def _copy_lane(self, source: Lane, lane: Lane, keep: int) -> None:
        """Free: the mock's cache is `lane.tokens` (the llama engine's copy is a KV buffer copy, far cheaper than
        reading the tokens; see docs/architecture.md)."""

    def _swap_lanes(self, a: Lane, b: Lane) -> bool:
        """Free too: the scheduler swaps the lanes' token lists."""
        return True

    def _decode(self, works: list[Work]) -> dict[int, Sample]:
        prefill = [w for w in works if w.lane.run is not None and len(w.lane.tokens) < len(w.lane.run.tokens)]
        read = sum(len(w.tokens) for w in prefill)
        decoding = len(works) - len(prefill)
        step = 1 / self.params.decode_tps + (decoding - 1) * self.params.decode_slowdown_ms / 1000 if decoding else 0.0
        time.sleep(read * self.params.prefill_ms_per_token / 1000 + step)
        samples: dict[int, Sample] = {}
        for work in works:
            run = work.lane.run
            if work.sample and run is not None:
                samples[work.lane.index] = self._next(run)
        return samples

    def _next(self, run: Run) -> Sample:
        n = run.completion_tokens
        if self.params.eog_after is not None and n >= self.params.eog_after and not run.spec.ignore_eos:
            return EOG_ID, None
        words = self.params.words
        piece = " " + words[(run.sampler + n) % len(words)]
        token_id = mock_token_id(piece)
        self._pieces[token_id] = piece
        logprob = None
        if run.spec.logprobs:
            top = [{"token": piece, "logprob": -0.25}, {"token": " and", "logprob": -1.75}][: run.spec.top_logprobs]
            logprob = {"token": piece, "logprob": -0.25, "top": top}
        return token_id, logprob

    def _forced(self, run: Run, text: str, room: int) -> list[int]:
        ids = self.tokenize(text)
        return ids if len(ids) <= room else []

    def _piece(self, token_id: int) -> bytes:
        return self._pieces.get(token_id, "").encode()

    def _is_eog(self, token_id: int) -> bool:
        return token_id == EOG_ID

    # -- prefixes leaving and arriving -----------------------------------------------------------------

    def _kv_identity(self) -> dict[str, Any]:
        return {"model": f"mock:{self.config.model_name or 'mock'}", "engine": "mock",
                "kv": {"type_k": "mock", "type_v": "mock"}, "engine_version": self.params.engine_version,
                "tokenizer": MOCK, "n_layer": 0}

    def _kv_read(self, lane: Lane, n: int) -> bytes | None:
        time.sleep(n * self.params.kv_ms_per_token / 1000)
        return self._cells(lane.tokens[:n])

    def _kv_write(self, lane: Lane, data: memoryview, header: KvHeader) -> dict[str, Any] | None:
        time.sleep(len(header.tokens) * self.params.kv_ms_per_token / 1000)
        if data != self._cells(header.tokens):
            return refused(KvRefusal.CORRUPT, "the payload's cells are not the mock's cells of its tokens")
        return None

    def _cells(self, tokens: list[int]) -> bytes:
        width = max(self.params.kv_bytes_per_token, 4)
        return b"".join(token.to_bytes(4, "little", signed=True) + bytes(width - 4) for token in tokens)

    # -- state operations -----------------------------------------------------------------------------

    def state_op(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "tokenize":
            return {"tokens": self.tokenize(str(args.get("text", "")))}
        if op == "embed":
            return {"embeddings": [self._embed(str(text)) for text in args.get("texts", [])]}
        if op == "capabilities":
            return self.info()["capabilities"]
        if op in KV_OPS:
            return self.kv_state_op(op, args)
        raise StateOpError(ErrorCode.UNKNOWN_OP, f"this engine has no state operation {op!r}")

    def _embed(self, text: str) -> list[float]:
        raw = [zlib.crc32(f"{i}|{text}".encode()) / 2**32 - 0.5 for i in range(self.params.embedding_dim)]
        norm = math.sqrt(sum(x * x for x in raw)) or 1.0
        return [x / norm for x in raw]


def _validate(spec: GenerateSpec) -> None:
    """The checks both engines make before a generation gets a lane."""
    if spec.max_tokens < 1:
        raise EngineError(ErrorCode.INVALID_REQUEST, f"max_tokens must be at least 1, got {spec.max_tokens}")
    if spec.prompt is None and not spec.messages:
        raise EngineError(ErrorCode.INVALID_REQUEST, "a generation needs a prompt or at least one message")
    if spec.grammar is not None and "::=" not in spec.grammar:
        raise EngineError(ErrorCode.INVALID_GRAMMAR, "the grammar has no rules (GBNF rules look like: root ::= ...)")
    if spec.json_schema is not None:
        try:
            json.loads(spec.json_schema)
        except ValueError as exc:
            raise EngineError(ErrorCode.INVALID_GRAMMAR, f"json_schema is not valid JSON: {exc}") from exc
