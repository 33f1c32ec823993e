"""The encrypted node link after the handshake: one message per binary websocket frame."""

from __future__ import annotations

from collections.abc import Sequence

from nodes.link import messages
from nodes.link.messages import Bundle, LinkError, Message
from nodes.link.noise import TAGLEN, CipherState, NoiseError

MAX_FRAME = 4 * 1024 * 1024
BUNDLE_BYTES = 64 * 1024  # what `seal_all` puts in one frame at most (a larger message goes alone)


class FrameError(LinkError):
    """A transport frame was refused: too large, forged, replayed, reordered or reflected."""


class ChannelBroken(FrameError):
    """The channel failed earlier; the caller must close the link."""


class SecureChannel:
    """Seals and opens messages with one CipherState per direction.

    Transport frames carry no nonce: each side counts frames in each direction, so a frame that is
    replayed, reordered, reflected back to its sender (the other direction's key) or altered fails
    authentication. Any failure breaks the channel for good, because the counters no longer agree;
    the caller closes the link. Frames may be larger than Noise's 65535-byte message limit: the
    websocket frames them, and ChaCha20-Poly1305 has no practical per-message limit.
    """

    def __init__(
        self,
        send: CipherState,
        receive: CipherState,
        *,
        max_frame: int = MAX_FRAME,
        handshake_hash: bytes = b"",
        peer_static: bytes = b"",
    ) -> None:
        self._send = send
        self._receive = receive
        self.max_frame = max_frame
        self.handshake_hash = handshake_hash  # the same on both ends; usable for channel binding
        self.peer_static = peer_static  # the other end's static public key, from the handshake
        # True once a frame from the peer opened under the final keys: the peer holds the handshake's PSK (in
        # XXpsk3 the responder's frame 2 proves nothing of it; its first transport frame does).
        self.peer_proved = False
        self._broken: str | None = None

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def seal(self, msg: Message) -> bytes:
        """The frame to send for `msg`."""
        self._check_usable()
        # A message that cannot be encoded or is too large fails alone: no nonce was spent, so the channel stays
        # usable for every other generation on the link.
        return self._seal_body(messages.encode(msg), msg.TYPE.value)

    def seal_all(self, msgs: Sequence[Message], bundle_bytes: int = BUNDLE_BYTES) -> list[bytes]:
        """The frames to send for `msgs`, in order: consecutive messages share a frame as a `Bundle` while it holds
        at most `bundle_bytes` of bodies; one that is alone, or larger, is sealed as itself. For a peer that takes
        bundles (messages.Feature.BUNDLE)."""
        self._check_usable()
        frames: list[bytes] = []
        group: list[bytes] = []
        size = 0

        def flush() -> None:
            if len(group) == 1:
                frames.append(self._seal_body(group[0], "message"))
            elif group:
                frames.append(self._seal_body(messages.encode(Bundle(parts=list(group))), "bundle"))
            group.clear()

        for msg in msgs:
            body = messages.encode(msg)
            if group and size + len(body) > bundle_bytes:
                flush()
                size = 0
            group.append(body)
            size += len(body)
        flush()
        return frames

    def _seal_body(self, body: bytes, what: str) -> bytes:
        if len(body) + TAGLEN > self.max_frame:
            raise FrameError(f"{what} message of {len(body)} bytes is too large (cap {self.max_frame})")
        try:
            return self._send.encrypt_with_ad(b"", body)
        except NoiseError as exc:
            raise self._break(FrameError(f"cannot seal frame: {exc}")) from exc

    def open(self, frame: bytes) -> Message:
        """The message in a received frame; raises FrameError or ProtocolError and breaks the channel."""
        return self.open_with_body(frame)[0]

    def open_with_body(self, frame: bytes) -> tuple[Message, bytes]:
        """As `open`, with the message's msgpack body too (a relay passes it on as it came, never encoding it
        again)."""
        self._check_usable()
        # Size first: a peer must not make this side spend CPU or memory decrypting a huge frame.
        if len(frame) > self.max_frame:
            raise self._break(FrameError(f"frame of {len(frame)} bytes is too large (cap {self.max_frame})"))
        try:
            body = self._receive.decrypt_with_ad(b"", frame)
        except NoiseError as exc:
            raise self._break(
                FrameError("frame failed authentication (tampered, replayed, reordered or reflected)")
            ) from exc
        self.peer_proved = True
        try:
            return messages.decode(body), body
        except LinkError as exc:
            self._break(exc)
            raise

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise ChannelBroken(f"the link is broken ({self._broken}); close it and redial")

    def _break(self, exc: LinkError) -> LinkError:
        self._broken = str(exc)
        return exc
