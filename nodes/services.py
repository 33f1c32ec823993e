"""Writes for nodes and fleet tokens. Interfaces (admin, commands, the link consumer) call these."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from fleet import secretbox
from nodes.link.handshake import format_token, make_secret
from nodes.models import FleetToken, Node

log = logging.getLogger("nodes")


# --- fleet tokens -------------------------------------------------------------------------------------------


def fleet_token_create(*, name: str) -> tuple[FleetToken, str]:
    """Make a token; returns it with the full `<public id>.<secret>` string, which is shown once and never stored."""
    name = name.strip()
    if not name:
        raise ValueError("a fleet token needs a name")
    secret = make_secret()
    token = FleetToken.objects.create(
        name=name, public_id=secrets.token_hex(6), secret_encrypted=secretbox.seal(secret)
    )
    return token, format_token(token.public_id, secret)


def fleet_token_revoke(*, token: FleetToken) -> bool:
    """Revoke a token; nodes that hold it are refused at their next handshake. False if it already was."""
    updated = FleetToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    return bool(updated)


def fleet_token_secret(*, public_id: str) -> bytes | None:
    """The secret (the link's PSK) of an active token, or None when unknown or revoked."""
    token = FleetToken.objects.filter(public_id=public_id, revoked_at__isnull=True).first()
    if token is None:
        return None
    return secretbox.unseal(token.secret_encrypted)


def fleet_token_verify(*, token_string: str) -> bool:
    """True when `<public id>.<secret>` names an active token with that very secret."""
    from nodes.link.handshake import BadToken, parse_token

    try:
        public_id, secret = parse_token(token_string)
    except BadToken:
        return False
    stored = fleet_token_secret(public_id=public_id)
    return stored is not None and secrets.compare_digest(stored, secret)


# --- nodes --------------------------------------------------------------------------------------------------


@dataclass
class Registration:
    node: Node
    rejoin: bool
    model_names: list[str]
    warnings: list[str]


def _served_model_names() -> set[str]:
    names: set[str] = set(getattr(settings, "FLEET_MODELS", []) or [])
    for served in Node.objects.exclude(state=Node.State.OFFLINE).values_list("models_served", flat=True):
        names.update(served or [])
    return names


def node_fleet_model_name(own: str, *, served: set[str]) -> tuple[str, str | None]:
    """The name a node's model takes on the fleet: its own if the head serves it, the head's only model if the
    head serves exactly one, else its own with a warning."""
    if not served or own in served:
        return own, None
    if len(served) == 1:
        (only,) = served
        return only, f"the node calls its model {own!r}; the head serves only {only!r}, so it serves as {only!r}"
    return own, f"the head serves no model named {own!r} (it serves {', '.join(sorted(served))}); serving it as is"


@transaction.atomic
def node_register(
    *, identity: str, address: str, token: FleetToken | None, models: list[str], lanes: int, context_window: int,
    capabilities: dict, engine: str, version: str, labels: dict, replicas: list[dict],
) -> Registration:
    """Create or update the Node for a (re)joining host; a rejoin is recognised by its identity."""
    served = _served_model_names()
    names, warnings = [], []
    for own in models:
        name, warning = node_fleet_model_name(own, served=served)
        names.append(name)
        if warning:
            warnings.append(warning)
    node = Node.objects.select_for_update().filter(identity=identity).first()
    rejoin = node is not None
    node = node or Node(identity=identity)
    now = timezone.now()
    node.models_served, node.lanes, node.context_window = names, lanes, context_window
    node.capabilities, node.engine, node.version = capabilities, engine, version
    node.labels, node.replicas, node.address, node.token = labels, replicas, address, token
    node.state = {Node.Hold.DRAIN: Node.State.DRAINING, Node.Hold.CORDON: Node.State.CORDONED}.get(
        node.hold, Node.State.ONLINE
    )
    node.joined_at = node.last_seen_at = now
    node.save()
    if token is not None:
        FleetToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return Registration(node=node, rejoin=rejoin, model_names=names, warnings=warnings)


def node_mark_offline(*, node_id) -> bool:
    """The link is gone: a state transition, written once. False when it already was offline."""
    return bool(
        Node.objects.filter(pk=node_id).exclude(state=Node.State.OFFLINE).update(
            state=Node.State.OFFLINE, last_seen_at=timezone.now()
        )
    )


def node_touch(*, node_id) -> None:
    """Coarse liveness for the maintenance sweep (a few writes a minute per node, not per heartbeat)."""
    Node.objects.filter(pk=node_id).update(last_seen_at=timezone.now())


def node_set_hold(*, node: Node, hold: str) -> Node:
    """Drain, cordon or release a node. A held node takes no new generation; running ones finish."""
    node.hold = hold
    if node.state != Node.State.OFFLINE:
        node.state = {Node.Hold.DRAIN: Node.State.DRAINING, Node.Hold.CORDON: Node.State.CORDONED}.get(
            hold, Node.State.ONLINE
        )
    node.save(update_fields=["hold", "state", "updated_at"])
    transaction.on_commit(lambda: _tell_link(str(node.pk), schedulable=node.state == Node.State.ONLINE))
    return node


def _tell_link(node_id: str, *, schedulable: bool) -> None:
    """Tell the node's link consumer, in whichever head process holds it, whether it may take new work."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from nodes.consumers import node_group

    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(node_group(node_id), {"type": "node.hold", "schedulable": schedulable})


def node_sweep_lost(*, now=None) -> int:
    """Mark offline every node whose head stopped hearing from it. Idempotent: a conditional UPDATE."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=max(settings.FLEET_NODE_TIMEOUT_S * 3, 60))
    return (
        Node.objects.exclude(state=Node.State.OFFLINE)
        .filter(last_seen_at__lt=cutoff)
        .update(state=Node.State.OFFLINE, updated_at=now)
    )
