"""What a generation asks of a node: one plain, msgpack-able spec shared by the head and the node."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# Fields only a node that lists their feature in `register.features` (nodes.link.messages.Feature) is sent: an
# older node would drop them unread, and the head could not tell.
NODE_FEATURE_FIELDS = {"thinking_budget": "thinking_budget"}


class SpecError(ValueError):
    """A spec the node cannot run as given (the head validates first; this is the node's own guard)."""


@dataclass
class GenerateSpec:
    """One generation. Exactly one of `prompt` (raw completion) or `messages` (chat) is set.

    `resume_text` is text already streamed to the client by another node (failover), and `resume_ids` the
    exact token ids it came from: the node appends those ids after the prompt (advancing the grammar and the
    penalties over them; a seeded sampler draws by position, so it goes on with its own sequence) and continues
    from there, token for token as the first node would have. Without ids (a client's own resume_text) the
    text is tokenized.
    """

    gen_id: str
    model: str = ""
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str | None = None
    json_schema: str | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    deadline: float | None = None  # unix time (seconds); past it the node cancels the lane
    resume_text: str = ""
    resume_ids: list[int] = field(default_factory=list)
    embedding: bool = False
    batch_invariant: bool = False  # run only where a greedy generation's tokens do not depend on its batch
    # A transcription: the audio blob by content hash ({"sha256", "size", "path", "grant"}: the node fetches it from
    # the head once and caches it) and its options ({"language", "word_timestamps", "temperature"}); `prompt` is the
    # text that guides it (may be empty). The node answers with one token batch per segment.
    audio: dict[str, Any] | None = None
    transcribe: dict[str, Any] = field(default_factory=dict)
    # LoRA adapters to run with, as [name, scale] pairs (names the node loaded); generations with different sets
    # never share a decode step.
    lora: list[list[Any]] = field(default_factory=list)
    # The W3C trace context of the head's attempt span (nodes.link.trace): the node's spans join the client's trace.
    # Empty when the head does not trace; a node that predates them ignores both (unknown fields are dropped).
    traceparent: str = ""
    tracestate: str = ""
    # What the head would write in the generation's record, should its link close before the end (the head process
    # died): the node sends it back with what it made, in a `cut` to another link (nodes.link.messages.Cut). Opaque
    # to the node; empty from a head that writes no such records.
    record: dict[str, Any] = field(default_factory=dict)
    # A thinking model's budget (Anthropic's thinking.budget_tokens; 0: none): once this many tokens came from the
    # answer's opening <think> without its </think>, the node appends "\n</think>\n\n" and the model answers. Sent
    # only to a node whose `register.features` lists `thinking_budget` (NODE_FEATURE_FIELDS).
    thinking_budget: int = 0

    def needs(self) -> list[str]:
        """The node capabilities this generation cannot run without (placement filters on them)."""
        wanted = {"grammar": bool(self.grammar or self.json_schema), "logprobs": self.logprobs,
                  "embeddings": self.embedding, "batch_invariant": self.batch_invariant,
                  "transcribe": self.audio is not None, "vision": bool(self.images())}
        return [name for name, needed in wanted.items() if needed] + [f"lora:{name}" for name, _ in self.lora]

    def needs_media(self) -> bool:
        """Whether the node fetches a blob from the head before it can start (audio, images)."""
        return self.audio is not None or bool(self.images())

    def images(self) -> list[dict[str, Any]]:
        """The image parts of a chat's messages (`{"type": "image", "image": {"sha256", "size", "path", "grant"}}`),
        in order: the node fetches each blob it lacks once, then reads it from its cache (`local_path`)."""
        return [part for m in self.messages or [] if isinstance(m.get("content"), list)
                for part in m["content"] if isinstance(part, dict) and part.get("type") == "image"]

    def to_dict(self) -> dict[str, Any]:
        # Shallow: it is encoded at once (asdict's deep copy of the messages was a millisecond a generation).
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        # msgpack map keys: ints are fine, but keep them as ints explicitly.
        data["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerateSpec:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "logit_bias" in values and values["logit_bias"]:
            values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
        spec = cls(**values)
        if (spec.prompt is None) == (spec.messages is None):
            raise SpecError("a generation needs exactly one of prompt or messages")
        return spec


def spec_for_node(data: dict[str, Any], features: set[str] | frozenset[str]) -> tuple[dict[str, Any], list[str]]:
    """A spec's `to_dict` as a node with these `register.features` takes it: each field it would drop unread is left
    out (NODE_FEATURE_FIELDS); and the names of those left out that asked for something (not their default)."""
    kept, dropped = dict(data), []
    for name, feature in NODE_FEATURE_FIELDS.items():
        if feature not in features and name in kept and kept.pop(name) != _DEFAULTS[name]:
            dropped.append(name)
    return kept, dropped


_DEFAULTS = {f.name: f.default for f in fields(GenerateSpec) if f.name in NODE_FEATURE_FIELDS}
