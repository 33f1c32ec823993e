"""The node-link handshake, sans IO: the caller moves the frames, these classes only turn bytes into bytes.

Frame 1 (node -> head): b"FLEET1" + u16 big-endian len(hello) + hello + Noise message 1, where
hello = msgpack({"proto": "fleet/1", "token_id": str | None}). Everything before the Noise message is
the Noise prologue, so a tampered hello fails the handshake. With a token the pattern is
Noise_NNpsk0_25519_ChaChaPoly_SHA256 keyed by the token's secret; without one it is Noise_NN (the head
allows that only from loopback). Frame 2 (head -> node): Noise message 2 with an empty payload.
"""

from __future__ import annotations

import base64
import re
import secrets
import struct
from dataclasses import dataclass

import msgpack

from nodes.link.channel import MAX_FRAME, SecureChannel
from nodes.link.messages import LinkError
from nodes.link.noise import DHLEN, PSKLEN, TAGLEN, HandshakeState, NoiseError

MAGIC = b"FLEET1"
PROTO = "fleet/1"
MAX_HANDSHAKE_FRAME = 1024  # both handshake frames are under 200 bytes; refuse big ones unparsed
PATTERN_TOKEN = "NNpsk0"
PATTERN_TOKENLESS = "NN"
_PUBLIC_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SECRET = re.compile(r"[A-Za-z0-9_-]{43}")


class HandshakeError(LinkError):
    """The handshake failed or a handshake frame is malformed; the link is closed."""


class TokenRefused(HandshakeError):
    """The node's message 1 did not authenticate with the secret of the token it named."""


class BadToken(LinkError):
    """A fleet token string that is not `<token-id>.<secret>`."""


@dataclass(frozen=True, slots=True)
class Hello:
    """The cleartext part of frame 1; `token_id` None means a tokenless (loopback-only) node."""

    proto: str
    token_id: str | None


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


def _hello_prefix(token_id: str | None) -> bytes:
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
    if token_id is not None and not (isinstance(token_id, str) and _PUBLIC_ID.fullmatch(token_id)):
        raise HandshakeError("the hello carries a malformed token id")
    return Hello(proto=proto, token_id=token_id)


def _split_first_frame(frame: bytes) -> tuple[bytes, Hello, bytes]:
    """(prologue, hello, Noise message 1) of frame 1."""
    if frame[: len(MAGIC)] != MAGIC[: len(frame)]:
        raise HandshakeError("not a Fleet node-link hello (bad magic; expected the FLEET1 prefix)")
    start = len(MAGIC) + 2
    if len(frame) < start:
        raise HandshakeError("truncated hello: the frame ends before the hello length")
    (hello_len,) = struct.unpack_from(">H", frame, len(MAGIC))
    end = start + hello_len
    if end > len(frame):
        raise HandshakeError(f"truncated hello: it claims {hello_len} bytes but only {len(frame) - start} follow")
    hello = _parse_hello(frame[start:end])
    message = frame[end:]
    # NN's message 1 is a bare ephemeral key; NNpsk0's also carries the tag of its (empty) payload.
    minimum = DHLEN if hello.token_id is None else DHLEN + TAGLEN
    if len(message) < minimum:
        raise HandshakeError(f"truncated handshake: Noise message 1 has {len(message)} bytes, needs {minimum}")
    return frame[:end], hello, message


def _channel(state: HandshakeState, max_frame: int) -> SecureChannel:
    send, receive = state.split()
    return SecureChannel(send, receive, max_frame=max_frame, handshake_hash=state.handshake_hash)


class Initiator:
    """The node's side: `first_frame()`, send it, then `read_reply(head's frame)` gives the channel."""

    def __init__(self, token_id: str | None, psk: bytes | None, *, max_frame: int = MAX_FRAME) -> None:
        if (token_id is None) != (psk is None):
            raise HandshakeError("pass both a token id and its secret, or neither (tokenless, loopback only)")
        if psk is not None and len(psk) != PSKLEN:
            raise HandshakeError(f"a token secret is {PSKLEN} bytes, not {len(psk)}")
        if token_id is not None and not _PUBLIC_ID.fullmatch(token_id):
            raise HandshakeError(f"malformed token id {token_id!r}")
        self.token_id = token_id
        self._psk = psk
        self._max_frame = max_frame
        self._state: HandshakeState | None = None

    def first_frame(self) -> bytes:
        """Frame 1: magic, hello and Noise message 1. Call once."""
        if self._state is not None:
            raise HandshakeError("first_frame() was already called; start a new Initiator to redial")
        prologue = _hello_prefix(self.token_id)
        pattern = PATTERN_TOKENLESS if self._psk is None else PATTERN_TOKEN
        self._state = HandshakeState(pattern, initiator=True, prologue=prologue, psk=self._psk)
        return prologue + self._state.write_message(b"")

    def read_reply(self, frame: bytes) -> SecureChannel:
        """The secure channel, from the head's frame 2."""
        if self._state is None or self._state.finished:
            raise HandshakeError("read_reply() needs exactly one first_frame() before it")
        data = _as_bytes(frame, "the head's handshake reply")
        try:
            self._state.read_message(data)
        except NoiseError as exc:
            raise HandshakeError(f"the head's handshake reply failed: {exc} (is this the right head?)") from exc
        return _channel(self._state, self._max_frame)


class Responder:
    """The head's side: `read_hello(frame 1)`, look the token up, then `respond(psk)`."""

    def __init__(self, *, max_frame: int = MAX_FRAME) -> None:
        self._max_frame = max_frame
        self._prologue: bytes | None = None
        self._message: bytes = b""
        self.hello: Hello | None = None
        self._done = False

    def read_hello(self, frame: bytes) -> Hello:
        """Parse frame 1 without any crypto, so the caller can find the token's secret (maybe asynchronously)."""
        if self.hello is not None:
            raise HandshakeError("read_hello() was already called on this responder")
        data = _as_bytes(frame, "the node's hello frame")
        self._prologue, self.hello, self._message = _split_first_frame(data)
        return self.hello

    def respond(self, psk: bytes | None) -> tuple[bytes, SecureChannel]:
        """(frame 2, channel). `psk` is the named token's secret, None for a tokenless hello."""
        if self.hello is None or self._prologue is None or self._done:
            raise HandshakeError("respond() needs exactly one read_hello() before it")
        self._done = True
        if (self.hello.token_id is None) != (psk is None):
            raise HandshakeError("a hello with a token id needs its secret; a tokenless hello takes none")
        if psk is not None and len(psk) != PSKLEN:
            raise HandshakeError(f"a token secret is {PSKLEN} bytes, not {len(psk)}")
        pattern = PATTERN_TOKENLESS if psk is None else PATTERN_TOKEN
        state = HandshakeState(pattern, initiator=False, prologue=self._prologue, psk=psk)
        try:
            state.read_message(self._message)
        except NoiseError as exc:
            if psk is not None:
                raise TokenRefused(
                    f"the node's secret for token {self.hello.token_id!r} is wrong (or its hello was altered)"
                ) from exc
            raise HandshakeError(f"the node's handshake message is malformed: {exc}") from exc
        try:
            reply = state.write_message(b"")
        except NoiseError as exc:
            raise HandshakeError(f"the node's handshake message is malformed: {exc}") from exc
        return reply, _channel(state, self._max_frame)
