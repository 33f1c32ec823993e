"""Writes for nodes and fleet tokens. Interfaces (admin, commands, the link consumer) call these."""

from __future__ import annotations

import logging
import secrets
import unicodedata
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Subquery
from django.utils import timezone

from fleet import secretbox
from fleet.names import node_group, token_group
from nodes.agent.vocab import VocabError
from nodes.link.codes import CloseCode
from nodes.link.handshake import LOCAL_TOKEN_ID, fingerprint, format_token, make_secret, parse_token
from nodes.link.noise import generate_static, public_key
from nodes.models import FleetToken, HeadKey, LinkEvent, Model, Node, RevokedNodeKey
from nodes.tokenizers import model_tokenizer

log = logging.getLogger("nodes")


class JoinRefused(Exception):
    """A node may not join: the close code both ends know, and a one-line reason for the head's log."""

    def __init__(self, code: CloseCode, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


# --- the head's link key ------------------------------------------------------------------------------------

_head_key: bytes | None = None


def head_static_key() -> bytes:
    """The head's static private key: made once, shared by every head process through the database."""
    global _head_key
    if _head_key is None:
        row = HeadKey.objects.filter(name="head").first()
        if row is None:
            private = generate_static()
            try:
                with transaction.atomic():
                    row = HeadKey.objects.create(name="head", public_key=public_key(private).hex(),
                                                 private_key_encrypted=secretbox.seal(private))
            except IntegrityError:  # another head process made it first
                row = HeadKey.objects.get(name="head")
        try:
            _head_key = secretbox.unseal(row.private_key_encrypted)
        except secretbox.SecretUnreadable as exc:
            raise JoinRefused(CloseCode.HEAD_KEY_UNREADABLE, f"the head's own link key is unreadable: {exc}") from exc
    return _head_key


# --- fleet tokens -------------------------------------------------------------------------------------------


LOOPBACK = {"127.0.0.1", "localhost", "::1"}
ANY_ADDRESS = {"0.0.0.0", "::", ""}


def head_served_address_path():
    """Where `manage.py up` writes the address its daphne is bound to (host:port), once it is."""
    return settings.FLEET_HOME / "head-address"


def fleet_token_head_address(*, request_host: str | None = None) -> tuple[str, str | None]:
    """The head address a node on another machine dials, and a warning when none could reach it now.

    FLEET_PUBLIC_ADDRESS when set; else the host the admin was opened at (`request_host`); else the address
    `manage.py up` is bound to, with this machine's name for 0.0.0.0; else this machine's name and port 8000, with a
    warning that it is a guess."""
    import os
    import socket

    public = os.environ.get("FLEET_PUBLIC_ADDRESS", "").strip()
    if public:
        return public, None
    if request_host and request_host.rsplit(":", 1)[0].strip("[]") not in LOOPBACK:
        return request_host, None
    try:
        served = head_served_address_path().read_text().strip()
    except OSError:
        served = ""
    host, _, port = served.rpartition(":") if served else ("", "", "8000")
    warning = None
    if not served:  # a head run by daphne itself (production) writes no address: nothing here knows its port
        warning = ("FLEET_PUBLIC_ADDRESS is not set and `manage.py up` does not run here, so HEAD= is a guess (this "
                   "machine's name, port 8000): set FLEET_PUBLIC_ADDRESS to the address nodes reach (the load "
                   "balancer's), or give `fleet_token --head`")
    elif host in LOOPBACK:
        warning = (f"the head listens on {host} only: nodes on other machines cannot reach it; restart it with "
                   "`manage.py up --host 0.0.0.0` (`make run HOST=0.0.0.0`), or set FLEET_PUBLIC_ADDRESS")
    if host in LOOPBACK or host in ANY_ADDRESS:
        host = socket.gethostname()
    return f"{host}:{port}", warning


def fleet_token_join_lines(*, head: str, secret: str) -> list[str]:
    """What to run on a node host to join with this token: the token goes in the environment, not the command line
    (where `ps` shows it to every user of the host)."""
    return [
        "On a fresh node host (a clone of this repository: `make node` installs what a node needs, then joins):",
        f"  FLEET_TOKEN={secret} make node HEAD={head}",
        "Where Fleet is installed already:",
        f"  FLEET_TOKEN={secret} .venv/bin/python manage.py node_join {head} --model <path.gguf|smollm2>",
    ]


def fleet_token_create(*, name: str, expires_at=None) -> tuple[FleetToken, str]:
    """Make a token; returns it with the full `<public id>.<secret>` string, which is shown once and never stored."""
    name = name.strip()
    if not name:
        raise ValueError("a fleet token needs a name")
    secret = make_secret()
    token = FleetToken.objects.create(
        name=name, public_id=secrets.token_hex(6), secret_encrypted=secretbox.seal(secret), expires_at=expires_at,
    )
    return token, format_token(token.public_id, secret)


def fleet_token_revoke(*, token: FleetToken) -> bool:
    """Revoke a token: no new joins with it, and the links of the nodes that joined with it close, on whichever head
    process holds them. False if it already was revoked."""
    updated = FleetToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    if updated:
        transaction.on_commit(lambda: _close_links(token_group(token.public_id), CloseCode.TOKEN_REVOKED,
                                                   f"fleet token {token.public_id!r} was revoked"))
    return bool(updated)


def fleet_token_for_join(*, public_id: str) -> tuple[FleetToken | None, bytes]:
    """(token, its secret) for a joining node's hello; raises JoinRefused saying why not.

    The reserved id LOCAL_TOKEN_ID is `manage.py up`'s own node: (None, the run's local secret) when the head runs
    under `up`, else refused. Where it may come from (loopback, no proxy) is the caller's to check.
    """
    if public_id == LOCAL_TOKEN_ID:
        if not settings.FLEET_LOCAL_NODE_TOKEN:
            raise JoinRefused(CloseCode.TOKEN_REQUIRED, "the local token id is taken only under `manage.py up`")
        return None, parse_token(settings.FLEET_LOCAL_NODE_TOKEN)[1]
    token = FleetToken.objects.filter(public_id=public_id).first()
    if token is None:
        raise JoinRefused(CloseCode.TOKEN_REFUSED, f"fleet token {public_id!r} is unknown")
    if token.revoked_at is not None:
        raise JoinRefused(CloseCode.TOKEN_REVOKED, f"fleet token {public_id!r} was revoked")
    if token.expires_at is not None and token.expires_at <= timezone.now():
        raise JoinRefused(CloseCode.TOKEN_EXPIRED,
                          f"fleet token {public_id!r} expired at {token.expires_at:%Y-%m-%d %H:%M} UTC")
    try:
        return token, secretbox.unseal(token.secret_encrypted)
    except secretbox.SecretUnreadable as exc:
        raise JoinRefused(CloseCode.TOKEN_UNREADABLE, f"fleet token {public_id!r}: {exc}") from exc


def fleet_token_verify(*, token_string: str) -> bool:
    """True when `<public id>.<secret>` names a token a node may join with now, with that very secret."""
    from nodes.link.handshake import BadToken

    try:
        public_id, secret = parse_token(token_string)
        _, stored = fleet_token_for_join(public_id=public_id)
    except (BadToken, JoinRefused):
        return False
    return secrets.compare_digest(stored, secret)


def _close_links(group: str, code: CloseCode, reason: str) -> None:
    """Close every link in a channel-layer group, in whichever head process holds it."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(group, {"type": "link.close", "code": int(code), "reason": reason})


# --- node keys: identity binding, release, revocation --------------------------------------------------------


def link_refusal(*, token: FleetToken | None, public_key: str) -> JoinRefused | None:
    """Why a joined link must close now (its token revoked, its key revoked), or None. Two indexed reads."""
    if token is not None and FleetToken.objects.filter(pk=token.pk, revoked_at__isnull=False).exists():
        return JoinRefused(CloseCode.TOKEN_REVOKED, f"fleet token {token.public_id!r} was revoked")
    if RevokedNodeKey.objects.filter(public_key=public_key).exists():
        return JoinRefused(CloseCode.NODE_REVOKED, f"node key {fingerprint(bytes.fromhex(public_key))} was revoked")
    return None


def node_key_check(*, identity: str, public_key: str) -> None:
    """Raise JoinRefused when this key may not join under `identity`: the key was revoked, the identity is bound
    to another key, or it is no identity to take (identity_refusal). Reads only; `node_register` checks again under
    its row lock."""
    node = Node.objects.filter(identity=identity).first()
    if node is None:
        identity_refusal(identity)
    _key_refusal(node, identity, public_key)


def identity_folded(identity: str) -> str:
    """An identity as look-alikes share it: NFKC (full-width and compatibility forms to their plain ones), then
    case-folded."""
    return unicodedata.normalize("NFKC", identity).casefold()


def identity_problem(identity: str) -> str | None:
    """Why `identity` cannot name a node on its own (white space at its ends, an invisible or control character,
    letters of more than one script), or None."""
    if identity != identity.strip():
        return "it begins or ends with white space"
    for ch in identity:
        if unicodedata.category(ch)[0] in "CZ" and ch != " ":
            return f"it holds an invisible or control character (U+{ord(ch):04X})"
    scripts = {unicodedata.name(ch, "UNKNOWN").split(" ")[0] for ch in unicodedata.normalize("NFKC", identity)
               if ch.isalpha()}
    if len(scripts) > 1:
        return f"it mixes the letters of several scripts ({', '.join(sorted(scripts)).lower()})"
    return None


def identity_refusal(identity: str) -> None:
    """Raise JoinRefused for an identity no node may take: one identity_problem names, or one that looks like
    another node's (the same but for case or width), which would show beside it as if it were another host."""
    if problem := identity_problem(identity):
        raise JoinRefused(CloseCode.IDENTITY_REFUSED, f"identity {identity[:60]!r} is refused: {problem}")
    folded = identity_folded(identity)
    for other in Node.objects.exclude(identity=identity).values_list("identity", flat=True).iterator():
        if identity_folded(other) == folded:
            raise JoinRefused(CloseCode.IDENTITY_REFUSED, f"identity {identity[:60]!r} is refused: it looks like "
                                                          f"node {other!r}'s (delete that node in the admin if it "
                                                          "is this host under its old name)")


def _key_refusal(node: Node | None, identity: str, public_key: str) -> None:
    if RevokedNodeKey.objects.filter(public_key=public_key).exists():
        raise JoinRefused(CloseCode.NODE_REVOKED,
                          f"node key {fingerprint(bytes.fromhex(public_key))} was revoked by the operator")
    if node is not None and node.public_key and not secrets.compare_digest(node.public_key, public_key):
        raise JoinRefused(CloseCode.IDENTITY_TAKEN, f"identity {identity!r} is bound to key {node.key_fingerprint}; "
                                                    f"refused key {fingerprint(bytes.fromhex(public_key))}")


def node_release_key(*, node: Node) -> bool:
    """Unbind the node's identity from its key: the next node that joins under it with a valid token binds its own.
    False when it was not bound."""
    return bool(Node.objects.filter(pk=node.pk).exclude(public_key="").update(public_key="", key_bound_at=None))


def node_revoke(*, node: Node) -> bool:
    """Revoke the node's key: its link closes on whichever head process holds it, and the key never joins again.
    The identity stays bound to the revoked key until the operator releases it. False if it had no key or already
    was revoked."""
    if not node.public_key:
        return False
    _, created = RevokedNodeKey.objects.get_or_create(public_key=node.public_key,
                                                      defaults={"identity": node.identity})
    node_mark_offline(node_id=node.pk)
    transaction.on_commit(lambda: _close_links(node_group(str(node.pk)), CloseCode.NODE_REVOKED,
                                               f"node {node.identity!r} was revoked"))
    return created


# --- nodes --------------------------------------------------------------------------------------------------


@dataclass
class Registration:
    node: Node
    rejoin: bool
    model_names: list[str]
    warnings: list[str]
    tokenizers: dict[str, str] = field(default_factory=dict)  # the names it serves under -> tokenizer fingerprints


def _served_model_files() -> dict[str, set[str]]:
    """The text models the fleet serves, each with the fingerprints of the files its nodes serve it from (speech
    models, `node_join --transcribe`, are no names to take)."""
    served: dict[str, set[str]] = {}
    rows = Node.objects.exclude(state=Node.State.OFFLINE).values_list("models_served", "capabilities", "model_files")
    for names, capabilities, files in rows:
        files = files if isinstance(files, dict) else {}
        for name in set(names or []) - _speech_models(capabilities):
            served.setdefault(name, set()).update([files[name]] if isinstance(files.get(name), str) else [])
    return served


def _speech_models(capabilities) -> set[str]:
    speech = capabilities.get("speech_models") if isinstance(capabilities, dict) else None
    return {m for m in speech if isinstance(m, str)} if isinstance(speech, list) else set()


def node_fleet_model_name(own: str, *, file: str = "", served: dict[str, set[str]]) -> tuple[str, str | None]:
    """The name a node's model takes on the fleet: its own, unless the fleet serves that same file (its
    fingerprint, `file`) under one other name: that name then. Never because of which names happen to be served
    (join order decided names once: the first node back made the next serve under its name)."""
    if not served or own in served:
        return own, None
    same = sorted(name for name, files in served.items() if file and file in files)
    if len(same) == 1:
        return same[0], (f"the node calls its model {own!r}; the fleet serves the same file as {same[0]!r}, so it "
                         f"serves as {same[0]!r}")
    return own, f"the fleet serves no model named {own!r} (it serves {', '.join(sorted(served))}); serving it as is"


@transaction.atomic
def node_register(
    *, identity: str, public_key: str, address: str, token: FleetToken | None, models: list[str], lanes: int,
    context_window: int, capabilities: dict, engine: str, version: str, labels: dict, replicas: list[dict],
    tokenizers: dict[str, str] | None = None, device: dict | None = None, files: dict[str, str] | None = None,
) -> Registration:
    """Create or update the Node for a (re)joining host; a rejoin is recognised by its identity, whose key must be
    the one bound to it (the first join, or the first after a release, binds it). `tokenizers`: the node's models'
    tokenizer fingerprints; `device`: what its engines run on (nodes.link.device, {} from a node that does not say);
    `files`: its models' file fingerprints (nodes.agent.gguf_info.file_fingerprint), by its own names.
    Raises JoinRefused (also for a model whose tokenizer is not its registry namesake's)."""
    tokenizers = tokenizers or {}
    _tokenizer_refusal(tokenizers)
    files = files or {}
    served = _served_model_files()
    names, warnings = [], []
    in_registry = set(Model.objects.filter(name__in=models).values_list("name", flat=True))
    speech = _speech_models(capabilities)
    for own in models:  # a registry model (a deployed one) and a speech model keep their names
        keep = own in in_registry or own in speech
        name, warning = (own, None) if keep else node_fleet_model_name(own, file=files.get(own, ""), served=served)
        names.append(name)
        if warning:
            warnings.append(warning)
    node = Node.objects.select_for_update().filter(identity=identity).first()
    if node is None:  # a node that joined before these rules keeps its identity
        identity_refusal(identity)
    _key_refusal(node, identity, public_key)
    rejoin = node is not None
    node = node or Node(identity=identity)
    now = timezone.now()
    if not node.public_key:
        node.public_key, node.key_bound_at = public_key, now
    node.models_served, node.lanes, node.context_window = names, lanes, context_window
    node.model_files = {name: files[own] for own, name in zip(models, names, strict=True) if own in files}
    node.capabilities, node.engine, node.version = capabilities, engine, version
    node.labels, node.replicas, node.address, node.token = labels, replicas, address, token
    node.device = device or {}
    node.state = {Node.Hold.DRAIN: Node.State.DRAINING, Node.Hold.CORDON: Node.State.CORDONED}.get(
        node.hold, Node.State.ONLINE
    )
    node.joined_at = node.last_seen_at = now
    node.save()
    link_event_record(kind=LinkEvent.Kind.REJOINED if rejoin else LinkEvent.Kind.JOINED, node_id=node.pk,
                      identity=identity, peer=address, detail=", ".join(names))
    if token is not None:
        FleetToken.objects.filter(pk=token.pk).update(last_used_at=now)
    fleet_tokenizers = {name: tokenizers[own] for own, name in zip(models, names, strict=True) if own in tokenizers}
    return Registration(node=node, rejoin=rejoin, model_names=names, warnings=warnings, tokenizers=fleet_tokenizers)


def _tokenizer_refusal(tokenizers: dict[str, str]) -> None:
    """A model the registry stores under the same name must have the registry's tokenizer: placement keys its
    prompts with that one, and the node would read them with another."""
    for model in Model.objects.filter(name__in=list(tokenizers)).order_by("name"):
        try:
            registry = model_tokenizer(model)
        except VocabError as exc:  # its blob is gone or unreadable: nothing to compare with
            log.warning("fleet cannot read the tokenizer of registry model %r: %s", model.name, exc)
            continue
        own = tokenizers[model.name]
        # A builtin (`mock`, `bytes`) is no exception: placement would key the registry model's prompts with it.
        if registry and own != registry:
            raise JoinRefused(CloseCode.TOKENIZER_MISMATCH, f"tokenizer {own[:12]} differs from the registry's "
                                                            f"{registry[:12]} for model {model.name!r}")


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


# --- link history ---------------------------------------------------------------------------------------------

LINK_EVENTS_KEPT = 200


def link_event_record(*, kind: str, node_id=None, identity: str = "", peer: str = "", code: int | None = None,
                      detail: str = "") -> LinkEvent:
    """Add one event to a node's link history (node-less for a refusal before it registered) and drop what is older
    than the newest LINK_EVENTS_KEPT of the same node (or of the node-less ones): two statements, no read."""
    event = LinkEvent.objects.create(node_id=node_id, identity=identity[:200], kind=kind, peer=(peer or "")[:200],
                                     code=code, detail=detail[:300])
    same = LinkEvent.objects.filter(node_id=node_id) if node_id else LinkEvent.objects.filter(node__isnull=True)
    oldest_kept = same.order_by("-created_at").values("created_at")[LINK_EVENTS_KEPT - 1:LINK_EVENTS_KEPT]
    same.filter(created_at__lt=Subquery(oldest_kept)).delete()
    return event
