"""A model's thinking, told from its answer: the text between the `<think>` that opens an answer and its `</think>`.

Models with a thinking mode in their chat template (Qwen3, DeepSeek-R1 and their kin) answer `<think>...</think>`
then the answer. The Messages API gives that part as a `thinking` block (`thinking_delta` events when streamed), the
Responses API as a `reasoning` item (`response.reasoning_text.delta` events) whose tokens its usage counts
(`ThinkingTokens`, from nodes.link.thinking: the node holds a thinking budget with it), and tool calls are read from
what follows it. A model that does not think answers without one: nothing here changes it.
"""

from __future__ import annotations

from nodes.link.thinking import CLOSE, OPEN, ThinkingTokens

__all__ = ["CLOSE", "OPEN", "Splitter", "ThinkingTokens", "split_thinking"]


def split_thinking(text: str) -> tuple[str, str]:
    """(thinking, answer) of a whole answer; ("", text) when it does not open with <think>. A thinking cut short
    (max_tokens) is all thinking."""
    body = text.lstrip()
    if not body.startswith(OPEN):
        return "", text
    inner = body[len(OPEN):]
    end = inner.find(CLOSE)
    if end < 0:
        return inner.strip("\n"), ""
    return inner[:end].strip("\n"), inner[end + len(CLOSE):].lstrip()


class Splitter:
    """`split_thinking`, as the deltas of a stream arrive: `feed` and `flush` give ("thinking" | "text", piece)
    pairs, in order; a tag cut across deltas is held until it is whole."""

    def __init__(self) -> None:
        self.state = "start"  # start | thinking | after (the close seen, white space skipped) | text
        self.held = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            stripped = self.held.lstrip()
            if not stripped or (OPEN.startswith(stripped) and stripped != OPEN):
                return out  # white space, or what may still become <think>
            if not stripped.startswith(OPEN):
                self.state, text, self.held = "text", self.held, ""
                return [("text", text)]
            self.state, self.held = "thinking", stripped[len(OPEN):].lstrip("\n")
        if self.state == "thinking":
            end = self.held.find(CLOSE)
            if end < 0:
                safe = _safe_end(self.held)
                piece, self.held = self.held[:safe], self.held[safe:]
                return out + ([("thinking", piece)] if piece else [])
            piece, self.held = self.held[:end].rstrip("\n"), self.held[end + len(CLOSE):]
            if piece:
                out.append(("thinking", piece))
            self.state = "after"
        if self.state == "after":
            self.held = self.held.lstrip()
            if not self.held:
                return out
            self.state = "text"
        if self.held:
            out.append(("text", self.held))
            self.held = ""
        return out

    def flush(self) -> list[tuple[str, str]]:
        held, self.held = self.held, ""
        if not held:
            return []
        return [("thinking" if self.state == "thinking" else "text", held)] if self.state != "after" else []


def _safe_end(text: str) -> int:
    """Where thinking text can be given out up to: short of a tail that may be the start of </think>, and of the
    newlines before it (the thinking's own ends are trimmed, as split_thinking trims them)."""
    end = len(text)
    for size in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if CLOSE.startswith(text[-size:]):
            end = len(text) - size
            break
    return len(text[:end].rstrip("\n"))
