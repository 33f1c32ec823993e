"""Where the head keeps content-addressed blobs (model files, tokenizers' sources, media): one file per SHA-256."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings


def blob_dir() -> Path:
    return Path(settings.FLEET_HOME) / "blobs"


def blob_path(sha256: str) -> Path:
    return blob_dir() / sha256
