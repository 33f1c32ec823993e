"""What an operator reads on the admin's pages: where `/` and "View site" lead, sizes and dates as people write
them, each help text once."""

import pytest
from django.urls import reverse

from tests.factories import UserFactory

pytestmark = [pytest.mark.in_process, pytest.mark.django_db]


@pytest.fixture
def staff_client(client):
    client.force_login(UserFactory(username="operator"))
    return client


def test_the_root_leads_to_the_admin(client):
    response = client.get("/", follow=True)
    assert response.redirect_chain[0][0] == reverse("admin:index")
    assert response.status_code == 200 and "Log in" in response.content.decode()


def test_view_site_leads_to_the_fleet_page(staff_client):
    body = staff_client.get(reverse("admin:index")).content.decode()
    assert f'<a href="{reverse("fleet-overview")}">View site</a>' in body
    assert staff_client.get(reverse("fleet-overview")).status_code == 200


def test_a_models_size_and_kv_cache_read_in_decimal_units(staff_client):
    from nodes.models import Model

    model = Model.objects.create(name="qwen", sha256="a" * 64, size=1_234_567_890, architecture="qwen2",
                                 context_length=8192, kv_bytes_per_token=98_304)
    listing = staff_client.get(reverse("admin:nodes_model_changelist")).content.decode()
    page = staff_client.get(reverse("admin:nodes_model_change", args=[model.pk])).content.decode()
    for body in (listing, page):
        assert "1.2 GB" in body and "98.3 kB" in body
        assert "1234567890" not in body and "98304" not in body


def test_the_on_demand_setting_is_explained_once_in_an_operators_words(staff_client):
    from nodes.models import Model

    model = Model.objects.create(name="qwen", sha256="b" * 64, size=1, architecture="qwen2", context_length=2048,
                                 kv_bytes_per_token=1)
    body = staff_client.get(reverse("admin:nodes_model_change", args=[model.pk])).content.decode()
    assert body.count("unloaded when idle") == 1 and "nodes.on_demand" not in body


def test_a_batch_files_size_and_purge_date_read_as_people_write_them(staff_client, settings):
    from datetime import UTC, datetime

    from api.models import BatchFile

    settings.FLEET_FILE_RETENTION_DAYS = 30
    row = BatchFile.objects.create(owner=UserFactory(username="client"), filename="in.jsonl", purpose="batch",
                                   bytes=123_456, content=b"{}")
    BatchFile.objects.filter(pk=row.pk).update(created_at=datetime(2031, 2, 3, 10, 20, tzinfo=UTC))
    listing = staff_client.get(reverse("admin:api_batchfile_changelist")).content.decode()
    page = staff_client.get(reverse("admin:api_batchfile_change", args=[row.pk])).content.decode()
    for body in (listing, page):
        assert "123.5 kB" in body and "123456" not in body
    assert "To be purged (later while a batch uses it):" in page and "March 5, 2031, 10:20 a.m." in page
    assert "2031-03-05" not in page


def test_a_generations_purge_date_is_ahead_and_reads_as_the_other_dates(staff_client, settings):
    from datetime import UTC, datetime

    from tests.factories import GenerationFactory

    settings.FLEET_GENERATION_RETENTION_DAYS = 90
    generation = GenerationFactory(created_at=datetime(2031, 1, 1, 8, 0, tzinfo=UTC))
    page = staff_client.get(reverse("admin:inference_sessions_generation_change", args=[generation.pk]))
    body = page.content.decode()
    assert "To be purged:" in body and "April 1, 2031, 8 a.m." in body and "2031-04-01" not in body


def test_a_sessions_expiry_reads_as_the_other_dates(staff_client, settings):
    from datetime import UTC, datetime

    from sessions.models import InferenceSession
    from tests.factories import SessionFactory

    settings.FLEET_SESSION_TTL_DAYS = 30
    session = SessionFactory()
    InferenceSession.objects.filter(pk=session.pk).update(updated_at=datetime(2031, 1, 1, 8, 0, tzinfo=UTC))
    body = staff_client.get(reverse("admin:inference_sessions_inferencesession_change", args=[session.pk]))
    assert "Jan. 31, 2031, 8 a.m." in body.content.decode() and "2031-01-31" not in body.content.decode()
