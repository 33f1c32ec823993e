"""Encryption at rest for secrets the head must read back (fleet token secrets, which key the link's PSK)."""

import base64
from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings


class SecretUnreadable(Exception):
    """The stored secret cannot be decrypted (SECRET_KEY changed, or the row was tampered with)."""


@lru_cache(maxsize=4)
def _fernet(secret_key: str) -> Fernet:
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"fleet-secretbox-v1", info=b"fleet token secrets").derive(
        secret_key.encode()
    )
    return Fernet(base64.urlsafe_b64encode(key))


def seal(plaintext: bytes) -> str:
    return _fernet(settings.SECRET_KEY).encrypt(plaintext).decode()


def unseal(sealed: str) -> bytes:
    try:
        return _fernet(settings.SECRET_KEY).decrypt(sealed.encode())
    except InvalidToken as exc:
        raise SecretUnreadable("the stored secret cannot be decrypted with this SECRET_KEY") from exc
