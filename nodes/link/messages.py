"""Typed, versioned node-link messages with msgpack bodies.

Each message is a msgpack map `{"t": <tag>, "v": PROTOCOL_VERSION, ...fields}`. Unknown fields are
ignored so a newer peer can add optional ones; a missing required field, a field of the wrong basic
type, an unknown tag or another version is a `ProtocolError`.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from enum import StrEnum
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 1


class LinkError(Exception):
    """Anything wrong on the node link: a bad handshake, frame or message. The link is closed."""


class LinkClosed(LinkError):
    """The node's link closed while the head waited on it (a state operation): another node may answer."""


class ProtocolError(LinkError):
    """A frame decrypted fine but is not a message this side understands."""


class MessageType(StrEnum):
    REGISTER = "register"
    REGISTERED = "registered"
    HEARTBEAT = "heartbeat"
    GENERATE = "generate"
    CANCEL = "cancel"
    STATE_OP = "state_op"
    STATE_RESULT = "state_result"
    ACCEPTED = "accepted"
    TOKEN_BATCH = "token_batch"
    DONE = "done"
    ERROR = "error"
    BYE = "bye"
    CHECK = "check"
    PULL = "pull"
    PULL_GRANT = "pull_grant"
    DEPLOY = "deploy"
    MODELS = "models"
    MODEL_STATE = "model_state"
    TOKENIZER_FILE = "tokenizer_file"
    REFUSAL = "refusal"
    BUNDLE = "bundle"
    HEADS = "heads"
    PREPARING = "preparing"
    CUT = "cut"


class Feature(StrEnum):
    """What a head can take beyond protocol 1's messages; it lists them in `registered`, and a node uses one only
    when listed, so a newer node works with an older head (and a newer head with an older node: it merely never
    receives what the node does not send)."""

    BUNDLE = "bundle"  # several node -> head messages in one frame
    HEADS = "heads"  # (a node's feature, in `register`) it keeps a link to each head process a `heads` names
    CUT = "cut"  # it writes the record of a generation another head process was cut off from (`cut`)
    THINKING_BUDGET = "thinking_budget"  # (a node's, in `register`) it holds a generate's `thinking_budget`


class Message:
    """Base of every message; `TYPE` is the wire tag."""

    __slots__ = ()
    TYPE: ClassVar[MessageType]


@dataclass(slots=True)
class Register(Message):
    """node -> head, first message after the handshake."""

    TYPE: ClassVar[MessageType] = MessageType.REGISTER
    identity: str
    models: list[dict[str, Any]]  # [{"name": str, "context_window": int}]
    lanes: int
    context_window: int
    capabilities: dict[str, Any]
    engine: str
    engine_version: str
    version: str
    labels: dict[str, Any] = field(default_factory=dict)
    replicas: list[dict[str, Any]] = field(default_factory=list)
    cache_cleared: bool = True
    # the generations whose prompt prefixes the engine restored at start (`--park`): with cache_cleared the head
    # still counts what they put there, so a warm restart is placed by from its first request
    warm: list[str] = field(default_factory=list)
    # its own model's tokenizer: {model name: fingerprint (nodes.agent.vocab)}; the head refuses a node whose
    # fingerprint differs from its registry model's of the same name, and asks for the file of one it lacks
    tokenizers: dict[str, str] = field(default_factory=dict)
    # what this node takes beyond protocol 1 (Feature values): "heads", so the head sends it `heads` messages
    features: list[str] = field(default_factory=list)
    # what its engine workers run on: a nodes.link.device.DeviceReport (backend, devices and their memory, layers
    # offloaded, the host's GPUs); absent from an older node, which the head shows as "unknown"
    device: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Registered(Message):
    """head -> node: the node is in the fleet."""

    TYPE: ClassVar[MessageType] = MessageType.REGISTERED
    node_id: str
    model_names: list[str]
    heartbeat_s: float
    warnings: list[str] = field(default_factory=list)
    # fingerprints of the node's tokenizers the head has no file of: the node sends each (tokenizer_file frames),
    # and takes no generation until they are in
    tokenizers_wanted: list[str] = field(default_factory=list)
    features: list[str] = field(default_factory=list)  # Feature values this head takes
    head: str = ""  # this head process's link URL (where nodes reach it; FLEET_LINK_URL)
    heads: list[str] = field(default_factory=list)  # every live head process's link URL: the node dials each


@dataclass(slots=True)
class Heads(Message):
    """head -> node (one that registered with the "heads" feature): the live head processes changed; their link
    URLs. The node dials those it has no link to."""

    TYPE: ClassVar[MessageType] = MessageType.HEADS
    heads: list[str]


@dataclass(slots=True)
class Heartbeat(Message):
    """node -> head, every `heartbeat_s`."""

    TYPE: ClassVar[MessageType] = MessageType.HEARTBEAT
    lanes_busy: int
    lanes: int
    kv_used: int = 0
    kv_total: int = 0
    tokens_per_s: float = 0.0
    replicas: list[dict[str, Any]] = field(default_factory=list)
    cache_cleared: bool = False
    # False while the engine worker is restarting: the head places nothing here until a heartbeat says True
    # (sent at once when it changes, not at the next interval)
    engine_ready: bool = True
    # What the engine measured (0: not yet): prompt tokens read a second, and the milliseconds each running
    # generation adds to a decode step. The head's load cost for this node comes from them (nodes/link/placement.py).
    prefill_tps: float = 0.0
    decode_slowdown_ms: float = 0.0
    # Each model's own engine worker's figures, {model name: {"lanes", "lanes_busy", "kv_used", "kv_total",
    # "tokens_per_s"}}: a node serving several models (deployments) says which lanes and KV are whose. Absent from an
    # older node: the head then takes the node's totals above for its models.
    models: dict[str, Any] = field(default_factory=dict)
    # Bytes free for another model's weights and KV (its --memory-budget less what its models hold, else the device's
    # free memory), and whether the head may load a registry model here on demand (node_join --no-on-demand: False).
    # An older node sends neither: 0 bytes, so nothing is loaded there on demand.
    memory_free: int = 0
    on_demand: bool = True
    # the device report again, its GPUs' memory as the engine last asked it (Register's `device`); absent: unchanged
    device: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Generate(Message):
    """head -> node: run `spec` (a GenerateSpec.to_dict())."""

    TYPE: ClassVar[MessageType] = MessageType.GENERATE
    gen_id: str
    spec: dict[str, Any]


@dataclass(slots=True)
class Cancel(Message):
    """head -> node: stop a generation and free its lane."""

    TYPE: ClassVar[MessageType] = MessageType.CANCEL
    gen_id: str
    reason: str = "cancelled"


@dataclass(slots=True)
class StateOp(Message):
    """head -> node: embed, tokenize or capabilities."""

    TYPE: ClassVar[MessageType] = MessageType.STATE_OP
    op_id: str
    op: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StateResult(Message):
    """node -> head: the answer to one StateOp."""

    TYPE: ClassVar[MessageType] = MessageType.STATE_RESULT
    op_id: str
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    code: str = ""


@dataclass(slots=True)
class Accepted(Message):
    """node -> head: the prompt is tokenized and admitted to a lane; prefill starts next.

    `evicted` names the generations whose cached prompts that lane choice discarded (Done repeats them).
    """

    TYPE: ClassVar[MessageType] = MessageType.ACCEPTED
    gen_id: str
    prompt_tokens: int
    cached_tokens: int = 0
    lane: int = 0
    replica: int = 0
    evicted: list[str] = field(default_factory=list)


@dataclass(slots=True)
class TokenBatch(Message):
    """node -> head: consecutive tokens, one string per token.

    `seq` counts a generation's batches from 1; Done carries the next number, so the head sees gaps and duplicates.
    """

    TYPE: ClassVar[MessageType] = MessageType.TOKEN_BATCH
    gen_id: str
    seq: int
    text: list[str]
    ids: list[int]
    logprobs: list[dict[str, Any]] | None = None
    # a transcription's segments in this batch ({"start", "end", "text", "words"}; times in seconds), one per text
    segments: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class Done(Message):
    """node -> head: the generation ended normally."""

    TYPE: ClassVar[MessageType] = MessageType.DONE
    gen_id: str
    seq: int
    finish_reason: str
    usage: dict[str, Any]
    timings: dict[str, Any]
    lane: int = 0
    replica: int = 0
    evicted: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Error(Message):
    """node -> head: the generation failed; `retryable` lets the head place it elsewhere."""

    TYPE: ClassVar[MessageType] = MessageType.ERROR
    gen_id: str
    code: str
    message: str
    retryable: bool = False
    seq: int = 0


@dataclass(slots=True)
class Cut(Message):
    """node -> head: a generation whose link closed before its end (its head process died, or the link did), as the
    node ended it: `record` is what that head put in its spec for this (GenerateSpec.record), the rest what the
    node made. The head writes the record the lost head could not, unless that head is still alive to write it."""

    TYPE: ClassVar[MessageType] = MessageType.CUT
    gen_id: str
    record: dict[str, Any]
    finish_reason: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    code: str = ""
    message: str = ""


@dataclass(slots=True)
class Bye(Message):
    """Either way: the sender is closing the link on purpose."""

    TYPE: ClassVar[MessageType] = MessageType.BYE
    reason: str = ""


@dataclass(slots=True)
class Check(Message):
    """node -> head, instead of Register: may this key join under `identity`? The head closes the link either way:
    1000 when it may, or the refusal code (identity taken, node revoked). A node sends it before loading its model."""

    TYPE: ClassVar[MessageType] = MessageType.CHECK
    identity: str


@dataclass(slots=True)
class Pull(Message):
    """node -> head, instead of Register: may this key join under `identity`, and where does it pull `model` from?
    The head answers PullGrant and closes the link (1000), or closes with the refusal code as for Check."""

    TYPE: ClassVar[MessageType] = MessageType.PULL
    identity: str
    model: str


@dataclass(slots=True)
class Preparing(Message):
    """node -> head, instead of Register, while the node pulls or loads its own model before it joins: where it
    stands (`state` pulling or loading, `progress` 0..1), for the live fleet page. The head checks the key as for
    Check, keeps it a short while (forgotten once the node registers or goes quiet) and closes the link (1000)."""

    TYPE: ClassVar[MessageType] = MessageType.PREPARING
    identity: str
    model: str
    state: str
    progress: float = 0.0


@dataclass(slots=True)
class PullGrant(Message):
    """head -> node: the registry's file for `model` and a short-lived grant to fetch it over HTTP.

    The node sends `grant` in an `Authorization: Fleet-Grant <grant>` header on `GET <path>` (Range requests), never
    in a URL. `error` (and nothing else) when the head has no model of that name.
    """

    TYPE: ClassVar[MessageType] = MessageType.PULL_GRANT
    model: str
    sha256: str = ""
    size: int = 0
    path: str = ""
    grant: str = ""
    expires_s: float = 0.0
    error: str = ""


@dataclass(slots=True)
class Deploy(Message):
    """head -> node: every registry model the operator's deployments put on this node, whole each time (sent after
    Registered and whenever a deployment changes). The node loads each one it lacks in an engine worker of its own,
    pulling it first, and unloads a model it loaded for a deployment that is no longer listed (after draining it).
    Its own `--model` is never unloaded. `adapters` lists the registry's LoRA adapters by base model: every model of
    those names the node serves (its own `--model` too) loads them, and unloads one no longer listed.
    """

    TYPE: ClassVar[MessageType] = MessageType.DEPLOY
    models: list[dict[str, Any]]  # [{"name": str, "sha256": str, "lanes": int, "context": int (0: sized)}]
    adapters: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # base -> [{"name", "sha256"}]


@dataclass(slots=True)
class Models(Message):
    """node -> head: the models this node now serves (all of them, its own `--model` first), after one was loaded
    or before one is drained. The head places generations of exactly these names here from then on."""

    TYPE: ClassVar[MessageType] = MessageType.MODELS
    models: list[dict[str, Any]]  # [{"name": str, "context_window": int, "lanes": int}]
    lanes: int
    context_window: int
    capabilities: dict[str, Any] = field(default_factory=dict)  # when adapters changed: the node's capabilities now


@dataclass(slots=True)
class ModelState(Message):
    """node -> head: where one deployed model stands on this node (a ModelPhase), with `progress` 0..1 while pulling
    and `detail` saying why when it failed. `unloaded` ends the pair."""

    TYPE: ClassVar[MessageType] = MessageType.MODEL_STATE
    model: str
    state: str
    progress: float = 0.0
    detail: str = ""


@dataclass(slots=True)
class TokenizerFile(Message):
    """node -> head, after Registered asked for it: one part of a tokenizer file (a metadata-only GGUF, zlib-
    compressed, cut into parts that each fit a frame). The head checks the whole file's fingerprint."""

    TYPE: ClassVar[MessageType] = MessageType.TOKENIZER_FILE
    fingerprint: str
    part: int
    parts: int
    data: bytes


@dataclass(slots=True)
class Refusal(Message):
    """head -> node, right before it closes the link with a refusing close code: the code and the head's reason
    again (daphne drops a close frame's reason, and the node prints it: which model, which fingerprints)."""

    TYPE: ClassVar[MessageType] = MessageType.REFUSAL
    code: int
    reason: str


@dataclass(slots=True)
class Bundle(Message):
    """node -> head, once the head listed Feature.BUNDLE: messages that were ready to send at the same moment, in
    order, one frame for all (each part the msgpack body of one message, never itself a bundle). What a node's
    outbox holds at once is mostly one engine step's token batches for its many generations; bundled, the head
    parses, decrypts and dispatches one websocket frame for them instead of one each."""

    TYPE: ClassVar[MessageType] = MessageType.BUNDLE
    parts: list[bytes]


def unbundle(bundle: Bundle) -> list[tuple[Message, bytes]]:
    """The messages in `bundle`, each with its own body; raises ProtocolError on a part that is not a message or
    is a bundle."""
    opened = []
    for part in bundle.parts:
        if not isinstance(part, bytes):
            raise ProtocolError(f"bundle: a part must be bytes, got {type(part).__name__}")
        msg = decode(part)
        if isinstance(msg, Bundle):
            raise ProtocolError("bundle: a bundle inside a bundle")
        opened.append((msg, part))
    return opened


REGISTRY: dict[str, type[Message]] = {
    cls.TYPE.value: cls
    for cls in (
        Register,
        Registered,
        Heartbeat,
        Generate,
        Cancel,
        StateOp,
        StateResult,
        Accepted,
        TokenBatch,
        Done,
        Error,
        Bye,
        Check,
        Pull,
        Preparing,
        PullGrant,
        Deploy,
        Models,
        ModelState,
        TokenizerFile,
        Refusal,
        Bundle,
        Heads,
        Cut,
    )
}


@dataclass(frozen=True, slots=True)
class _FieldRule:
    name: str
    types: tuple[type, ...]  # accepted Python types once decoded; empty means anything
    required: bool


def _accepted_types(hint: Any) -> tuple[type, ...]:
    """The outer types a decoded value may have for an annotation: list[str] -> (list,), X | None -> (X, None)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(t for arg in typing.get_args(hint) for t in _accepted_types(arg))
    if hint is type(None):
        return (type(None),)
    if hint is float:
        return (float, int)  # msgpack keeps 1.0 and 1 apart; a peer may send either
    origin = typing.get_origin(hint) or hint
    return (origin,) if isinstance(origin, type) and origin is not Any else ()


def _rules(cls: type[Message]) -> tuple[_FieldRule, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(
        _FieldRule(f.name, _accepted_types(hints[f.name]), f.default is MISSING and f.default_factory is MISSING)
        for f in fields(cls)  # type: ignore[arg-type]
    )


_RULES: dict[type[Message], tuple[_FieldRule, ...]] = {cls: _rules(cls) for cls in REGISTRY.values()}


def encode(msg: Message) -> bytes:
    """The msgpack bytes of `msg`."""
    body: dict[str, Any] = {"t": msg.TYPE.value, "v": PROTOCOL_VERSION}
    for rule in _RULES[type(msg)]:
        body[rule.name] = getattr(msg, rule.name)
    try:
        return msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {msg.TYPE.value}: {exc}") from exc


def decode(data: bytes) -> Message:
    """The message in `data`; raises ProtocolError on anything that is not a valid message."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"not a msgpack message: {exc}") from exc
    if not isinstance(body, dict):
        raise ProtocolError(f"a message must be a msgpack map, got {type(body).__name__}")
    cls = REGISTRY.get(body.get("t")) if isinstance(body.get("t"), str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {body.get('t')!r}")
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{cls.TYPE.value}: protocol version {body.get('v')!r} is not supported (this side speaks "
            f"{PROTOCOL_VERSION}); upgrade the older of node and head"
        )
    return cls(**_field_values(cls, body))


def _field_values(cls: type[Message], body: dict[Any, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for rule in _RULES[cls]:
        if rule.name not in body:
            if rule.required:
                raise ProtocolError(f"{cls.TYPE.value}: missing required field {rule.name!r}")
            continue
        value = body[rule.name]
        # bool is an int subclass; a bool where a number belongs is a peer bug, not a count.
        wrong_bool = isinstance(value, bool) and bool not in rule.types
        if rule.types and (wrong_bool or not isinstance(value, rule.types)):
            raise ProtocolError(f"{cls.TYPE.value}: field {rule.name!r} has the wrong type {type(value).__name__}")
        values[rule.name] = value
    return values
