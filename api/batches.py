"""Files and batches (OpenAI's Files and Batch APIs): writes, reads and their OpenAI shapes.

The worker's side (validating lines, running them, writing the output) is `api.batch_run`; the Celery task that
drives it is `api.tasks.batch_run_task`. A file or batch belongs to its owner: another owner's is not found.
"""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.db.models.functions import Cast
from django.utils import timezone
from django.utils.crypto import constant_time_compare, salted_hmac

from api.errors import OpenAIError, invalid
from api.models import ApiKey, Batch, BatchFile, BatchLine
from sessions.models import Generation

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
WINDOW = re.compile(r"^(\d{1,6})([smh])$")
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 24 * 3600
ACTIVE = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS, Batch.Status.FINALIZING, Batch.Status.CANCELLING)
BATCH_HEADER = "X-Fleet-Batch"


def _ts(when) -> int | None:
    return int(when.timestamp()) if when else None


def file_ref(row: BatchFile) -> str:
    return f"file-{row.id.hex}"


def batch_ref(row: Batch) -> str:
    return f"batch_{row.id.hex}"


def _uuid(ref: str, prefix: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(ref.removeprefix(prefix))
    except (ValueError, AttributeError):
        return None


# --- files ------------------------------------------------------------------------------------------------------


def file_object(row: BatchFile) -> dict[str, Any]:
    return {"id": file_ref(row), "object": "file", "bytes": row.bytes, "created_at": _ts(row.created_at),
            "filename": row.filename, "purpose": row.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def file_create(*, owner, filename: str, purpose: str, content: bytes) -> BatchFile:
    """Store an uploaded file. Only purpose `batch` is taken; the lines are checked when a batch runs."""
    if purpose != BatchFile.Purpose.BATCH:
        raise invalid(f"purpose must be \"batch\" (got {purpose!r}): Fleet stores files for the Batch API only.",
                      param="purpose")
    limit = settings.FLEET_BATCH_FILE_MAX_BYTES
    if len(content) > limit:
        raise invalid(f"The file is {len(content)} bytes; at most {limit} are taken (FLEET_BATCH_FILE_MAX_BYTES). "
                      "Split it into several batches.", param="file", code="file_too_large")
    return BatchFile.objects.create(owner=owner, filename=filename[:255] or "upload.jsonl", purpose=purpose,
                                    bytes=len(content), content=content)


def file_get(*, owner, ref: str) -> BatchFile:
    pk = _uuid(ref, "file-")
    row = BatchFile.objects.filter(pk=pk, owner=owner).first() if pk else None
    if row is None:
        raise OpenAIError(404, f"No such File object: {ref}.", code="file_not_found", param="file_id")
    return row


def file_list(*, owner, purpose: str | None = None, limit: int = 100, after: str | None = None) -> dict[str, Any]:
    rows = BatchFile.objects.filter(owner=owner).defer("content")
    if purpose:
        rows = rows.filter(purpose=purpose)
    return _page(rows, limit, after and file_get(owner=owner, ref=after), file_object)


def file_delete(*, owner, ref: str) -> dict[str, Any]:
    row = file_get(owner=owner, ref=ref)
    row.delete()
    return {"id": ref, "object": "file", "deleted": True}


def file_purge(*, retention_days: int) -> int:
    """Delete the batch files older than `retention_days` (0: keep them), except those a batch not yet over reads or
    writes; a finished batch keeps its counts, its file ids then answer 404. Returns how many went."""
    if retention_days <= 0:
        return 0
    live = Batch.objects.filter(status__in=ACTIVE)
    keep = {pk for row in live.values_list("input_file_id", "output_file_id", "error_file_id") for pk in row if pk}
    old = BatchFile.objects.filter(created_at__lt=timezone.now() - timedelta(days=retention_days)).exclude(pk__in=keep)
    return old.delete()[1].get(BatchFile._meta.label, 0)


def _page(rows, limit: int, after, shape) -> dict[str, Any]:
    if after is not None:
        rows = rows.filter(created_at__lte=after.created_at).exclude(pk=after.pk).exclude(
            created_at=after.created_at, pk__gte=after.pk)
    rows = list(rows.order_by("-created_at", "-pk")[: limit + 1])
    data = [shape(r) for r in rows[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}


# --- batches ----------------------------------------------------------------------------------------------------


def batch_object(row: Batch) -> dict[str, Any]:
    return {
        "id": batch_ref(row), "object": "batch", "endpoint": row.endpoint, "errors": row.errors,
        "input_file_id": row.input_file_ref, "completion_window": row.completion_window, "status": row.status,
        "output_file_id": f"file-{row.output_file_id.hex}" if row.output_file_id else None,
        "error_file_id": f"file-{row.error_file_id.hex}" if row.error_file_id else None,
        "created_at": _ts(row.created_at), "in_progress_at": _ts(row.in_progress_at),
        "expires_at": _ts(row.expires_at), "finalizing_at": _ts(row.finalizing_at),
        "completed_at": _ts(row.completed_at), "failed_at": _ts(row.failed_at), "expired_at": _ts(row.expired_at),
        "cancelling_at": _ts(row.cancelling_at), "cancelled_at": _ts(row.cancelled_at),
        "request_counts": {"total": row.total, "completed": row.completed, "failed": row.failed},
        "metadata": row.metadata,
    }


def window_seconds(window: Any) -> int:
    """`24h` as OpenAI takes it; Fleet also takes shorter windows (`90s`, `30m`, `2h`), up to 24 hours."""
    match = WINDOW.match(window) if isinstance(window, str) else None
    seconds = int(match[1]) * WINDOW_UNITS[match[2]] if match else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise invalid(f"completion_window must be \"24h\" or a shorter window such as \"30m\" (got {window!r}).",
                      param="completion_window")
    return seconds


def batch_create(*, api_key: ApiKey, body: dict[str, Any]) -> Batch:
    """Record a batch and enqueue its run (after the commit)."""
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise invalid(f"endpoint must be one of {', '.join(ENDPOINTS)} (got {endpoint!r}).", param="endpoint")
    seconds = window_seconds(body.get("completion_window"))
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise invalid("metadata must be an object of at most 16 string keys and string values.", param="metadata")
    ref = body.get("input_file_id")
    source = file_get(owner=api_key.owner, ref=ref) if isinstance(ref, str) else None
    if source is None or source.purpose != BatchFile.Purpose.BATCH:
        raise invalid("input_file_id must name a file uploaded with purpose \"batch\".", param="input_file_id")
    row = Batch.objects.create(owner=api_key.owner, api_key=api_key, endpoint=endpoint, input_file=source,
                               input_file_ref=ref, completion_window=body["completion_window"], metadata=metadata,
                               expires_at=timezone.now() + timedelta(seconds=seconds))
    from api.tasks import batch_run_task

    batch_run_task.delay_on_commit(str(row.pk))
    return row


def batch_get(*, owner, ref: str) -> Batch:
    pk = _uuid(ref, "batch_")
    row = Batch.objects.filter(pk=pk, owner=owner).first() if pk else None
    if row is None:
        raise OpenAIError(404, f"No such Batch object: {ref}.", code="batch_not_found", param="batch_id")
    return row


def batch_list(*, owner, limit: int = 20, after: str | None = None) -> dict[str, Any]:
    return _page(Batch.objects.filter(owner=owner), limit, after and batch_get(owner=owner, ref=after), batch_object)


def batch_generations(*, ref: str) -> models.QuerySet[Generation]:
    """The generation records a batch's lines made (any owner's: the admin's view). An answered line names its
    generation in `request_id` (the X-Fleet-Generation header the head answered it with); a line refused before it
    reached a node names none, and a record purged by retention is gone. A ref that names no batch: none."""
    pk = _uuid(ref, "batch_")
    if pk is None:
        return Generation.objects.none()
    made = BatchLine.objects.filter(batch_id=pk).exclude(request_id="").annotate(
        generation_id=Cast("request_id", models.UUIDField())).values("generation_id")
    return Generation.objects.filter(pk__in=made)


def batch_cancel(*, owner, ref: str) -> Batch:
    """Ask the worker to stop: it starts no new line from then on and ends the batch `cancelled`."""
    row = batch_get(owner=owner, ref=ref)
    with transaction.atomic():
        moved = Batch.objects.filter(pk=row.pk, status__in=(Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS)
                                     ).update(status=Batch.Status.CANCELLING, cancelling_at=timezone.now())
    row.refresh_from_db()
    if not moved and row.status not in (Batch.Status.CANCELLING, Batch.Status.CANCELLED):
        raise OpenAIError(409, f"Cannot cancel a batch that is {row.status}.", code="batch_not_cancellable")
    return row


# --- the worker's credential --------------------------------------------------------------------------------------


def batch_credential(batch_id: str) -> str:
    """What the worker sends in X-Fleet-Batch for a batch's lines: the batch id signed with SECRET_KEY, so only a
    process holding the head's secret can act as the batch's key (and at batch priority)."""
    return f"{batch_id}.{salted_hmac('fleet.batch-line', batch_id).hexdigest()}"


def batch_key_for(credential: str) -> ApiKey | None:
    """The API key a batch's lines run as, from a valid X-Fleet-Batch credential of a batch still running."""
    batch_id, _, signature = credential.partition(".")
    if not constant_time_compare(signature, salted_hmac("fleet.batch-line", batch_id).hexdigest()):
        return None
    row = Batch.objects.filter(pk=_uuid(batch_id, ""), status__in=ACTIVE).select_related(
        "api_key__owner").first() if _uuid(batch_id, "") else None
    key = row.api_key if row else None
    return key if key is not None and key.is_active and key.owner.is_active else None
