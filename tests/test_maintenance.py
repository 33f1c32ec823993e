"""Maintenance that Celery beat runs: sessions and handles expire after their time-to-live, generation records,
batch files and media blobs are purged after their retention. Each does what is due, keeps everything else, and
finds nothing the second time (tests/test_celery_worker.py runs the tasks in a real worker)."""

from __future__ import annotations

import io
import os
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from api.batches import file_purge
from api.constraints import apply_constraints
from api.models import Batch, BatchFile
from fleet.display import when_text
from nodes.blobs import blob_path
from nodes.link.spec import GenerateSpec
from nodes.models import Model
from nodes.registry import media_put
from nodes.tasks import media_purge_task
from sessions.admin import GrammarHandleAdmin, InferenceSessionAdmin
from sessions.models import Generation, GrammarHandle, InferenceSession, LogitBiasHandle, Message
from sessions.services import generation_purge, handle_expire, session_expire
from tests.factories import (
    GenerationFactory,
    GrammarHandleFactory,
    LogitBiasHandleFactory,
    MessageFactory,
    SessionFactory,
    UserFactory,
)

pytest_plugins = ["tests.api_fixtures"]

pytestmark = pytest.mark.django_db

DAY = timedelta(days=1)


def aged(model, row, days: float, field: str = "updated_at"):
    """Set a row's time field `days` in the past (auto_now fields cannot be set through save)."""
    model.objects.filter(pk=row.pk).update(**{field: timezone.now() - days * DAY})
    return row


def test_sessions_untouched_past_their_ttl_go_with_their_messages_and_their_records_stay():
    old, fresh = SessionFactory(), SessionFactory()
    MessageFactory(session=old)
    MessageFactory(session=fresh)
    record = GenerationFactory(session=old)
    aged(InferenceSession, old, 31)
    aged(InferenceSession, fresh, 29)
    assert session_expire(ttl_days=30) == 1
    assert list(InferenceSession.objects.all()) == [fresh]
    assert Message.objects.filter(session_id=old.pk).count() == 0 and Message.objects.count() == 1
    record.refresh_from_db()
    assert record.session_id is None
    assert session_expire(ttl_days=30) == 0


def test_a_ttl_of_zero_keeps_every_session():
    aged(InferenceSession, SessionFactory(), 3650)
    assert session_expire(ttl_days=0) == 0
    assert InferenceSession.objects.count() == 1


def test_handles_unused_past_their_ttl_are_freed_and_the_rest_stay_live():
    stale_grammar, live_grammar = GrammarHandleFactory(), GrammarHandleFactory()
    stale_bias = LogitBiasHandleFactory()
    aged(GrammarHandle, stale_grammar, 8)
    aged(LogitBiasHandle, stale_bias, 8)
    aged(GrammarHandle, live_grammar, 6)
    assert handle_expire(ttl_days=7) == 2
    freed = {h.pk for h in GrammarHandle.objects.filter(freed_at__isnull=False)}
    assert freed == {stale_grammar.pk}
    assert LogitBiasHandle.objects.get(pk=stale_bias.pk).freed_at is not None
    assert handle_expire(ttl_days=7) == 0


def test_naming_a_handle_in_a_generation_starts_its_ttl_over(api_user):
    grammar = GrammarHandleFactory(owner=api_user)
    bias = LogitBiasHandleFactory(owner=api_user)
    aged(GrammarHandle, grammar, 8)
    aged(LogitBiasHandle, bias, 8)
    spec = GenerateSpec(gen_id="g", model="smollm2", prompt="hi")
    apply_constraints(spec, {"grammar": str(grammar.pk), "logit_bias_handle": str(bias.pk)}, None, api_user)
    assert handle_expire(ttl_days=7) == 0
    assert GrammarHandle.objects.get(pk=grammar.pk).freed_at is None


def test_generation_records_past_their_retention_are_purged_in_chunks():
    old = [GenerationFactory(created_at=timezone.now() - 91 * DAY) for _ in range(5)]
    kept = GenerationFactory(created_at=timezone.now() - 89 * DAY)
    assert generation_purge(retention_days=90, chunk=2) == len(old)
    assert list(Generation.objects.all()) == [kept]
    assert generation_purge(retention_days=90, chunk=2) == 0
    assert generation_purge(retention_days=0) == 0


def test_old_batch_files_are_purged_except_those_a_running_batch_uses():
    owner = UserFactory()

    def stored(name: str) -> BatchFile:
        row = BatchFile.objects.create(owner=owner, filename=name, purpose="batch", bytes=2, content=b"{}")
        return aged(BatchFile, row, 31, "created_at")

    gone, read_by_running, read_by_finished = stored("gone"), stored("running"), stored("finished")
    fresh = BatchFile.objects.create(owner=owner, filename="fresh", purpose="batch", bytes=2, content=b"{}")
    for status, row in ((Batch.Status.IN_PROGRESS, read_by_running), (Batch.Status.COMPLETED, read_by_finished)):
        Batch.objects.create(owner=owner, endpoint="/v1/chat/completions", completion_window="24h",
                             input_file=row, input_file_ref=f"file-{row.pk.hex}", status=status,
                             expires_at=timezone.now() + DAY)
    assert file_purge(retention_days=30) == 2
    assert set(BatchFile.objects.values_list("filename", flat=True)) == {"running", "fresh"}
    assert not BatchFile.objects.filter(pk__in=[gone.pk, read_by_finished.pk]).exists()
    assert file_purge(retention_days=30) == 0
    assert fresh.pk in set(BatchFile.objects.values_list("pk", flat=True))


def media_blob(content: bytes, days: float) -> str:
    """A media blob as a transcription keeps it, last sent `days` ago; its sha256."""
    sha256, _ = media_put(io.BytesIO(content))
    then = time.time() - days * DAY.total_seconds()
    os.utime(blob_path(sha256), (then, then))
    return sha256


def test_media_blobs_past_their_retention_go_and_model_files_and_fresh_ones_stay(settings, tmp_path):
    settings.FLEET_HOME, settings.FLEET_MEDIA_RETENTION_DAYS = tmp_path, 7
    old, fresh, model_file = media_blob(b"RIFF old", 8), media_blob(b"RIFF fresh", 6), media_blob(b"GGUF model", 8)
    Model.objects.create(name="m", sha256=model_file, size=10, architecture="llama", quantization="Q8_0",
                         context_length=2048, kv_bytes_per_token=1)
    assert media_purge_task() == 1
    assert not blob_path(old).exists() and blob_path(fresh).exists() and blob_path(model_file).exists()
    assert media_purge_task() == 0


def test_a_media_blob_sent_again_starts_its_time_over_and_zero_keeps_every_blob(settings, tmp_path):
    settings.FLEET_HOME, settings.FLEET_MEDIA_RETENTION_DAYS = tmp_path, 0
    sent_again = media_blob(b"RIFF again", 30)
    assert media_purge_task() == 0
    settings.FLEET_MEDIA_RETENTION_DAYS = 7
    media_put(io.BytesIO(b"RIFF again"))  # a new transcription of the same file, as one running would have
    assert media_purge_task() == 0 and blob_path(sent_again).exists()


def test_the_admin_shows_when_a_session_and_a_handle_expire(settings, admin_client):
    settings.FLEET_SESSION_TTL_DAYS, settings.FLEET_HANDLE_TTL_DAYS = 30, 7
    session, handle = SessionFactory(), GrammarHandleFactory()
    from django.contrib import admin

    session_admin = InferenceSessionAdmin(InferenceSession, admin.site)
    assert session_admin.expires(session) == when_text(session.updated_at + 30 * DAY)
    grammar_admin = GrammarHandleAdmin(GrammarHandle, admin.site)
    assert grammar_admin.expires(handle) == when_text(handle.updated_at + 7 * DAY)
    handle.freed_at = timezone.now()
    assert grammar_admin.expires(handle) == "freed"
    settings.FLEET_SESSION_TTL_DAYS = 0
    assert InferenceSessionAdmin(InferenceSession, admin.site).expires(session) == "never"
    page = admin_client.get("/admin/inference_sessions/inferencesession/").content.decode()
    assert "expires (untouched until)" in page.lower() and "never" in page
