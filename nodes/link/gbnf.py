"""A GBNF grammar's repetitions, checked before anything compiles it (the head, for a 400; the node, again).

llama.cpp expands `x{0,n}` into n nested optional rules, and a repetition of a repetition makes the sampler track
every way the text so far could split between them: `((("a"{0,30}){0,30}){0,30})`, 62 bytes, kept a node's
decode loop in one grammar step for most of an hour. Measured on this machine (SmolLM2's 49,152 tokens, one full
filter of the vocabulary): `("a"{0,30}){0,30}` 0.07 s, `(("a"{0,8}){0,8}){0,8}` 1.0 s, `(("a"{0,10}){0,10}){0,10}`
5.5 s, `((("a"{0,4}){0,4}){0,4}){0,4}` 2.4 s. So within one rule, repetitions nested three deep whose bounds
multiply past MAX_NESTED_PRODUCT are refused. What this cannot see (the same nesting through rule references) the
node's timed probe catches (nodes/agent/engine/sampling.py).
"""

from __future__ import annotations

import re

MAX_NESTED_DEPTH = 3
MAX_NESTED_PRODUCT = 64
UNBOUNDED = 16  # what `*`, `+` or `{m,}` count as in the product
_QUANTIFIER = re.compile(r"\s*(\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}|[*+?])")


def repetition_problem(source: str) -> str | None:
    """Why the grammar's nested repetitions are too costly to sample, or None."""
    text = _plain(source)
    stack = [_Group()]
    i = 0
    while i < len(text):
        char = text[i]
        if char == "(":
            stack.append(_Group())
            i += 1
            continue
        if char == "|":
            stack[-1].alternative()
            i += 1
            continue
        if char == ")" and len(stack) > 1:
            inner = stack.pop().inner()
            i += 1
        elif char == '"' or char.isalnum() or char in "_-":
            inner = None
            i = _element_end(text, i)
        else:
            if char == "\n" and len(stack) > 1 and not text[i + 1:i + 2].isspace():  # a new rule, a group unclosed
                stack = [_Group()]
            i += 1
            continue
        depth, product = inner or (0, 1)
        match = _QUANTIFIER.match(text, i)
        if match and match.group(1) != "?":
            depth, product = depth + 1, product * _bound(match)
            if depth >= MAX_NESTED_DEPTH and product > MAX_NESTED_PRODUCT:
                return (f"repetitions nested {depth} deep (up to {product} ways to split a text between them) are "
                        "too costly to sample; nest at most two, or put fixed text between them")
        if match:
            i = match.end()
        stack[-1].add((depth, product), fixed=inner is None and match is None)
    return None


class _Group:
    """A parenthesised group so far: its deepest repetition inside, and whether every alternative holds a fixed
    element (a literal or a rule, unrepeated): then each pass through it consumes that text, and repeating the
    group splits a text only one way, however deep the repetitions inside (a JSON array of strings)."""

    def __init__(self) -> None:
        self.deepest, self.alt_fixed, self.all_fixed = (0, 1), False, True

    def add(self, repetition: tuple[int, int], *, fixed: bool) -> None:
        self.deepest = max(self.deepest, repetition)
        self.alt_fixed = self.alt_fixed or fixed

    def alternative(self) -> None:
        self.all_fixed, self.alt_fixed = self.all_fixed and self.alt_fixed, False

    def inner(self) -> tuple[int, int]:
        self.alternative()
        return (0, 1) if self.all_fixed else self.deepest


def _bound(match: re.Match) -> int:
    if match.group(1) in ("*", "+"):
        return UNBOUNDED
    low, comma, high = match.group(2), match.group(3), match.group(4)
    if not comma:
        return max(int(low), 1)
    return max(int(high), 1) if high else UNBOUNDED


def _plain(source: str) -> str:
    """The grammar with comments dropped and each literal and character class made one placeholder."""
    out, i = [], 0
    while i < len(source):
        char = source[i]
        if char == "#":
            end = source.find("\n", i)
            i = len(source) if end < 0 else end
            continue
        if char in "\"[":
            close = '"' if char == '"' else "]"
            j = i + 1
            while j < len(source) and source[j] != close:
                j += 2 if source[j] == "\\" else 1
            out.append('"x"')
            i = j + 1
            continue
        out.append(char)
        i += 1
    return "".join(out)


def _element_end(text: str, i: int) -> int:
    if text[i] == '"':
        return text.index('"', i + 1) + 1
    j = i
    while j < len(text) and (text[j].isalnum() or text[j] in "_-"):
        j += 1
    return max(j, i + 1)
