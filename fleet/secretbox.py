"""Encryption at rest for secrets the head must read back (fleet token secrets, the head's link key).

Sealed with SECRET_KEY; read with SECRET_KEY or any of SECRET_KEY_FALLBACKS (MultiFernet), so rotating the key
with the old one kept as a fallback leaves every stored secret readable. `reseal` moves one onto the current key.
"""

import base64
from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings


class SecretUnreadable(Exception):
    """The stored secret cannot be decrypted (SECRET_KEY changed without a fallback, or the row was tampered with)."""


@lru_cache(maxsize=16)
def _fernet(secret_key: str) -> Fernet:
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"fleet-secretbox-v1", info=b"fleet token secrets").derive(
        secret_key.encode()
    )
    return Fernet(base64.urlsafe_b64encode(key))


def _box() -> MultiFernet:
    keys = [settings.SECRET_KEY, *getattr(settings, "SECRET_KEY_FALLBACKS", [])]
    return MultiFernet([_fernet(key) for key in keys])


def seal(plaintext: bytes) -> str:
    return _box().encrypt(plaintext).decode()


def unseal(sealed: str) -> bytes:
    try:
        return _box().decrypt(sealed.encode())
    except InvalidToken as exc:
        raise SecretUnreadable(
            "the stored secret cannot be decrypted with SECRET_KEY or any of SECRET_KEY_FALLBACKS "
            "(was SECRET_KEY changed without keeping the old one in FLEET_SECRET_KEY_FALLBACKS?)"
        ) from exc


def reseal(sealed: str) -> str:
    """The same secret sealed with the current SECRET_KEY (raises SecretUnreadable like `unseal`)."""
    try:
        return _box().rotate(sealed.encode()).decode()
    except InvalidToken as exc:
        raise SecretUnreadable("the stored secret cannot be decrypted, so it cannot be resealed") from exc
