"""The registry's files for nodes: `GET /models/blobs/<sha256>` with a pull grant, in Range requests.

A node sends its grant (from the PullGrant link message) as `Authorization: Fleet-Grant <grant>`, never in the URL,
and asks for byte ranges so an interrupted pull resumes where it stopped. No database access: the grant is signed.
"""

from __future__ import annotations

import asyncio
import logging
import re

from django.http import HttpResponse, JsonResponse, StreamingHttpResponse

from fleet import metrics
from nodes.registry import CHUNK, GrantRefused, model_grant_open

log = logging.getLogger("nodes")

RANGE_RE = re.compile(r"bytes=(\d+)-(\d*)")
GRANT_PREFIX = "Fleet-Grant "


def _refuse(status: int, detail: str) -> HttpResponse:
    return JsonResponse({"detail": detail}, status=status)


def _byte_range(header: str, size: int) -> tuple[int, int] | None:
    """(first, last) of a single `bytes=first-[last]` range within the file; None when it is not one."""
    match = RANGE_RE.fullmatch(header.strip())
    if match is None:
        return None
    first = int(match.group(1))
    last = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
    return (first, last) if first <= last else None


async def _read(path, first: int, last: int):
    with open(path, "rb") as handle:
        handle.seek(first)
        left = last - first + 1
        while left > 0:
            chunk = await asyncio.to_thread(handle.read, min(CHUNK, left))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk


async def model_blob(request, sha256: str) -> HttpResponse:
    if request.method != "GET":
        return _refuse(405, "only GET")
    auth = request.headers.get("Authorization", "")
    if not auth.startswith(GRANT_PREFIX):
        return _refuse(401, "a pull needs `Authorization: Fleet-Grant <grant>`; nodes get one over their link")
    try:
        path = model_grant_open(grant=auth[len(GRANT_PREFIX):].strip(), sha256=sha256)
    except GrantRefused as exc:
        return _refuse(403, str(exc))
    if not path.exists():
        return _refuse(404, "the registry no longer holds this file (its model was deleted)")
    size = path.stat().st_size
    first, last, status = 0, size - 1, 200
    if "Range" in request.headers:
        span = _byte_range(request.headers["Range"], size)
        if span is None:
            response = _refuse(416, f"give one range `bytes=FIRST-[LAST]` within the file's {size} bytes")
            response["Content-Range"] = f"bytes */{size}"
            return response
        first, last, status = *span, 206
    log.info("fleet: model file %s… bytes %d-%d of %d to %s", sha256[:12], first, last, size,
             request.META.get("REMOTE_ADDR", ""))
    response = StreamingHttpResponse(_read(path, first, last), status=status,
                                     content_type="application/octet-stream")
    response["Content-Length"] = str(last - first + 1)
    metrics.blob_served(size=last - first + 1)
    response["Accept-Ranges"] = "bytes"
    if status == 206:
        response["Content-Range"] = f"bytes {first}-{last}/{size}"
    return response
