"""One generation's bookkeeping while it runs: stop strings, token batching, usage and timings.

Shared by the llama.cpp engine and the mock, so both stream, stop and account the same way.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nodes.agent.engine.base import tokens_event
from nodes.link.messages import Done, TokenBatch
from nodes.link.spec import GenerateSpec
from nodes.link.thinking import ThinkingTokens

# (token id, text, logprob entry or None)
Token = tuple[int, str, dict[str, Any] | None]


def stop_cut(text: str, stops: list[str]) -> tuple[int | None, int]:
    """Where `text` must end because of a stop string, and how much of it is safe to release.

    Returns (index of the earliest complete stop string or None, length of the prefix that cannot be
    the start of a stop string). Text past the safe length might still grow into a stop string, so it
    is held back until the next token settles it.
    """
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    if found:
        cut = min(found)
        return cut, cut
    safe = len(text)
    for stop in stops:
        # The longest suffix of `text` that is a proper prefix of `stop` starts the held-back part.
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                safe = min(safe, len(text) - k)
                break
    return None, safe


@dataclass
class Run:
    """A generation from submit to done. Times are `time.perf_counter()` seconds."""

    spec: GenerateSpec
    tokens: list[int]  # everything the model reads: the rendered prompt plus the resume tokens
    submitted_at: float
    flush_tokens: int = 4
    flush_s: float = 0.030
    sampler: Any = None  # engine-specific sampling state
    lane: int | None = None
    cached_tokens: int = 0
    evicted: list[str] = field(default_factory=list)
    prefill_started_at: float | None = None
    first_token_at: float | None = None
    completion_tokens: int = 0
    next_token: int | None = None  # sampled, not yet read into the KV cache
    seq: int = 1
    finished: bool = False
    stop_index: int | None = None  # the stop string that ended it, by its place in spec.stop
    adapters: tuple = ()  # its LoRA adapter set (an AdapterKey); lanes of other sets never share its steps
    # its thinking so far, while a thinking budget holds it (spec.thinking_budget; never with a grammar, which the
    # forced tokens might not follow), and the tokens that end it, read after next_token (see end_thinking)
    thinking: ThinkingTokens | None = None
    forced: list[int] = field(default_factory=list)
    _held: list[Token] = field(default_factory=list)  # may still become a stop string
    _out: list[Token] = field(default_factory=list)  # settled, waiting for the next flush
    _out_since: float = 0.0
    _decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))

    def __post_init__(self) -> None:
        spec = self.spec
        if spec.thinking_budget > 0 and spec.grammar is None and spec.json_schema is None:
            self.thinking = ThinkingTokens()

    @property
    def gen_id(self) -> str:
        return self.spec.gen_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens)

    def continue_after(self, resumed: list[bytes]) -> None:
        """A generation resumed from another node's tokens: their bytes go through the decoder, so a character
        they left unfinished is completed by this node's first token instead of turning into U+FFFD; and their
        thinking counts toward its budget."""
        for piece in resumed:
            text = self._decoder.decode(piece)
            if self.thinking is not None:
                self.thinking.feed([text])

    def thinking_due(self) -> bool:
        """Its thinking has used its budget without closing: end_thinking is due."""
        thinking = self.thinking
        return thinking is not None and thinking.state == "thinking" and thinking.count >= self.spec.thinking_budget

    def end_thinking(self, ids: list[int], piece: Callable[[int], bytes], now: float) -> bool:
        """Budget forcing: `ids` (the engine's tokens of THINK_END, already fed to the sampler; none when they do
        not fit the window) are streamed as its tokens and read after the next one, so the model answers from
        there. Once only. True when a stop string ended it in them."""
        self.thinking, self.forced = None, list(ids)
        return any(self.add_token(token_id, piece(token_id), None, now) for token_id in ids)

    def take_forced(self) -> list[int]:
        forced, self.forced = self.forced, []
        return forced

    def add_token(self, token_id: int, piece: bytes, logprob: dict[str, Any] | None, now: float) -> bool:
        """Take one sampled token; returns True when a stop string ended the generation."""
        if self.first_token_at is None:
            self.first_token_at = now
        self.completion_tokens += 1
        text = self._decoder.decode(piece)
        if self.thinking is not None:
            self.thinking.feed([text])
        if not self.spec.stop:
            self._settle([(token_id, text, logprob)], now)
            return False
        self._held.append((token_id, text, logprob))
        held = "".join(t[1] for t in self._held)
        cut, safe = stop_cut(held, self.spec.stop)
        if cut is not None:  # which one: Anthropic's Messages API answers with it (stop_sequence)
            self.stop_index = next(i for i, stop in enumerate(self.spec.stop) if held.find(stop) == cut)
        self._release_upto(cut if cut is not None else safe, now, truncate=cut is not None)
        return cut is not None

    def release_all(self, now: float) -> None:
        """The generation ends without a stop string: nothing held back can become one any more."""
        tail = self._decoder.decode(b"", final=True)
        if tail and (self._held or self._out):
            last = self._held or self._out
            token_id, text, logprob = last[-1]
            last[-1] = (token_id, text + tail, logprob)
        self._settle(self._held, now)
        self._held = []

    def _release_upto(self, limit: int, now: float, truncate: bool) -> None:
        """Settle the held tokens that end within the first `limit` characters of the held text.

        With `truncate` (a stop string starts at `limit`) the token that straddles it keeps only its
        text before the stop string and everything after it is dropped.
        """
        released: list[Token] = []
        offset = 0
        for index, (token_id, text, logprob) in enumerate(self._held):
            end = offset + len(text)
            if end <= limit:
                released.append((token_id, text, logprob))
            elif truncate:
                if limit > offset:
                    released.append((token_id, text[: limit - offset], logprob))
                self._held = []
                break
            else:
                self._held = self._held[index:]
                break
            offset = end
        else:
            self._held = []
        self._settle(released, now)

    def _settle(self, tokens: list[Token], now: float) -> None:
        if tokens and not self._out:
            self._out_since = now
        self._out.extend(tokens)

    def take_batch(self, now: float, force: bool = False) -> TokenBatch | None:
        """A `tokens` event when a flush is due (enough tokens, or the oldest waited long enough)."""
        if not self._out:
            return None
        if not force and len(self._out) < self.flush_tokens and now - self._out_since < self.flush_s:
            return None
        out, self._out = self._out, []
        want_logprobs = self.spec.logprobs
        event = tokens_event(
            self.gen_id,
            self.seq,
            [t[1] for t in out],
            [t[0] for t in out],
            [t[2] or {} for t in out] if want_logprobs else None,
        )
        self.seq += 1
        return event

    def done_event(self, finish_reason: str, now: float) -> Done:
        first = self.first_token_at
        decode_s = now - first if first is not None else 0.0
        prefill_from = self.prefill_started_at if self.prefill_started_at is not None else self.submitted_at
        return Done(
            gen_id=self.gen_id,
            seq=self.seq,
            finish_reason=finish_reason,
            usage={
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens,
                **({"stop_index": self.stop_index} if self.stop_index is not None else {}),
            },
            timings={
                "ttft_ms": round((first - self.submitted_at) * 1000, 3) if first is not None else None,
                "prompt_ms": round((first - prefill_from) * 1000, 3) if first is not None else None,
                "decode_tps": round((self.completion_tokens - 1) / decode_s, 3) if decode_s > 0 else 0.0,
                "total_ms": round((now - self.submitted_at) * 1000, 3),
            },
            lane=-1 if self.lane is None else self.lane,  # -1: it ended before it had a lane (deadline)
            evicted=list(self.evicted),
        )


def clock() -> float:
    return time.perf_counter()
