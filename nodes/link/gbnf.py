"""A GBNF grammar's size and repetitions, checked before anything compiles it (the head, for a 400; the node, again).

What makes a grammar costly to sample is a repetition of something that can match nothing. llama.cpp expands
`x{0,n}` into n nested optional rules; when x itself may be empty, the sampler tracks every way the text so far could
split between the n copies, and a repetition of such a repetition multiplies those ways. Written inline
(`((("a"{0,30}){0,30}){0,30})`) or through rule references (`root ::= b{0,30}`, `b ::= c{0,30}`, `c ::= d{0,30}`,
`d ::= "a"`), it held a node's decode loop for minutes to an hour. Measured on this machine (SmolLM2's 49,152 tokens,
one filter of the whole vocabulary, at the grammar's start and, worst, after some text):

    b{0,4} / b ::= [a-z]{0,1000}        0.02 s, 0.5 s      b{0,2} / c{0,2} / [a-z]{0,100}   0.01 s, 0.12 s
    b{0,8} / b ::= [a-z]{0,32}          0.03 s, 1.1 s      b{0,4} / c{0,4} / [a-z]{0,4}      0.06 s, 0.9 s
    b{0,30} / b ::= "a"{0,30}           0.9 s, 19 s        b{0,32} / b ::= "a"{0,2}          0.9 s, 1.7 s
    b{0,1000} / b ::= [a-z]{0,1}        6,000 s            b{0,16} / c{0,16} / "a"{0,16}      357 s
    b{0,1000} / b ::= [a-z]{1,10}       0.01 s             (w " "?){0,100} / w ::= [a-z]{1,20}  0.01 s

The outer counts decide, so one bound, followed through groups and rule references (a reference stands for the
rule's own repetitions): the counts of repetitions of something that can match nothing multiply to at most
MAX_EMPTY_REPEAT (`*`, `+` and `{m,}` count as UNBOUNDED). Repeating something that always consumes text (a literal,
`[a-z]{1,10}`, a rule whose every alternative does) splits a text one way, however many repetitions it holds, so the
count starts again there: `"a"{0,1000}` and `("," item){0,100}` are fine. Recursion is not a repetition: a rule that
refers to itself (a JSON value inside an array) adds nothing by itself; the summaries of recursive rules are iterated
to a fixed point. What this still cannot see, the node's timed probe catches (nodes/agent/engine/sampling.py), beside
its decode loop and under a time limit (nodes/agent/engine/beside.py).
"""

from __future__ import annotations

import re
from collections import deque

MAX_CHARS = 1 << 20  # a grammar's size in characters, and in rules: the check is linear in both
MAX_RULES = 10_000
MAX_EMPTY_REPEAT = 4
UNBOUNDED = 16  # what `*`, `+` or `{m,}` count as
_EVALUATIONS_PER_RULE = 32  # a fixed point takes a few; more means recursive repetitions that keep multiplying

_TOKEN = re.compile(
    r"""(?P<comment>\#[^\n]*)
      | (?P<literal>"(?:[^"\\\n]|\\.)*")
      | (?P<cls>\[(?:[^\]\\]|\\.)*\])
      | (?P<special>!?<[^>\n]*>)
      | (?P<head>[A-Za-z0-9_-]+[ \t]*::=)
      | (?P<name>[A-Za-z0-9_-]+)
      | (?P<quant>\{\s*\d+\s*(?:,\s*\d*\s*)?\}|[*+?])
      | (?P<punct>[()|.])
      | (?P<other>\s+|.)""",
    re.X | re.S,
)
_BOUNDS = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")

# A summary: (whether it can match nothing, the most copies its repetitions of things that can match nothing make).
_ONE = (False, 1)


def repetition_problem(source: str) -> str | None:
    """Why the grammar is too large, or its repetitions too costly to sample, or None."""
    if len(source) > MAX_CHARS:
        return f"the grammar is {len(source)} characters (at most {MAX_CHARS})"
    rules = _rules(source)
    if len(rules) > MAX_RULES:
        return f"the grammar has {len(rules)} rules (at most {MAX_RULES})"
    users: dict[str, set[str]] = {name: set() for name in rules}
    for name, tokens in rules.items():
        for token in tokens:
            if token[0] == "ref" and token[1] in users:
                users[token[1]].add(name)
    summaries = {name: _ONE for name in rules}
    queue = deque(_order(rules))
    queued = set(queue)
    budget = _EVALUATIONS_PER_RULE * len(rules) + 64
    while queue:
        name = queue.popleft()
        queued.discard(name)
        budget -= 1
        if budget < 0:
            return (f"rule `{name}`: its repetitions multiply through recursive rules without end; "
                    "put fixed text before each recursive reference")
        summary = _evaluate(rules[name], summaries)
        if isinstance(summary, str):
            return f"rule `{name}`: {summary}"
        if summary != summaries[name]:
            summaries[name] = summary
            fresh = users[name] - queued
            queue.extend(fresh)
            queued |= fresh
    return None


def _rules(source: str) -> dict[str, list[tuple]]:
    """Each rule's body as tokens: ("(",), (")",), ("|",), ("lit", can_be_empty), ("ref", name), ("q", lo, hi,
    text) with hi None for no upper bound. A rule defined twice is one rule with both bodies as alternatives."""
    rules: dict[str, list[tuple]] = {}
    body: list[tuple] | None = None
    for match in _TOKEN.finditer(source):
        kind, text = match.lastgroup, match.group()
        if kind == "head":
            name = text[:-3].strip()
            if name in rules:
                rules[name].append(("|",))
            body = rules.setdefault(name, [])
        elif body is None or kind in ("comment", "other"):
            continue
        elif kind in ("literal", "cls", "special") or text == ".":
            body.append(("lit", text == '""'))
        elif kind == "name":
            body.append(("ref", text))
        elif kind == "quant":
            body.append(("q", *_bounds(text), text))
        else:
            body.append((text,))
    return rules


def _bounds(text: str) -> tuple[int, int | None]:
    if text in "*+?":
        return {"*": (0, None), "+": (1, None), "?": (0, 1)}[text]
    match = _BOUNDS.match(text)
    low, comma, high = int(match.group(1)), match.group(2), match.group(3)
    if not comma:
        return low, low
    return low, int(high) if high else None


def _order(rules: dict[str, list[tuple]]) -> list[str]:
    """Every rule, the ones it refers to before it (from `root` first), so a grammar without recursion is summed up
    in one pass."""
    seen: set[str] = set()
    order: list[str] = []
    for top in ["root", *rules]:
        if top in seen or top not in rules:
            continue
        seen.add(top)
        stack = [(top, iter(rules[top]))]
        while stack:
            name, tokens = stack[-1]
            child = next((t[1] for t in tokens if t[0] == "ref" and t[1] in rules and t[1] not in seen), None)
            if child is None:
                stack.pop()
                order.append(name)
            else:
                seen.add(child)
                stack.append((child, iter(rules[child])))
    return order


class _Group:
    """A parenthesised group (or a rule's body) read so far: whether an alternative can match nothing, and the
    repetitions inside it."""

    __slots__ = ("empty", "alt_empty", "copies")

    def __init__(self) -> None:
        self.empty, self.alt_empty, self.copies = False, True, 1

    def add(self, item: tuple[bool, int]) -> None:
        self.alt_empty = self.alt_empty and item[0]
        self.copies = max(self.copies, item[1])

    def alternative(self) -> None:
        self.empty, self.alt_empty = self.empty or self.alt_empty, True

    def close(self) -> tuple[bool, int]:
        self.alternative()
        return self.empty, self.copies


def _evaluate(tokens: list[tuple], summaries: dict[str, tuple[bool, int]]) -> tuple[bool, int] | str:
    """A rule's summary from its tokens and the current summaries of the rules it names; a problem as text."""
    stack = [_Group()]
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token[0] == "(":
            stack.append(_Group())
            continue
        if token[0] == "|":
            stack[-1].alternative()
            continue
        if token[0] == ")":
            if len(stack) == 1:
                continue  # unbalanced: llama.cpp refuses the grammar itself
            item = stack.pop().close()
        elif token[0] == "lit":
            item = (token[1], 1)
        elif token[0] == "ref":
            item = summaries.get(token[1], _ONE)  # an undefined rule: llama.cpp refuses the grammar
        else:
            continue  # a quantifier with nothing before it
        while i < len(tokens) and tokens[i][0] == "q":
            item = _repeat(item, tokens[i])
            if isinstance(item, str):
                return item
            i += 1
        stack[-1].add(item)
    while len(stack) > 1:  # unclosed groups
        item = stack.pop().close()
        stack[-1].add(item)
    return stack[0].close()


def _repeat(item: tuple[bool, int], quantifier: tuple) -> tuple[bool, int] | str:
    """`item` under a quantifier: whether it can match nothing, its copies, or why they are too many."""
    empty, copies = item
    _, low, high, text = quantifier
    if high is not None and high <= 1:  # `?`, `{0,1}`, `{1}`: optional at most, nothing repeats
        return empty or low == 0, copies
    if not empty:  # each copy consumes text: a text splits between them one way
        return low == 0, 1
    copies *= UNBOUNDED if high is None else high
    if copies > MAX_EMPTY_REPEAT:
        return (f"`{text}` repeats something that can match nothing, and with the repetitions around or inside it "
                f"(through groups and rules) that makes {copies} copies (at most {MAX_EMPTY_REPEAT}): the sampler "
                f"would track every way a text splits between them. Repeat only what cannot be empty: "
                f'`("a"?){{0,30}}` is `"a"{{0,30}}`, `("a"{{0,30}}){{0,30}}` is `"a"{{0,900}}`')
    return True, copies
