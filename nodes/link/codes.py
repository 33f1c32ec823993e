"""The node link's codes, one vocabulary that both ends import: websocket close codes (the head closes with them,
the node reads them) and error codes (a node's `error` and `state_result`, which the head maps to a status and decides
retries by)."""

from __future__ import annotations

from enum import IntEnum, StrEnum


class ErrorCode(StrEnum):
    """Why a generation or a state operation failed. The values are the wire's (and the client's) codes."""

    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the prompt (with what was already generated) does not fit
    INVALID_GRAMMAR = "invalid_grammar"
    INVALID_REQUEST = "invalid_request"
    ENGINE_CRASHED = "engine_crashed"  # the engine worker died with it (a llama.cpp abort); it restarts
    ENGINE_UNAVAILABLE = "engine_unavailable"  # the engine worker is restarting; place it elsewhere
    ENGINE_FAILED = "engine_failed"  # llama.cpp refused a step; the lanes in it were reset
    UNKNOWN_OP = "unknown_op"  # a state operation this engine does not have
    ADAPTER_IN_USE = "adapter_in_use"  # a LoRA adapter a queued or running generation uses is not unloaded yet
    MEDIA_UNAVAILABLE = "media_unavailable"  # the node could not fetch a generation's media blob from the head
    NODE_LOST = "node_lost"  # the head's own: the node's link was lost, or a token batch on its way
    NODE_SILENT = "node_silent"  # the head's own: the node did not accept a generation in time (placed elsewhere)


# The request's fault: another node would refuse it alike, so it is never placed again (a 400 to the client). Every
# other code, a newer node's unknown one too, is the node's: before the first token the head places the generation
# on another node (fleet.dispatch); after it, only a lost node is (the client already has the first node's tokens).
REQUEST_FAULTS = frozenset({ErrorCode.CONTEXT_LENGTH_EXCEEDED, ErrorCode.INVALID_GRAMMAR, ErrorCode.INVALID_REQUEST})


def retried_elsewhere(code: str, *, streamed: bool) -> bool:
    """Whether a generation that failed with `code` is placed again on another node; `streamed`: the client already
    has tokens from this node."""
    if streamed:
        return code == ErrorCode.NODE_LOST
    return code not in REQUEST_FAULTS


class FinishReason(StrEnum):
    """How a generation ended, in a node's `done` (the engine's FINISH_* are these values)."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"  # the head (or the client through it) cancelled it
    DEADLINE = "deadline"


class KvRefusal(StrEnum):
    """Why a node did not export or import a prompt prefix's KV cache (nodes.agent.engine.kv_payload): the `reason` of
    a `kv_export` or `kv_import` answer. The importer's lane is left as it was, or empty; it prefills as without."""

    NOT_HELD = "not_held"  # no lane holds a whole 64-token block of that prefix (any more)
    CORRUPT = "corrupt"  # the payload is cut, its checksum fails, or its cells disagree with its header
    UNSUPPORTED = "unsupported"  # another payload version, or a cache layout this engine cannot cut to a prefix
    MODEL_MISMATCH = "model_mismatch"  # computed with another model file (fingerprint) or engine
    KV_TYPE_MISMATCH = "kv_type_mismatch"  # another K/V cache type (f16, q8_0, ...)
    TOKENS_MISMATCH = "tokens_mismatch"  # its token ids do not give the block hashes it names
    TOO_LONG = "too_long"  # the prefix does not fit this node's per-lane context window
    NO_FREE_LANE = "no_free_lane"  # every lane is running a generation
    REJECTED = "rejected"  # llama.cpp refused the cells (another KV layout: flash attention on one node only?)


class ModelPhase(StrEnum):
    """Where a deployed model stands on a node (`model_state` on the link; the head keeps the last one per pair)."""

    PULLING = "pulling"
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"  # no new generations; those running finish, then the worker stops
    FAILED = "failed"
    UNLOADED = "unloaded"  # gone from the node: the head forgets the pair


class CloseCode(IntEnum):
    """Why the head closed a node's link. Codes in REFUSALS end the node (exit status 2): redialing cannot help."""

    NORMAL = 1000
    GOING_AWAY = 1001
    TOKEN_REFUSED = 4001  # unknown token id, or the node's secret for it is wrong
    TOKEN_REQUIRED = 4002  # the reserved local token id from anywhere but `manage.py up`'s own node
    PROTOCOL = 4003  # a malformed, forged, oversized, out-of-order or unexpected frame
    IDENTITY_TAKEN = 4004  # the identity is bound to another node key
    NODE_REVOKED = 4005  # the operator revoked this node's key
    TOKEN_REVOKED = 4006
    TOKEN_EXPIRED = 4007
    BUSY = 4008  # too many handshakes at once on this head process; the node retries
    FLOOD = 4009  # more frames a second than the head takes from one node
    TOKEN_UNREADABLE = 4010  # the head cannot decrypt its copy of the token's secret (SECRET_KEY changed)
    HEAD_KEY_UNREADABLE = 4011  # the head cannot decrypt its own static key (SECRET_KEY changed)
    TOKENIZER_MISMATCH = 4012  # a model's tokenizer differs from the head's registry model of the same name
    IDENTITY_REFUSED = 4013  # the identity has invisible characters or mixed scripts, or looks like another node's


_NEW_TOKEN = "create a new one on the head with `manage.py fleet_token` and pass it with --token"

# What the host owner reads (one line, exit status 2) when the head closes the link with one of these codes.
REFUSALS: dict[int, str] = {
    CloseCode.TOKEN_REFUSED: f"the head refused this node's fleet token (unknown, or wrong secret): {_NEW_TOKEN}",
    CloseCode.TOKEN_REQUIRED: f"the head takes this node only with a fleet token: {_NEW_TOKEN}",
    CloseCode.IDENTITY_TAKEN: (
        "another node key already holds this identity on the head: pick another with --identity, or ask the "
        "operator to release the identity's key binding in the admin (Nodes > action 'Release key binding')"
    ),
    CloseCode.NODE_REVOKED: "the operator revoked this node's key; it cannot rejoin the fleet with it",
    CloseCode.TOKEN_REVOKED: f"this node's fleet token was revoked: {_NEW_TOKEN}",
    CloseCode.TOKEN_EXPIRED: f"this node's fleet token has expired: {_NEW_TOKEN}",
    CloseCode.TOKEN_UNREADABLE: (
        "the head cannot read its copy of this fleet token (its SECRET_KEY changed without the old key in "
        f"FLEET_SECRET_KEY_FALLBACKS): {_NEW_TOKEN}"
    ),
    CloseCode.HEAD_KEY_UNREADABLE: (
        "the head cannot read its own link key (its SECRET_KEY changed without the old key in "
        "FLEET_SECRET_KEY_FALLBACKS); the operator must restore the old key"
    ),
    CloseCode.IDENTITY_REFUSED: (
        "the head refuses this node's identity: pick another with --identity (one script, no invisible characters "
        "or white space at its ends, and not another node's in other case or width)"
    ),
    CloseCode.TOKENIZER_MISMATCH: (
        "this node's model has another tokenizer than the head's registry model of the same name: serve the "
        "registry's file (node_join --model NAME pulls it), or rename this file (its name is the model's)"
    ),
}


def refusal(code: int | None, reason: str = "") -> str | None:
    """The line to print for a refusing close code (with the head's own reason when it gave one), else None."""
    if code not in REFUSALS:
        return None
    return f"{REFUSALS[code]} (head: {reason})" if reason else REFUSALS[code]
