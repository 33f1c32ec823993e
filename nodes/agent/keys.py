"""The node's own link key and the head key it pinned, kept 0600 under `$FLEET_HOME/fleet/`.

The node key says "I am this node": the head binds the node's identity to it at the first join. The pinned head
key says "this is my fleet's head": written only once a head proved it holds the token's secret, so a responder
without it leaves no pin; a head that presents another key is refused until the owner accepts it.
"""

from __future__ import annotations

import os
from pathlib import Path

from nodes.link.handshake import fingerprint
from nodes.link.noise import DHLEN, generate_static, public_key


class KeyFileError(Exception):
    """A key file that cannot be read or is not a key; the host owner must fix or remove it."""


def node_key_path(home: Path) -> Path:
    return home / "fleet" / "node_key"


def head_pin_path(home: Path) -> Path:
    return home / "fleet" / "head_key"


def _read_hex(path: Path, what: str) -> bytes:
    try:
        raw = bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{what} in {path} is unreadable ({exc}); remove the file to start afresh") from exc
    if len(raw) != DHLEN:
        raise KeyFileError(f"{what} in {path} is {len(raw)} bytes, not {DHLEN}; remove the file to start afresh")
    return raw


def _write_new(path: Path, data: bytes) -> bool:
    """Write `data` as hex to a new 0600 file; False when another process made the file first. The file appears
    whole or not at all (written beside it, then linked into place, which fails if it exists): two node processes
    of one host starting together agree on one key, and neither reads the other's before it is written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(data.hex() + "\n")
        os.link(draft, path)
    except FileExistsError:
        return False
    finally:
        draft.unlink(missing_ok=True)
    return True


def node_key(home: Path) -> bytes:
    """This node's static private key, made at the first join (two node processes agree on one key)."""
    path = node_key_path(home)
    if not path.exists():
        _write_new(path, generate_static())
    return _read_hex(path, "the node key")


def node_key_fingerprint(home: Path) -> str:
    return fingerprint(public_key(node_key(home)))


def pinned_head(home: Path) -> bytes | None:
    """The head key this node pinned when a head first proved the token to it, or None before that."""
    path = head_pin_path(home)
    return _read_hex(path, "the pinned head key") if path.exists() else None


def pin_head(home: Path, key: bytes) -> bool:
    """Pin the head's key once the head proved the token (the dialer's `_head_proved`), at the first join or after
    `forget_head`; a pin already there is kept. True when this call wrote it."""
    if len(key) != DHLEN:
        raise ValueError(f"a head key is {DHLEN} bytes, not {len(key)}")
    return _write_new(head_pin_path(home), key)


def forget_head(home: Path) -> None:
    """`node_join --accept-new-head`: the next head this node reaches is pinned afresh."""
    head_pin_path(home).unlink(missing_ok=True)
