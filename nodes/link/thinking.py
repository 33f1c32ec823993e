"""A thinking model's thinking on both ends of the link: the `<think>` that opens an answer, the `</think>` that ends
it, and the count of the tokens between them as they are generated (the head: the Responses API's reasoning_tokens;
the node: a generation's thinking budget, `GenerateSpec.thinking_budget`). Django-free.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
# What a node appends to a thinking that reached its budget, so the model goes on to answer (budget forcing).
THINK_END = "\n</think>\n\n"


class ThinkingTokens:
    """How many of an answer's tokens were its thinking, counted as their pieces arrive: those from the opening
    <think> through the one that completes </think> (each of them, when it never closes); none when the answer does
    not open with <think>. The node does not report the split: this counts the token pieces the head relays, so a
    token that holds both the tag's end and the answer's start counts as thinking."""

    def __init__(self) -> None:
        self.tokens = 0
        self.state = "start"  # start | thinking | over
        self.seen = ""  # start: the text so far; thinking: its tail, where a </think> cut across tokens may begin

    @property
    def count(self) -> int:
        """The thinking's tokens so far (none while the answer may still open with <think>: it has not yet)."""
        return 0 if self.state == "start" else self.tokens

    def feed(self, pieces: list[str]) -> None:
        for piece in pieces:
            if self.state == "over":
                return
            self.tokens += 1
            self.seen += piece
            if self.state == "start":
                self._decide()
            elif CLOSE in self.seen:
                self.state = "over"
            else:
                self.seen = self.seen[1 - len(CLOSE):]

    def _decide(self) -> None:
        text = self.seen.lstrip()
        if not text or (OPEN.startswith(text) and text != OPEN):
            return  # white space, or what may still become <think>
        if not text.startswith(OPEN):
            self.tokens, self.state = 0, "over"
            return
        self.seen = text[len(OPEN):]
        self.state = "over" if CLOSE in self.seen else "thinking"
