"""Fleet tokens, API keys and node state transitions, through their services."""

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from api.services import api_key_authenticate, api_key_create, api_key_revoke
from nodes.link.handshake import parse_token
from nodes.models import FleetToken, Node
from nodes.services import (
    JoinRefused,
    fleet_token_create,
    fleet_token_for_join,
    fleet_token_revoke,
    fleet_token_verify,
    node_fleet_model_name,
    node_mark_offline,
    node_register,
    node_set_hold,
    node_sweep_lost,
)
from tests.factories import NodeFactory, UserFactory

pytestmark = pytest.mark.django_db


def test_fleet_token_secret_is_never_stored_in_clear_and_verifies():
    token, full = fleet_token_create(name="gpu hosts")
    public_id, secret = parse_token(full)
    assert public_id == token.public_id
    row = FleetToken.objects.get(pk=token.pk)
    encoded = full.split(".", 1)[1]
    assert encoded not in row.secret_encrypted and secret.hex() not in row.secret_encrypted
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM nodes_fleettoken")
        dump = repr(cursor.fetchall())
    assert encoded not in dump and secret.hex() not in dump
    assert fleet_token_for_join(public_id=public_id) == (token, secret)
    assert fleet_token_verify(token_string=full)
    assert not fleet_token_verify(token_string=f"{public_id}.{'A' * 43}")


def test_revoked_fleet_token_is_refused():
    token, full = fleet_token_create(name="n")
    assert fleet_token_revoke(token=token) is True
    assert fleet_token_revoke(token=token) is False
    with pytest.raises(JoinRefused, match="was revoked"):
        fleet_token_for_join(public_id=token.public_id)
    assert not fleet_token_verify(token_string=full)


def test_api_key_hash_verifies_and_revoked_key_fails():
    user = UserFactory()
    row, key = api_key_create(owner=user, name="app")
    assert key.startswith(row.prefix) and key not in row.key_hash
    assert api_key_authenticate(key=key) == row
    assert api_key_authenticate(key=key + "x") is None
    assert api_key_authenticate(key="not-a-key") is None
    api_key_revoke(key=row)
    assert api_key_authenticate(key=key) is None


def test_api_key_last_used_is_written_at_most_once_a_minute():
    row, key = api_key_create(owner=UserFactory(), name="app")
    api_key_authenticate(key=key)
    first = type(row).objects.get(pk=row.pk).last_used_at
    api_key_authenticate(key=key)
    assert type(row).objects.get(pk=row.pk).last_used_at == first


def _register(identity="gpu-3", models=("smollm2",), key="ab" * 32):
    return node_register(identity=identity, public_key=key, address="10.0.0.7", token=None, models=list(models),
                         lanes=8,
                         context_window=8192, capabilities={"chat": True}, engine="llama.cpp", version="1",
                         labels={}, replicas=[])


def test_register_then_rejoin_is_recognised_by_identity():
    first = _register()
    assert not first.rejoin and first.node.state == Node.State.ONLINE
    node_mark_offline(node_id=first.node.pk)
    again = _register()
    assert again.rejoin and again.node.pk == first.node.pk
    assert Node.objects.count() == 1


def test_a_held_node_rejoins_held():
    reg = _register()
    node_set_hold(node=reg.node, hold=Node.Hold.CORDON)
    node_mark_offline(node_id=reg.node.pk)
    assert _register().node.state == Node.State.CORDONED


def test_model_name_rules():
    file, other = "f" * 64, "e" * 64
    assert node_fleet_model_name("smollm2", file=file, served={"smollm2": {other}, "llama": set()}) == ("smollm2",
                                                                                                          None)
    name, warning = node_fleet_model_name("SmolLM2-135M", file=file, served={"smollm2": {file}})
    assert name == "smollm2" and "the same file" in warning
    name, warning = node_fleet_model_name("qwen", file=file, served={"smollm2": {other}})  # one name, another file
    assert name == "qwen" and "serves no model named" in warning
    assert node_fleet_model_name("qwen", served={"smollm2": set()})[0] == "qwen"  # a node that sends no fingerprint
    assert node_fleet_model_name("qwen", file=file, served={"a": {file}, "b": {file}})[0] == "qwen"  # which? neither
    assert node_fleet_model_name("qwen", served={}) == ("qwen", None)


def test_names_do_not_depend_on_which_node_joins_first():
    """Every node rejoined after a token change, and the first back (serving `slowm`) made the next serve its
    `smollm2` as `slowm`: every smollm2 request was a 404. Only the same file takes another name."""
    def join(identity, model, file):
        return node_register(identity=identity, public_key=identity.encode().hex().ljust(64, "0"), address="10.0.0.7",
                             token=None, models=[model], lanes=2, context_window=512, capabilities={"chat": True},
                             engine="llama.cpp", version="1", labels={}, replicas=[], files={model: file})

    assert join("slow-host", "slowm", "a" * 64).node.models_served == ["slowm"]
    assert join("smol-host", "smollm2", "b" * 64).node.models_served == ["smollm2"]
    copy = join("copy-host", "SmolLM2-135M-Instruct", "b" * 64)  # the same file under its file's name
    assert copy.node.models_served == ["smollm2"] and copy.node.model_files == {"smollm2": "b" * 64}


def test_a_speech_model_keeps_its_name_and_lends_it_to_no_text_model():
    """`node_join --transcribe`: the same-file rename above never makes a text model of a speech model or back."""
    speech = {"chat": True, "transcribe": True, "speech_models": ["whisper-tiny.en"]}

    def join(identity, models, capabilities):
        return node_register(identity=identity, public_key=identity.encode().hex().ljust(64, "0"), address="10.0.0.7",
                             token=None, models=models, lanes=2, context_window=512, capabilities=capabilities,
                             engine="llama.cpp", version="1", labels={}, replicas=[], files={models[0]: "c" * 64})

    assert join("ears-only", ["whisper-tiny.en"], speech).node.models_served == ["whisper-tiny.en"]
    both = join("ears", ["smollm2", "whisper-tiny.en"], speech)
    assert both.node.models_served == ["smollm2", "whisper-tiny.en"] and not both.warnings
    assert join("gpu-9", ["SmolLM2-135M"], {"chat": True}).node.models_served == ["smollm2"]  # the same file
    assert join("ears-2", ["whisper-tiny.en"], speech).node.models_served == ["whisper-tiny.en"]


def test_sweep_marks_silent_nodes_offline_idempotently():
    old = timezone.now() - timedelta(minutes=10)
    stale = NodeFactory(last_seen_at=old)
    fresh = NodeFactory()
    assert node_sweep_lost() == 1
    assert node_sweep_lost() == 0
    stale.refresh_from_db()
    fresh.refresh_from_db()
    assert stale.state == Node.State.OFFLINE and fresh.state == Node.State.ONLINE


def test_the_link_history_keeps_the_newest_events_per_node(monkeypatch):
    from nodes.models import LinkEvent
    from nodes.services import link_event_record

    monkeypatch.setattr("nodes.services.LINK_EVENTS_KEPT", 3)
    node = NodeFactory()
    for i in range(5):
        link_event_record(kind=LinkEvent.Kind.REFUSED, identity=f"peer-{i}", code=4001)
        link_event_record(kind=LinkEvent.Kind.JOINED, node_id=node.pk, identity=f"join-{i}")
    assert sorted(LinkEvent.objects.filter(node=None).values_list("identity", flat=True)) == ["peer-2", "peer-3",
                                                                                              "peer-4"]
    assert sorted(node.link_events.values_list("identity", flat=True)) == ["join-2", "join-3", "join-4"]


def test_look_alike_and_invisible_identities_are_refused_beside_a_nodes_own():
    """`MA`, `mA ` (a space), a zero-width character and a Cyrillic letter all registered beside `mA`, each shown as
    another host. They are refused with a close code of their own; `mA` itself rejoins, and a plain new name joins."""
    from nodes.link.codes import CloseCode
    from nodes.services import JoinRefused

    def join(identity, key):
        return node_register(identity=identity, public_key=key, address="10.0.0.7", token=None, models=["smollm2"],
                             lanes=2, context_window=512, capabilities={"chat": True}, engine="llama.cpp",
                             version="1", labels={}, replicas=[])

    join("mA", "ab" * 32)
    for alike in ("MA", "mA ", "m\u200bA", "m\u0410", "\uff4dA"):  # case, space, zero-width, Cyrillic A, full-width m
        with pytest.raises(JoinRefused) as refused:
            join(alike, "cd" * 32)
        assert refused.value.code == CloseCode.IDENTITY_REFUSED, alike
    assert "looks like node 'mA'" in str(pytest.raises(JoinRefused, join, "MA", "cd" * 32).value)
    assert join("mA", "ab" * 32).rejoin
    assert not join("gpu-2.lab", "cd" * 32).rejoin
    assert list(Node.objects.order_by("identity").values_list("identity", flat=True)) == ["gpu-2.lab", "mA"]
