"""Fixtures of the API tests; a test module loads them with `pytest_plugins = ["tests.api_fixtures"]`."""

import pytest

from tests.api_support import FakeLink, add_fake_node


@pytest.fixture
def api_user():
    from tests.factories import UserFactory

    return UserFactory(is_staff=False, is_superuser=False)


@pytest.fixture
def api_key_pair(api_user):
    """(row, key) for `api_user`."""
    from api.services import api_key_create

    return api_key_create(owner=api_user, name="tests")


@pytest.fixture
def bearer(api_key_pair) -> str:
    """An API key of `api_user`, as a client sends it after `Bearer `."""
    return api_key_pair[1]


@pytest.fixture
def fake_node() -> FakeLink:
    return add_fake_node()


@pytest.fixture
def staff():
    """The REST framework's test client signed in as a staff user (`operator`)."""
    from rest_framework.test import APIClient

    from tests.factories import UserFactory

    api = APIClient()
    api.force_authenticate(UserFactory(username="operator"))
    return api


@pytest.fixture
def exported(monkeypatch):
    """Tracing on for this test, into memory; off again after it."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from nodes.link import trace

    for name in ("ENABLED", "_provider", "_tracer"):
        monkeypatch.setattr(trace, name, getattr(trace, name))
    monkeypatch.setattr(trace, "spans", {})
    exporter = InMemorySpanExporter()
    trace.setup("test", exporter=exporter)
    return exporter
