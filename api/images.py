"""Images in chat messages: OpenAI's `image_url` content parts (and the Responses shape's `input_image`).

An image arrives as a data URL (`data:image/png;base64,...`), or as a remote `http(s)` URL that the head fetches only
when FLEET_MEDIA_REMOTE_URLS allows its host (off by default: a fleet often has no internet, and a head that fetches
any URL it is given is a server-side request forgery risk), within FLEET_MAX_IMAGE_BYTES and
FLEET_MEDIA_REMOTE_TIMEOUT_S, following no redirect. The head checks its type (PNG, JPEG, GIF or BMP: what the node's
decoder reads) and its size in pixels from its header, keeps it in the blobs by sha256 (nodes.registry.media_put) and
names it in the message by hash; the node fetches a blob it lacks once and keeps it, so the same image in the next
turn moves no bytes. What the header cannot show (a truncated or corrupt body) the node's decoder finds: a 400 too.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from django.conf import settings

from api.errors import OpenAIError, invalid
from nodes.registry import media_put

IMAGE_FORMATS = ("png", "jpeg", "gif", "bmp")
IMAGE_PART_TYPES = ("image_url", "input_image")


def image_format(data: bytes) -> str | None:
    """The image type from its first bytes, or None when it is none the node's decoder reads."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if data.startswith(b"BM"):
        return "bmp"
    return None


def image_size(data: bytes, fmt: str) -> tuple[int, int] | None:
    """(width, height) from the image's header, or None when the header is not readable."""
    try:
        if fmt == "png":
            return struct.unpack(">II", data[16:24]) if data[12:16] == b"IHDR" else None
        if fmt == "gif":
            return struct.unpack("<HH", data[6:10])
        if fmt == "bmp":
            width, height = struct.unpack("<ii", data[18:26])
            return width, abs(height)
        return _jpeg_size(data)
    except struct.error:
        return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The frame size from a JPEG's SOFn segment (SOF0-15 less DHT, JPG and DAC)."""
    offset = 2
    while offset + 9 <= len(data):
        if data[offset] != 0xFF:
            return None
        marker = data[offset + 1]
        if marker == 0xFF:
            offset += 1
            continue
        length = struct.unpack(">H", data[offset + 2 : offset + 4])[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", data[offset + 5 : offset + 9])
            return width, height
        offset += 2 + length
    return None


def image_part(part: dict[str, Any], param: str) -> dict[str, Any]:
    """A content part with an image as the node reads it: `{"type": "image", "image": {"sha256", "size"}}`.
    Blocking (may fetch a remote URL; hashes and stores the bytes). Raises OpenAIError for a bad image."""
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise invalid(f"{param} needs an image URL: {{\"type\": \"image_url\", \"image_url\": {{\"url\": "
                      "\"data:image/png;base64,...\"}}.", param=param)
    data = _remote(url, param) if url.startswith(("http://", "https://")) else _data_url(url, param)
    fmt = image_format(data)
    if fmt is None:
        raise invalid(f"{param}: the image is of a type this fleet does not read; send one of: "
                      f"{', '.join(IMAGE_FORMATS)}.", param=param, code="unsupported_image_format")
    size = image_size(data, fmt)
    if size is None or min(size) <= 0:
        raise invalid(f"{param}: the {fmt} image could not be decoded (its header is damaged or cut off).",
                      param=param, code="invalid_image")
    if size[0] * size[1] > settings.FLEET_MAX_IMAGE_PIXELS:
        raise invalid(f"{param}: the image is {size[0]}x{size[1]} pixels; this head takes at most "
                      f"{settings.FLEET_MAX_IMAGE_PIXELS} (FLEET_MAX_IMAGE_PIXELS). Send a smaller one.",
                      param=param, code="image_too_large")
    sha256, stored = media_put(io.BytesIO(data))
    return {"type": "image", "image": {"sha256": sha256, "size": stored, "format": fmt}}


def _too_large(param: str, size: int | str) -> OpenAIError:
    return invalid(f"{param}: the image has {size} bytes; this head takes at most {settings.FLEET_MAX_IMAGE_BYTES} "
                   "(FLEET_MAX_IMAGE_BYTES).", param=param, code="image_too_large")


def _data_url(url: str, param: str) -> bytes:
    head, comma, payload = url.partition(",")
    if not url.startswith("data:") or not comma or not head.endswith(";base64"):
        raise invalid(f"{param}: an image URL must be a base64 data URL (data:image/png;base64,...) or an http(s) "
                      "URL; got " + repr(url[:40]), param=param, code="invalid_image_url")
    if len(payload) > settings.FLEET_MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise _too_large(param, f"about {len(payload) * 3 // 4}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{param}: the data URL's payload is not valid base64.", param=param,
                      code="invalid_image") from None
    if len(data) > settings.FLEET_MAX_IMAGE_BYTES:
        raise _too_large(param, len(data))
    return data


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # a redirect could lead past the allowed hosts
        raise urllib.error.HTTPError(req.full_url, code, f"redirected to {newurl}; follow it yourself", headers, fp)


def remote_allowed(host: str) -> bool:
    """Whether FLEET_MEDIA_REMOTE_URLS lets the head fetch from `host` ("*": any host; else a list of hosts)."""
    allowed = settings.FLEET_MEDIA_REMOTE_URLS
    return "*" in allowed or host.lower() in allowed


def _remote(url: str, param: str) -> bytes:
    try:
        host = urllib.parse.urlsplit(url).hostname or ""
    except ValueError as exc:  # e.g. "http://[x/": an unclosed IPv6 address
        raise invalid(f"{param}: the image URL cannot be read: {exc}.", param=param, code="invalid_image_url") from None
    if "\\" in url or any(ord(c) < 33 for c in url):  # parsers disagree about these (a backslash is a slash to some)
        raise invalid(f"{param}: an image URL may hold no backslash, space or control character.", param=param,
                      code="invalid_image_url")
    if not remote_allowed(host):
        raise invalid(f"{param}: this head does not fetch remote image URLs ({host or url[:40]!r}); send the image "
                      "as a base64 data URL, or ask the operator to allow the host in FLEET_MEDIA_REMOTE_URLS.",
                      param=param, code="remote_url_not_allowed")
    limit = settings.FLEET_MAX_IMAGE_BYTES
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "fleet-head"}),  # noqa: S310 - http(s) only
                         timeout=settings.FLEET_MEDIA_REMOTE_TIMEOUT_S) as response:
            data = _read(response, limit + 1, time.monotonic() + settings.FLEET_MEDIA_REMOTE_TIMEOUT_S)
    except TimeoutError:
        raise invalid(f"{param}: fetching the image from {url[:80]!r} took longer than "
                      f"{settings.FLEET_MEDIA_REMOTE_TIMEOUT_S} s (FLEET_MEDIA_REMOTE_TIMEOUT_S).", param=param,
                      code="image_fetch_failed") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise invalid(f"{param}: the head could not fetch the image from {url[:80]!r}: {exc}", param=param,
                      code="image_fetch_failed") from None
    if len(data) > limit:
        raise _too_large(param, f"more than {limit}")
    return data


def _read(response, limit: int, deadline: float) -> bytes:
    """At most `limit` bytes, all before `deadline` (a server that drips a byte at a time gets no longer)."""
    chunks, total = [], 0
    while total < limit:
        if time.monotonic() > deadline:
            raise TimeoutError
        chunk = response.read(min(64 * 1024, limit - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)
