"""A node's cache of media blobs (audio for transcriptions, images in chats) by content hash:
`$FLEET_HOME/media/<sha256>`.

A generation names its blobs by sha256 with a grant (`{"sha256", "size", "path", "grant"}`: GenerateSpec.audio, and
the image parts of GenerateSpec.images). A blob this node holds is used as it is, and no byte moves; one it lacks is
fetched once with the model registry's authorized HTTP pull (nodes.agent.pull.fetch_blob), its hash checked, and
kept. The cache holds at most FLEET_MEDIA_CACHE_BYTES (default 1 GiB); past that the least recently used blobs go
first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from pathlib import Path
from typing import Any

from nodes.agent import pull

log = logging.getLogger("nodes.agent")

DEFAULT_CAP_BYTES = 1 << 30
SHA256_RE = re.compile(r"[0-9a-f]{64}")


class MediaError(Exception):
    """A blob the node could not get from the head (refused, gone, or not matching its hash)."""


class MediaCache:
    """Blobs by hash under `home/media`, least recently used first out past `cap` bytes. `fetched_bytes` counts
    what came from the head."""

    def __init__(self, home: Path, cap: int | None = None) -> None:
        self.folder = home / "media"
        self.cap = cap if cap is not None else int(os.environ.get("FLEET_MEDIA_CACHE_BYTES") or DEFAULT_CAP_BYTES)
        self.fetched_bytes = 0

    def get(self, head_url: str, blob: dict[str, Any]) -> Path:
        """The local file of `blob`, fetched from the head at `head_url` when this node lacks it. Blocking."""
        sha256, size = str(blob.get("sha256", "")), int(blob.get("size", 0))
        if not SHA256_RE.fullmatch(sha256):
            raise MediaError(f"{sha256!r} is no sha256")
        path = self.folder / sha256
        if path.is_file():
            os.utime(path)  # the LRU order is the files' modification times
            return path
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            pull.fetch_blob(head_url.rstrip("/") + str(blob.get("path", "")), str(blob.get("grant", "")), sha256,
                            size, path)
        except (pull.PullError, OSError) as exc:
            raise MediaError(str(exc)) from None
        self.fetched_bytes += size
        log.info("fleet node: fetched media %s… (%d bytes) from the head", sha256[:12], size)
        self.trim(keep=path)
        return path

    def trim(self, keep: Path | None = None) -> None:
        """Remove the least recently used blobs until the cache holds at most `cap` bytes (never `keep`)."""
        files = sorted((p for p in self.folder.iterdir() if SHA256_RE.fullmatch(p.name)),
                       key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for old in files:
            if total <= self.cap:
                return
            if old != keep:
                total -= old.stat().st_size
                old.unlink(missing_ok=True)


async def media_ready(cache: MediaCache, head_url: str, spec) -> str | None:
    """Make `spec.audio` and every image part of its messages name a local file (`local_path`), fetching each blob
    this node lacks off the event loop; the error text if one cannot be had."""
    blobs = ([("audio", spec.audio)] if spec.audio is not None else []) + [("image", p) for p in spec.images()]
    for kind, holder in blobs:
        blob = holder if kind == "audio" else holder.get("image")
        try:
            path = await asyncio.to_thread(cache.get, head_url, blob if isinstance(blob, dict) else {})
        except (MediaError, ValueError, TypeError) as exc:
            return f"the node could not get the {kind} blob from the head: {exc}"
        if kind == "audio":
            spec.audio = {**spec.audio, "local_path": str(path)}
        else:
            holder["image"] = {**blob, "local_path": str(path)}
    return None
