"""The node-link handshake, sans IO: the caller moves the frames, these classes only turn bytes into bytes.

Noise_XXpsk3_25519_ChaChaPoly_SHA256, three frames:

1. node -> head: b"FLEET2" + u16 big-endian len(hello) + hello + Noise message 1 (e), where
   hello = msgpack({"proto": "fleet/2", "token_id": str}). Everything before the Noise message is the Noise
   prologue, so a tampered hello fails the handshake. The head looks the token id up to find the PSK.
2. head -> node: Noise message 2 (e, ee, s, es): the head's static key. It proves nothing of the token: the PSK
   enters only at message 3, so anything that answers frame 1 can send a valid message 2.
3. node -> head: Noise message 3 (s, se, psk): the node's static key (its identity's key) and proof that it
   holds the token's secret. A wrong secret fails here, at the head.

The head proves the secret with its first transport frame: it opens only under keys the PSK went into
(`SecureChannel.peer_proved`). The node pins the head's key then, never after message 2 alone.

Every payload is empty. `manage.py up`'s own node uses the reserved token id LOCAL_TOKEN_ID with a secret made
for that run; nothing joins without a PSK.
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
import struct
from dataclasses import dataclass

import msgpack

from nodes.link.channel import MAX_FRAME, SecureChannel
from nodes.link.messages import LinkError
from nodes.link.noise import DHLEN, PSKLEN, TAGLEN, HandshakeState, NoiseError

MAGIC = b"FLEET2"
PROTO = "fleet/2"
MAX_HANDSHAKE_FRAME = 1024  # the three handshake frames are under 200 bytes; refuse big ones unparsed
PATTERN = "XXpsk3"
FIRST_MESSAGE_LEN = DHLEN + TAGLEN
FINAL_MESSAGE_LEN = DHLEN + 2 * TAGLEN  # message 3: the encrypted static key and an empty encrypted payload
LOCAL_TOKEN_ID = "local"  # never a stored token's id (those are 12 hex characters)
_PUBLIC_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SECRET = re.compile(r"[A-Za-z0-9_-]{43}")


class HandshakeError(LinkError):
    """The handshake failed or a handshake frame is malformed; the link is closed."""


class TokenRefused(HandshakeError):
    """The node's message 1 did not authenticate with the secret of the token it named."""


class BadToken(LinkError):
    """A fleet token string that is not `<token-id>.<secret>`."""


class HeadKeyChanged(HandshakeError):
    """The head presented a static key other than the one this node pinned."""

    def __init__(self, pinned: bytes, presented: bytes) -> None:
        super().__init__(f"the head presented link key {fingerprint(presented)}, but this node pinned "
                         f"{fingerprint(pinned)} when it first joined")
        self.pinned, self.presented = pinned, presented


@dataclass(frozen=True, slots=True)
class Hello:
    """The cleartext part of frame 1: the protocol and the id of the token whose secret is the PSK."""

    proto: str
    token_id: str


def fingerprint(public_key: bytes) -> str:
    """A static key as people compare it: `SHA256:` and the unpadded base64 of its SHA-256, as ssh prints keys."""
    digest = base64.b64encode(hashlib.sha256(public_key).digest()).rstrip(b"=").decode("ascii")
    return f"SHA256:{digest}"


def make_secret() -> bytes:
    """A new 32-byte token secret."""
    return secrets.token_bytes(PSKLEN)


def format_token(public_id: str, secret: bytes) -> str:
    """The token string `<public_id>.<secret as unpadded urlsafe base64>`."""
    if not _PUBLIC_ID.fullmatch(public_id):
        raise BadToken(f"token id {public_id!r} must be 1-64 characters of A-Z, a-z, 0-9, '_' or '-'")
    if len(secret) != PSKLEN:
        raise BadToken(f"a token secret is {PSKLEN} bytes, not {len(secret)}")
    return f"{public_id}.{base64.urlsafe_b64encode(secret).rstrip(b'=').decode('ascii')}"


def parse_token(token: str) -> tuple[str, bytes]:
    """(token id, 32-byte secret) from a fleet token; raises BadToken saying what is wrong."""
    token = token.strip()  # tokens come from env vars and files, often with a trailing newline
    public_id, dot, secret = token.partition(".")
    if not dot:
        raise BadToken("a fleet token looks like <token-id>.<secret>; this one has no '.' (copy the whole token)")
    if not _PUBLIC_ID.fullmatch(public_id):
        raise BadToken("the token id before the '.' must be 1-64 characters of A-Z, a-z, 0-9, '_' or '-'")
    if not _SECRET.fullmatch(secret):
        raise BadToken(
            f"the secret after the '.' must be 43 characters of unpadded urlsafe base64, got {len(secret)} "
            "characters (was the token cut short?)"
        )
    raw = base64.urlsafe_b64decode(secret + "=")
    # 43 characters carry 258 bits; only the canonical spelling of the 32 bytes is accepted.
    if format_token(public_id, raw) != token:
        raise BadToken("the token secret is not canonical base64; copy the token exactly as issued")
    return public_id, raw


def _as_bytes(frame: object, what: str) -> bytes:
    if isinstance(frame, bytes | bytearray | memoryview):
        data = bytes(frame)
    else:
        raise HandshakeError(f"{what} must be a binary websocket frame, got {type(frame).__name__}")
    if len(data) > MAX_HANDSHAKE_FRAME:
        raise HandshakeError(f"{what} of {len(data)} bytes is too large (cap {MAX_HANDSHAKE_FRAME})")
    return data


def _hello_prefix(token_id: str) -> bytes:
    hello = msgpack.packb({"proto": PROTO, "token_id": token_id}, use_bin_type=True)
    return MAGIC + struct.pack(">H", len(hello)) + hello


def _parse_hello(body: bytes) -> Hello:
    try:
        data = msgpack.unpackb(body, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise HandshakeError(f"the hello is not valid msgpack: {exc}") from exc
    if not isinstance(data, dict):
        raise HandshakeError("the hello must be a msgpack map")
    proto, token_id = data.get("proto"), data.get("token_id")
    if proto != PROTO:
        raise HandshakeError(f"unsupported link protocol {proto!r} (this side speaks {PROTO}); upgrade the node")
    if not (isinstance(token_id, str) and _PUBLIC_ID.fullmatch(token_id)):
        raise HandshakeError("the hello carries no token id, or a malformed one")
    return Hello(proto=proto, token_id=token_id)


def _split_first_frame(frame: bytes) -> tuple[bytes, Hello, bytes]:
    """(prologue, hello, Noise message 1) of frame 1."""
    if frame[: len(MAGIC)] != MAGIC[: len(frame)]:
        raise HandshakeError("not a Fleet node-link hello (bad magic; expected FLEET2: is the node older?)")
    start = len(MAGIC) + 2
    if len(frame) < start:
        raise HandshakeError("truncated hello: the frame ends before the hello length")
    (hello_len,) = struct.unpack_from(">H", frame, len(MAGIC))
    end = start + hello_len
    if end > len(frame):
        raise HandshakeError(f"truncated hello: it claims {hello_len} bytes but only {len(frame) - start} follow")
    hello = _parse_hello(frame[start:end])
    message = frame[end:]
    # XXpsk3's message 1 is the ephemeral key and the tag of its empty payload (psk patterns key the cipher on e).
    if len(message) != FIRST_MESSAGE_LEN:
        raise HandshakeError(
            f"malformed handshake: Noise message 1 has {len(message)} bytes, not {FIRST_MESSAGE_LEN}")
    return frame[:end], hello, message


def _channel(state: HandshakeState, max_frame: int) -> SecureChannel:
    send, receive = state.split()
    return SecureChannel(send, receive, max_frame=max_frame, handshake_hash=state.handshake_hash,
                         peer_static=state.remote_static or b"")


class Initiator:
    """The node's side: `first_frame()`; send it; `read_reply(frame 2)`; then `finish()` gives frame 3 and the channel.

    `static` is the node's private key; `pinned_head` the head key this node pinned, if any: a reply under another
    key raises HeadKeyChanged before the node proves anything.
    """

    def __init__(self, token_id: str, psk: bytes, static: bytes, *, pinned_head: bytes | None = None,
                 max_frame: int = MAX_FRAME) -> None:
        if len(psk) != PSKLEN:
            raise HandshakeError(f"a token secret is {PSKLEN} bytes, not {len(psk)}")
        if not _PUBLIC_ID.fullmatch(token_id):
            raise HandshakeError(f"malformed token id {token_id!r}")
        self.token_id = token_id
        self.head_key: bytes | None = None
        self._pinned_head = pinned_head
        self._max_frame = max_frame
        self._state = HandshakeState(PATTERN, initiator=True, prologue=_hello_prefix(token_id), psk=psk,
                                     static=static)
        self._step = 0

    def _advance(self, expected: int, what: str) -> None:
        if self._step != expected:
            raise HandshakeError(f"{what} called out of order; start a new Initiator to redial")
        self._step += 1

    def first_frame(self) -> bytes:
        """Frame 1: magic, hello and Noise message 1."""
        self._advance(0, "first_frame()")
        return _hello_prefix(self.token_id) + self._state.write_message(b"")

    def read_reply(self, frame: bytes) -> bytes:
        """Read the head's frame 2; returns the head's static public key (checked against the pin)."""
        self._advance(1, "read_reply()")
        data = _as_bytes(frame, "the head's handshake reply")
        try:
            self._state.read_message(data)
        except NoiseError as exc:
            raise HandshakeError(f"the head's handshake reply failed: {exc} (is this the right head?)") from exc
        self.head_key = self._state.remote_static
        if self._pinned_head is not None and not secrets.compare_digest(self._pinned_head, self.head_key):
            self._step = -1  # spent: this node must not prove itself to an unknown head
            raise HeadKeyChanged(self._pinned_head, self.head_key)
        return self.head_key

    def finish(self) -> tuple[bytes, SecureChannel]:
        """(frame 3, channel): the node's static key and the PSK proof, then the transport keys."""
        self._advance(2, "finish()")
        frame = self._state.write_message(b"")
        return frame, _channel(self._state, self._max_frame)


class Responder:
    """The head's side: `read_hello(frame 1)`; look the token up; `respond(psk)` gives frame 2; `finish(frame 3)`.

    After `finish`, `node_key` is the node's static public key, proved to belong to a holder of the token.
    """

    def __init__(self, static: bytes, *, max_frame: int = MAX_FRAME) -> None:
        self._static = static
        self._max_frame = max_frame
        self._prologue: bytes | None = None
        self._message: bytes = b""
        self._state: HandshakeState | None = None
        self.hello: Hello | None = None
        self.node_key: bytes | None = None

    def read_hello(self, frame: bytes) -> Hello:
        """Parse frame 1 without any crypto, so the caller can find the token's secret (maybe asynchronously)."""
        if self.hello is not None:
            raise HandshakeError("read_hello() was already called on this responder")
        data = _as_bytes(frame, "the node's hello frame")
        self._prologue, self.hello, self._message = _split_first_frame(data)
        return self.hello

    def respond(self, psk: bytes) -> bytes:
        """Frame 2, for the named token's secret."""
        if self.hello is None or self._prologue is None or self._state is not None:
            raise HandshakeError("respond() needs exactly one read_hello() before it")
        if len(psk) != PSKLEN:
            raise HandshakeError(f"a token secret is {PSKLEN} bytes, not {len(psk)}")
        self._state = HandshakeState(PATTERN, initiator=False, prologue=self._prologue, psk=psk,
                                     static=self._static)
        try:
            self._state.read_message(self._message)
        except NoiseError as exc:
            raise HandshakeError(f"the node's first handshake message failed ({exc}): was its hello altered?") from exc
        try:
            return self._state.write_message(b"")
        except NoiseError as exc:  # a low-order ephemeral key from the node
            raise HandshakeError(f"the node's handshake message is malformed: {exc}") from exc

    def finish(self, frame: object) -> SecureChannel:
        """The channel, from the node's frame 3; TokenRefused when the node does not hold the token's secret."""
        if self._state is None or self._state.finished:
            raise HandshakeError("finish() needs exactly one respond() before it")
        data = _as_bytes(frame, "the node's last handshake frame")
        if len(data) != FINAL_MESSAGE_LEN:
            raise HandshakeError(f"malformed handshake: Noise message 3 has {len(data)} bytes, not {FINAL_MESSAGE_LEN}")
        try:
            self._state.read_message(data)
        except NoiseError as exc:
            raise TokenRefused(
                f"the node's secret for token {self.hello.token_id!r} is wrong (or its handshake was altered)"
            ) from exc
        self.node_key = self._state.remote_static
        return _channel(self._state, self._max_frame)
