"""OpenAI's response and chunk shapes, built from a Run's events.

`ChatShape` and `CompletionShape` each answer three questions: which chunks a token batch becomes (streaming),
which chunks close the stream, and the whole response (non-streaming).
"""

from __future__ import annotations

from typing import Any

from api.generation import Run
from fleet.dispatch import Tokens


def fingerprint(node: str) -> str:
    return f"fleet:{node}" if node else "fleet"


class _Shape:
    object_name = ""
    chunk_name = ""
    id_prefix = ""

    def __init__(self, run: Run):
        self.run = run
        self.request = run.request
        self.id = f"{self.id_prefix}{self.request.gen_id}"

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id, "object": object_name, "created": self.request.created, "model": self.request.spec.model,
            "system_fingerprint": fingerprint(self.run.node), "choices": choices,
        }

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = self._envelope(self.chunk_name, choices)
        if self.request.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope(self.chunk_name, []), "usage": self.run.usage()}

    def closing_chunks(self) -> list[dict[str, Any]]:
        return []


class ChatShape(_Shape):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, run: Run):
        super().__init__(run)
        plan = self.request.tools
        # A reply that may be a tool call is held back until it parses (or clearly does not).
        self.holding = plan is not None
        self.decided = plan is not None and plan.mode != "auto"
        self.held = ""
        self.held_logprobs: list[dict[str, Any]] = []

    def opening_chunks(self) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        return [self.chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])]

    def token_chunks(self, event: Tokens) -> list[dict[str, Any]]:
        logprobs = chat_logprobs(event.pieces, event.logprobs) if self.request.spec.logprobs else None
        if self.holding:
            self.held += event.text
            self.held_logprobs.extend(logprobs or [])
            if self.decided or not self.held.strip():
                return []
            if self.held.lstrip().startswith(("{", "[", "`")):
                self.decided = True
                return []
            self.holding = False  # prose: let it flow
            text, logprobs = self.held, self.held_logprobs or logprobs
        else:
            text = event.text
        if not text:
            return []
        lp = {"content": logprobs, "refusal": None} if logprobs is not None else None
        return [self.chunk([{"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}])]

    def closing_chunks(self) -> list[dict[str, Any]]:
        chunks = []
        calls = self.run.tool_calls()
        if calls:
            deltas = [{"index": i, **call} for i, call in enumerate(calls)]
            chunks.append(self.chunk([{"index": 0, "delta": {"tool_calls": deltas}, "logprobs": None,
                                       "finish_reason": None}]))
        elif self.holding and self.held:
            lp = {"content": self.held_logprobs, "refusal": None} if self.request.spec.logprobs else None
            chunks.append(self.chunk([{"index": 0, "delta": {"content": self.held}, "logprobs": lp,
                                       "finish_reason": None}]))
        chunks.append(self.chunk([{"index": 0, "delta": {}, "logprobs": None,
                                   "finish_reason": self.run.finish_reason()}]))
        return chunks

    def response(self) -> dict[str, Any]:
        calls = self.run.tool_calls()
        message: dict[str, Any] = {"role": "assistant", "content": None if calls else self.run.text, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        logprobs = None
        if self.request.spec.logprobs:
            logprobs = {"content": chat_logprobs(None, self.run.logprobs), "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": self.run.finish_reason()}
        return {**self._envelope(self.object_name, [choice]), "usage": self.run.usage()}


class CompletionShape(_Shape):
    object_name = "text_completion"
    chunk_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, run: Run):
        super().__init__(run)
        self.offset = 0

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def token_chunks(self, event: Tokens) -> list[dict[str, Any]]:
        logprobs = None
        if self.request.spec.logprobs:
            logprobs = completion_logprobs(event.pieces, event.logprobs, self.offset)
        self.offset += len(event.text)
        return [self.chunk([{"index": 0, "text": event.text, "logprobs": logprobs, "finish_reason": None}])]

    def closing_chunks(self) -> list[dict[str, Any]]:
        return [self.chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": self.run.finish_reason()}])]

    def response(self) -> dict[str, Any]:
        logprobs = completion_logprobs(None, self.run.logprobs, 0) if self.request.spec.logprobs else None
        choice = {"index": 0, "text": self.run.text, "logprobs": logprobs, "finish_reason": self.run.finish_reason()}
        return {**self._envelope(self.object_name, [choice]), "usage": self.run.usage()}


def shape_for(run: Run) -> ChatShape | CompletionShape:
    return ChatShape(run) if run.request.kind == "chat" else CompletionShape(run)


# --- logprobs -------------------------------------------------------------------------------------------------


def _entries(pieces: list[str] | None,
             logprobs: list[dict[str, Any]] | None) -> list[tuple[str, float, list, list[int]]]:
    out = []
    for i, entry in enumerate(logprobs or []):
        entry = entry or {}
        token = entry.get("token")
        if token is None:
            token = pieces[i] if pieces and i < len(pieces) else ""
        out.append((token, float(entry.get("logprob", 0.0)), entry.get("top") or [], _bytes(entry, token)))
    return out


def chat_logprobs(pieces: list[str] | None, logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI chat logprobs content: token, logprob, bytes and top_logprobs per token."""
    return [
        {"token": token, "logprob": lp, "bytes": raw,
         "top_logprobs": [{"token": t.get("token", ""), "logprob": float(t.get("logprob", 0.0)),
                           "bytes": _bytes(t, str(t.get("token", "")))} for t in top]}
        for token, lp, top, raw in _entries(pieces, logprobs)
    ]


def _bytes(entry: dict[str, Any], token: str) -> list[int]:
    """The node's raw bytes for a token where it sent them (a piece of a character does not survive as
    text), else the text's own."""
    raw = entry.get("bytes")
    if isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw):
        return raw
    return list(token.encode())


def completion_logprobs(pieces: list[str] | None, logprobs: list[dict[str, Any]] | None,
                        offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists of tokens, logprobs, top alternatives and text offsets."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token, lp, top, _raw in _entries(pieces, logprobs):
        tokens.append(token)
        token_logprobs.append(lp)
        tops.append({t.get("token", ""): float(t.get("logprob", 0.0)) for t in top})
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
