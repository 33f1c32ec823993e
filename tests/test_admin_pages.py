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
