"""A small Noise Protocol Framework (revision 34) for one suite: 25519 / ChaChaPoly / SHA256.

Only the interactive patterns the node link needs (and their neighbours, for the published test vectors) are here:
XXpsk3 (the link's), XX, NN, NNpsk0 and NNpsk2. Names follow the
spec (https://noiseprotocol.org/noise.html) so each method can be checked against it section by section.
The primitives come from `cryptography`; any failure surfaces as `NoiseError`, never as one of its
exceptions, so callers have a single thing to catch.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

DHLEN = 32
HASHLEN = 32
TAGLEN = 16
PSKLEN = 32
MAX_MESSAGE = 65535  # the spec's limit on a handshake message
MAX_NONCE = 2**64 - 1  # reserved by the spec; reaching it means the key is spent

# Message patterns: one tuple of tokens per message, initiator first, then alternating.
PATTERNS: dict[str, tuple[tuple[str, ...], ...]] = {
    "XX": (("e",), ("e", "ee", "s", "es"), ("s", "se")),
    "XXpsk3": (("e",), ("e", "ee", "s", "es"), ("s", "se", "psk")),
    "NN": (("e",), ("e", "ee")),
    "NNpsk0": (("psk", "e"), ("e", "ee")),
    "NNpsk2": (("e",), ("e", "ee", "psk")),
}
SUITE = "25519_ChaChaPoly_SHA256"


class NoiseError(Exception):
    """A Noise handshake or transport message failed: bad authentication, bad length, misuse."""


def _hash(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def hkdf(chaining_key: bytes, ikm: bytes, outputs: int) -> tuple[bytes, ...]:
    """The spec's HKDF (section 4.3): HMAC-SHA256 extract then 2 or 3 chained expand blocks."""
    temp_key = _hmac(chaining_key, ikm)
    out: list[bytes] = []
    prev = b""
    for i in range(1, outputs + 1):
        prev = _hmac(temp_key, prev + bytes([i]))
        out.append(prev)
    return tuple(out)


def _dh(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:
        # cryptography refuses low-order points (an all-zero shared secret): a forged ephemeral.
        raise NoiseError("the peer sent an invalid X25519 public key") from exc


def _public_bytes(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def generate_static() -> bytes:
    """A new X25519 private key, as the 32 raw bytes a HandshakeState takes as `static`."""
    return X25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def public_key(static: bytes) -> bytes:
    """The 32-byte X25519 public key of a raw private key."""
    return _public_bytes(X25519PrivateKey.from_private_bytes(static))


class CipherState:
    """A key and the counter nonce that goes with it (section 5.1). The nonce never leaves this object."""

    def __init__(self, key: bytes | None = None) -> None:
        self._aead: ChaCha20Poly1305 | None = None
        self.n = 0
        self.initialize_key(key)

    def initialize_key(self, key: bytes | None) -> None:
        self._aead = ChaCha20Poly1305(key) if key is not None else None
        self.n = 0

    def has_key(self) -> bool:
        return self._aead is not None

    def _nonce(self) -> bytes:
        if self.n >= MAX_NONCE:
            raise NoiseError("nonce exhausted: this key must not be used again")
        return b"\x00\x00\x00\x00" + struct.pack("<Q", self.n)

    def encrypt_with_ad(self, ad: bytes, plaintext: bytes) -> bytes:
        if self._aead is None:
            return plaintext
        ciphertext = self._aead.encrypt(self._nonce(), plaintext, ad)
        self.n += 1
        return ciphertext

    def decrypt_with_ad(self, ad: bytes, ciphertext: bytes) -> bytes:
        if self._aead is None:
            return ciphertext
        try:
            plaintext = self._aead.decrypt(self._nonce(), ciphertext, ad)
        except InvalidTag as exc:
            # The nonce is not advanced on failure (spec 5.1), but callers treat the state as dead anyway.
            raise NoiseError("message failed authentication") from exc
        self.n += 1
        return plaintext


class SymmetricState:
    """The chaining key, the handshake hash and the current CipherState (section 5.2)."""

    def __init__(self, protocol_name: bytes) -> None:
        # InitializeSymmetric
        if len(protocol_name) <= HASHLEN:
            self.h = protocol_name.ljust(HASHLEN, b"\x00")
        else:
            self.h = _hash(protocol_name)
        self.ck = self.h
        self.cipher = CipherState()

    def mix_key(self, ikm: bytes) -> None:
        self.ck, temp_k = hkdf(self.ck, ikm, 2)
        self.cipher.initialize_key(temp_k)

    def mix_hash(self, data: bytes) -> None:
        self.h = _hash(self.h + data)

    def mix_key_and_hash(self, ikm: bytes) -> None:
        self.ck, temp_h, temp_k = hkdf(self.ck, ikm, 3)
        self.mix_hash(temp_h)
        self.cipher.initialize_key(temp_k)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ciphertext = self.cipher.encrypt_with_ad(self.h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        plaintext = self.cipher.decrypt_with_ad(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[CipherState, CipherState]:
        temp_k1, temp_k2 = hkdf(self.ck, b"", 2)
        return CipherState(temp_k1), CipherState(temp_k2)


class HandshakeState:
    """One side of a handshake (section 5.3) for `pattern` in PATTERNS.

    `static` is this side's long-term private key (32 bytes), needed by patterns with an "s" token;
    `remote_static` is the peer's public key once a handshake message carried it.
    `ephemeral` fixes the ephemeral private key (32 bytes); only test vectors should pass it.
    After the last message, `split()` returns (send, receive) CipherStates for this side.
    """

    def __init__(
        self,
        pattern: str,
        initiator: bool,
        prologue: bytes = b"",
        psk: bytes | None = None,
        ephemeral: bytes | None = None,
        static: bytes | None = None,
    ) -> None:
        if pattern not in PATTERNS:
            raise NoiseError(f"unsupported Noise pattern {pattern!r}")
        uses_static = any("s" in message for message in PATTERNS[pattern])
        if uses_static and (static is None or len(static) != DHLEN):
            raise NoiseError(f"pattern {pattern} needs a {DHLEN}-byte static private key")
        uses_psk = "psk" in pattern
        if uses_psk and (psk is None or len(psk) != PSKLEN):
            raise NoiseError(f"pattern {pattern} needs a {PSKLEN}-byte psk")
        if not uses_psk and psk is not None:
            raise NoiseError(f"pattern {pattern} takes no psk")
        self.protocol_name = f"Noise_{pattern}_{SUITE}"
        self.initiator = initiator
        self._messages = PATTERNS[pattern]
        self._uses_psk = uses_psk
        self._psk = psk
        self._e = X25519PrivateKey.from_private_bytes(ephemeral) if ephemeral is not None else None
        self._s = X25519PrivateKey.from_private_bytes(static) if static is not None else None
        self._re: bytes | None = None
        self.remote_static: bytes | None = None
        self._index = 0
        self._failed = False
        self.symmetric = SymmetricState(self.protocol_name.encode("ascii"))
        self.symmetric.mix_hash(prologue)

    @property
    def finished(self) -> bool:
        return self._index >= len(self._messages)

    @property
    def handshake_hash(self) -> bytes:
        return self.symmetric.h

    def _next_tokens(self, writing: bool) -> tuple[str, ...]:
        if self._failed:
            raise NoiseError("handshake already failed")
        if self.finished:
            raise NoiseError("handshake already finished")
        initiators_turn = self._index % 2 == 0
        if initiators_turn != (self.initiator == writing):
            raise NoiseError("out of turn: it is the other side's message")
        tokens = self._messages[self._index]
        self._index += 1
        return tokens

    def write_message(self, payload: bytes = b"") -> bytes:
        tokens = self._next_tokens(writing=True)
        out = bytearray()
        for token in tokens:
            if token == "e":
                if self._e is None:
                    self._e = X25519PrivateKey.generate()
                out += self._mix_ephemeral(_public_bytes(self._e))
            elif token == "s":
                assert self._s is not None  # checked in __init__
                out += self.symmetric.encrypt_and_hash(_public_bytes(self._s))
            else:
                self._mix_token(token)
        out += self.symmetric.encrypt_and_hash(payload)
        if len(out) > MAX_MESSAGE:
            self._failed = True
            raise NoiseError(f"handshake message of {len(out)} bytes exceeds {MAX_MESSAGE}")
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        tokens = self._next_tokens(writing=False)
        try:
            return self._read(tokens, message)
        except NoiseError:
            self._failed = True
            raise

    def _read(self, tokens: tuple[str, ...], message: bytes) -> bytes:
        if len(message) > MAX_MESSAGE:
            raise NoiseError(f"handshake message of {len(message)} bytes exceeds {MAX_MESSAGE}")
        rest = message
        for token in tokens:
            if token == "e":
                if len(rest) < DHLEN:
                    raise NoiseError("handshake message too short for an ephemeral key")
                self._re, rest = rest[:DHLEN], rest[DHLEN:]
                self._mix_ephemeral(self._re)
            elif token == "s":
                size = DHLEN + (TAGLEN if self.symmetric.cipher.has_key() else 0)
                if len(rest) < size:
                    raise NoiseError("handshake message too short for a static key")
                self.remote_static = self.symmetric.decrypt_and_hash(rest[:size])
                rest = rest[size:]
            else:
                self._mix_token(token)
        if self.symmetric.cipher.has_key() and len(rest) < TAGLEN:
            raise NoiseError("handshake message too short for its authentication tag")
        return self.symmetric.decrypt_and_hash(rest)

    def _mix_ephemeral(self, public: bytes) -> bytes:
        self.symmetric.mix_hash(public)
        if self._uses_psk:
            # psk patterns (spec 9.2): "e" also feeds the key so the psk-derived key is never reused.
            self.symmetric.mix_key(public)
        return public

    def _mix_token(self, token: str) -> None:
        if token == "ee":
            self.symmetric.mix_key(_dh(self._need(self._e), self._need(self._re)))
        elif token in ("es", "se"):
            # "es" is the initiator's ephemeral with the responder's static; "se" the other way round.
            ours_ephemeral = (token == "es") == self.initiator
            if ours_ephemeral:
                self.symmetric.mix_key(_dh(self._need(self._e), self._need(self.remote_static)))
            else:
                self.symmetric.mix_key(_dh(self._need(self._s), self._need(self._re)))
        elif token == "psk":
            assert self._psk is not None  # checked in __init__
            self.symmetric.mix_key_and_hash(self._psk)
        else:
            raise NoiseError(f"unsupported token {token!r}")

    @staticmethod
    def _need(key):
        if key is None:
            raise NoiseError("a DH token came before both of its keys were known")
        return key

    def split(self) -> tuple[CipherState, CipherState]:
        """(send, receive) for this side: the initiator sends with c1, the responder with c2."""
        if not self.finished or self._failed:
            raise NoiseError("the handshake is not finished")
        c1, c2 = self.symmetric.split()
        return (c1, c2) if self.initiator else (c2, c1)
