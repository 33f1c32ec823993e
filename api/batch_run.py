"""Running a batch, on a Celery worker: validate its lines, run them through the head's /v1 with bounded
concurrency, write the output and error files.

The worker holds no node link: each line is an HTTP request to a head process (FLEET_HEAD_URL) carrying the
batch's signed credential (api.batches.batch_credential), which runs it as the batch's key at batch priority.

Exactly once: every line is a BatchLine row. A line is claimed with a conditional UPDATE (pending -> running,
with this run's claim id) and answered by another (running under that claim -> done/failed, with the result and
the batch's counts in the same transaction). One run holds a batch at a time (`runner`, refreshed every few
seconds); a run that finds the runner stale (its worker killed) takes the batch over and puts the lines the dead
run had claimed back to pending. Such a line may be generated twice; it is answered once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Any

import httpx
from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from api.batches import BATCH_HEADER, batch_credential
from api.models import Batch, BatchFile, BatchLine
from fleet import tracing

log = logging.getLogger("api")

TRANSIENT_STATUS = {429, 502, 503, 504}  # put back and sent again, until the batch expires
ENDED = (Batch.Status.COMPLETED, Batch.Status.FAILED, Batch.Status.EXPIRED, Batch.Status.CANCELLED)


def batch_take(batch_id: str, run_id: str) -> bool:
    """Become the batch's runner unless a live one holds it; a stale runner's claimed lines go back to pending."""
    stale = timezone.now() - timedelta(seconds=settings.FLEET_BATCH_LEASE_S)
    with transaction.atomic():
        taken = Batch.objects.filter(pk=batch_id).exclude(status__in=ENDED).filter(
            Q(runner="") | Q(runner_seen_at__lt=stale)).update(runner=run_id, runner_seen_at=timezone.now())
        if taken:
            BatchLine.objects.filter(batch_id=batch_id, status=BatchLine.Status.RUNNING).update(
                status=BatchLine.Status.PENDING, claim="")
    return bool(taken)


def batch_heartbeat(batch_id: str, run_id: str) -> bool:
    return bool(Batch.objects.filter(pk=batch_id, runner=run_id).update(runner_seen_at=timezone.now()))


def batch_release(batch_id: str, run_id: str) -> None:
    Batch.objects.filter(pk=batch_id, runner=run_id).update(runner="", runner_seen_at=None)


# --- validation -------------------------------------------------------------------------------------------------


def batch_validate(batch: Batch) -> None:
    """Turn the input file into BatchLine rows (a bad line is a failed row, for the error file) and start the
    batch; an input that is not JSONL at all fails the batch with OpenAI's `errors` list. Idempotent."""
    if batch.status != Batch.Status.VALIDATING:
        return
    content = bytes(batch.input_file.content) if batch.input_file else b""
    try:
        lines = [line for line in content.decode().splitlines() if line.strip()]
    except UnicodeDecodeError:
        lines = None
    parsed = [_parse_line(i, line, batch.endpoint) for i, line in enumerate(lines or [])]
    if not lines or all(row.error and row.error["code"] == "invalid_json_line" for row in parsed):
        _fail(batch, "The input file is not UTF-8 text." if lines is None and content else
              "The input file is not JSONL: each line must be one JSON object.")
        return
    _mark_duplicates(parsed)
    for row in parsed:
        row.batch = batch
    with transaction.atomic():
        BatchLine.objects.bulk_create(parsed, ignore_conflicts=True)
        failed = sum(1 for row in parsed if row.status == BatchLine.Status.FAILED)
        Batch.objects.filter(pk=batch.pk, status=Batch.Status.VALIDATING).update(
            status=Batch.Status.IN_PROGRESS, in_progress_at=timezone.now(), total=len(parsed), failed=failed)


def _parse_line(index: int, text: str, endpoint: str) -> BatchLine:
    line = BatchLine(index=index)
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        return _bad(line, "invalid_json_line", f"Line {index + 1} is not a JSON object.")
    line.custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else ""
    line.method, line.url, line.body = str(obj.get("method") or ""), str(obj.get("url") or ""), obj.get("body")
    if not line.custom_id:
        return _bad(line, "missing_custom_id", f"Line {index + 1} has no custom_id (a non-empty string).")
    if line.method != "POST":
        return _bad(line, "invalid_method", f"Line {index + 1}: method must be \"POST\".")
    if line.url != endpoint:
        return _bad(line, "invalid_url", f"Line {index + 1}: url must be the batch's endpoint {endpoint}.")
    if not isinstance(line.body, dict) or not isinstance(line.body.get("model"), str):
        return _bad(line, "invalid_body", f"Line {index + 1}: body must be an object naming a model.")
    return line


def _bad(line: BatchLine, code: str, message: str) -> BatchLine:
    line.status, line.error, line.finished_at = BatchLine.Status.FAILED, {"code": code, "message": message}, \
        timezone.now()
    return line


def _mark_duplicates(lines: list[BatchLine]) -> None:
    seen: set[str] = set()
    for line in lines:
        if line.status == BatchLine.Status.PENDING and line.custom_id in seen:
            _bad(line, "duplicate_custom_id", f"Line {line.index + 1}: custom_id {line.custom_id!r} is used by an "
                 "earlier line; each line needs its own.")
        seen.add(line.custom_id)


def _fail(batch: Batch, message: str) -> None:
    errors = {"object": "list", "data": [{"code": "invalid_file_format", "message": message, "param": None,
                                         "line": None}]}
    Batch.objects.filter(pk=batch.pk, status=Batch.Status.VALIDATING).update(
        status=Batch.Status.FAILED, failed_at=timezone.now(), errors=errors, runner="")


# --- running lines ----------------------------------------------------------------------------------------------


class BatchRunner:
    """One run of a batch on this worker: claims lines and sends them, at most FLEET_BATCH_CONCURRENCY at once."""

    def __init__(self, batch: Batch, run_id: str):
        self.batch, self.run_id = batch, run_id
        self.credential = batch_credential(str(batch.pk))
        self.stop = threading.Event()
        self.client = httpx.Client(base_url=settings.FLEET_HEAD_URL, timeout=settings.FLEET_BATCH_LINE_TIMEOUT_S)
        self.trace = tracing.current()  # the batch run task's span: each line's trace links to it

    def run(self, until: float) -> None:
        """Send lines until none is left, the batch is cancelled or expires, or `until` (a slice's end) passes."""
        limit = settings.FLEET_BATCH_CONCURRENCY
        running: set[Future] = set()
        beat = time.monotonic()
        with ThreadPoolExecutor(max_workers=limit, thread_name_prefix="batch-line") as pool:
            while not self.stop.is_set():
                while len(running) < limit and self._may_start(until):
                    line = self._claim()
                    if line is None:
                        break
                    running.add(pool.submit(self._answer, line))
                if not running:
                    if not self._may_start(until) or not self._pending():
                        break
                    time.sleep(0.5)  # lines put back (transient answers) wait a moment before they go again
                    continue
                done, running = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()
                if time.monotonic() - beat > 2:
                    beat = time.monotonic()
                    batch_heartbeat(str(self.batch.pk), self.run_id)
            wait(running)
        self.client.close()

    def _may_start(self, until: float) -> bool:
        status, expires_at = Batch.objects.filter(pk=self.batch.pk).values_list("status", "expires_at").get()
        return status == Batch.Status.IN_PROGRESS and timezone.now() < expires_at and time.time() < until

    def _pending(self) -> bool:
        return BatchLine.objects.filter(batch=self.batch, status=BatchLine.Status.PENDING).exists()

    def _claim(self) -> BatchLine | None:
        for pk in BatchLine.objects.filter(batch=self.batch, status=BatchLine.Status.PENDING).order_by(
                "attempts", "index").values_list("pk", flat=True)[:4]:
            if BatchLine.objects.filter(pk=pk, status=BatchLine.Status.PENDING).update(
                    status=BatchLine.Status.RUNNING, claim=self.run_id, attempts=F("attempts") + 1):
                return BatchLine.objects.get(pk=pk)
        return None

    def _answer(self, line: BatchLine) -> None:
        try:
            status, payload, request_id = self._send(line)
            if status in TRANSIENT_STATUS:
                BatchLine.objects.filter(pk=line.pk, claim=self.run_id, status=BatchLine.Status.RUNNING).update(
                    status=BatchLine.Status.PENDING, claim="")
                return
            line_finish(line, self.run_id, status, payload, request_id)
        finally:
            connection.close()  # this thread's own connection

    def _send(self, line: BatchLine) -> tuple[int, Any, str]:
        body = {**line.body, "stream": False} if line.url != "/v1/embeddings" else line.body
        try:
            with tracing.batch_line(self.trace, line.index) as context:
                response = self.client.post(line.url, json=body, headers={BATCH_HEADER: self.credential, **context})
        except httpx.HTTPError as exc:
            log.warning("batch %s line %d: the head did not answer (%s); it goes again", self.batch.pk, line.index,
                        exc)
            return 503, None, ""
        try:
            payload = response.json()
        except ValueError:
            payload = {"error": {"message": response.text[:500], "type": "server_error", "code": None}}
        return response.status_code, payload, response.headers.get("X-Fleet-Generation", "")


def line_finish(line: BatchLine, run_id: str, status: int, payload: Any, request_id: str) -> bool:
    """Answer a line once: only the run holding its claim records it, with the batch's counts in one transaction."""
    ok = 200 <= status < 300
    with transaction.atomic():
        moved = BatchLine.objects.filter(pk=line.pk, status=BatchLine.Status.RUNNING, claim=run_id).update(
            status=BatchLine.Status.DONE if ok else BatchLine.Status.FAILED, finished_at=timezone.now(),
            response={"status_code": status, "request_id": request_id, "body": payload}, request_id=request_id)
        if moved:
            Batch.objects.filter(pk=line.batch_id).update(**({"completed": F("completed") + 1} if ok else
                                                             {"failed": F("failed") + 1}))
    return bool(moved)


# --- the end ----------------------------------------------------------------------------------------------------


def batch_finish(batch_id: str) -> None:
    """Write the output and error files and end the batch: completed, cancelled or expired. Idempotent."""
    batch = Batch.objects.get(pk=batch_id)
    if batch.status in ENDED:
        return
    now = timezone.now()
    if batch.status == Batch.Status.CANCELLING:
        final, stamp = Batch.Status.CANCELLED, "cancelled_at"
    elif batch.status == Batch.Status.IN_PROGRESS and now >= batch.expires_at and _left(batch):
        final, stamp = Batch.Status.EXPIRED, "expired_at"
    elif batch.status in (Batch.Status.IN_PROGRESS, Batch.Status.FINALIZING) and not _left(batch):
        final, stamp = Batch.Status.COMPLETED, "completed_at"
    else:
        return  # lines are left and time too: another slice runs them
    Batch.objects.filter(pk=batch_id, status=batch.status).update(status=Batch.Status.FINALIZING,
                                                                   finalizing_at=batch.finalizing_at or now)
    with transaction.atomic():
        output, errors = _files(batch, expired=final == Batch.Status.EXPIRED)
        Batch.objects.filter(pk=batch_id, status=Batch.Status.FINALIZING).update(
            status=final, output_file=output, error_file=errors, runner="", **{stamp: timezone.now()})


def _left(batch: Batch) -> bool:
    return BatchLine.objects.filter(batch=batch, status__in=(BatchLine.Status.PENDING,
                                                             BatchLine.Status.RUNNING)).exists()


def _files(batch: Batch, *, expired: bool) -> tuple[BatchFile | None, BatchFile | None]:
    out, err = [], []
    for line in BatchLine.objects.filter(batch=batch).order_by("index").iterator():
        entry = _entry(line, expired)
        if entry is not None:
            (out if line.status == BatchLine.Status.DONE else err).append(json.dumps(entry))
    return _file(batch, "output", out), _file(batch, "errors", err)


def _entry(line: BatchLine, expired: bool) -> dict[str, Any] | None:
    rid = f"batch_req_{uuid.uuid5(uuid.NAMESPACE_OID, f'{line.batch_id}:{line.index}').hex}"
    if line.status in (BatchLine.Status.DONE, BatchLine.Status.FAILED):
        return {"id": rid, "custom_id": line.custom_id or None, "response": line.response, "error": line.error}
    if expired:
        return {"id": rid, "custom_id": line.custom_id, "response": None, "error": {
            "code": "batch_expired", "message": "This request could not be executed before the completion window "
            "expired."}}
    return None  # cancelled before it ran: in neither file


def _file(batch: Batch, kind: str, entries: list[str]) -> BatchFile | None:
    if not entries:
        return None
    content = ("\n".join(entries) + "\n").encode()
    return BatchFile.objects.create(owner=batch.owner, filename=f"batch_{batch.pk.hex}_{kind}.jsonl",
                                    purpose=BatchFile.Purpose.BATCH_OUTPUT, bytes=len(content), content=content)


def batch_run(batch_id: str, run_id: str) -> bool:
    """One slice of a batch's run; True when another slice is needed (the batch is not over)."""
    if not batch_take(batch_id, run_id):
        return False
    try:
        batch = Batch.objects.select_related("input_file").get(pk=batch_id)
        batch_validate(batch)
        batch.refresh_from_db()
        if batch.status == Batch.Status.IN_PROGRESS:
            BatchRunner(batch, run_id).run(until=time.time() + settings.FLEET_BATCH_SLICE_S)
        batch_finish(batch_id)
        return Batch.objects.filter(pk=batch_id).exclude(status__in=ENDED).exists()
    finally:
        batch_release(batch_id, run_id)
        close_old_connections()


def batches_stale() -> list[str]:
    """Batches not over whose runner is gone (never started, or its worker killed): for the resume task."""
    stale = timezone.now() - timedelta(seconds=settings.FLEET_BATCH_LEASE_S)
    return [str(pk) for pk in Batch.objects.exclude(status__in=ENDED).filter(
        Q(runner="") | Q(runner_seen_at__lt=stale)).values_list("pk", flat=True)]
