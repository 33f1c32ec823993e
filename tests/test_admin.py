"""Every admin changelist and the fleet page render for staff, with their query counts pinned.

The counts are baselines (as NetBox pins them): a change that adds a query per row fails here, because the
fixtures below create several rows of each kind.
"""

import pytest
from django.urls import reverse

from api.services import api_key_create
from nodes.models import Node
from nodes.services import fleet_token_create
from tests.factories import (
    GenerationFactory,
    GrammarHandleFactory,
    LogitBiasHandleFactory,
    MessageFactory,
    NodeFactory,
    SessionFactory,
    UserFactory,
)

pytestmark = pytest.mark.django_db

CHANGELISTS = {
    "admin:nodes_node_changelist": 6,
    "admin:nodes_fleettoken_changelist": 5,
    "admin:api_apikey_changelist": 5,
    "admin:inference_sessions_inferencesession_changelist": 6,
    "admin:inference_sessions_generation_changelist": 11,
    "admin:inference_sessions_grammarhandle_changelist": 5,
    "admin:inference_sessions_logitbiashandle_changelist": 5,
}


@pytest.fixture
def staff_client(client):
    user = UserFactory(username="operator")
    client.force_login(user)
    for _ in range(3):
        node = NodeFactory()
        fleet_token_create(name=f"t-{node.identity}")
        api_key_create(owner=user, name=f"k-{node.identity}")
        session = SessionFactory(owner=user)
        MessageFactory.create_batch(2, session=session)
        GenerationFactory(node=node, session=session)
        GrammarHandleFactory()
        LogitBiasHandleFactory()
    return client


@pytest.mark.parametrize(("name", "queries"), CHANGELISTS.items())
def test_changelist_renders_with_pinned_queries(staff_client, django_assert_num_queries, name, queries):
    with django_assert_num_queries(queries):
        response = staff_client.get(reverse(name))
    assert response.status_code == 200


def test_fleet_page_renders_nodes_and_models(staff_client, django_assert_num_queries):
    NodeFactory(identity="gpu-down", state=Node.State.OFFLINE)
    with django_assert_num_queries(5):
        response = staff_client.get(reverse("fleet-overview"))
    body = response.content.decode()
    assert response.status_code == 200
    assert "gpu-down" in body and "offline" in body and "smollm2" in body


def test_admin_index_links_to_fleet_page(staff_client):
    body = staff_client.get(reverse("admin:index")).content.decode()
    assert reverse("fleet-overview") in body


def test_node_actions_drain_cordon_uncordon(staff_client):
    node = NodeFactory(identity="gpu-x")
    url = reverse("admin:nodes_node_changelist")
    for action, state in [("drain", "draining"), ("cordon", "cordoned"), ("uncordon", "online")]:
        staff_client.post(url, {"action": action, "_selected_action": [node.pk]})
        node.refresh_from_db()
        assert node.state == state


def test_revoke_token_action(staff_client):
    from nodes.models import FleetToken

    token = FleetToken.objects.first()
    url = reverse("admin:nodes_fleettoken_changelist")
    staff_client.post(url, {"action": "revoke", "_selected_action": [token.pk]})
    token.refresh_from_db()
    assert token.revoked_at is not None


def test_non_staff_is_sent_to_login(client):
    response = client.get(reverse("fleet-overview"))
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
