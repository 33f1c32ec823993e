"""Who may reach what: every URL pattern of the project, for an anonymous client, the owner's API key, another
user's API key and a staff session, with real objects (the owner's) filled into the URL.

The rules: /v1 takes API keys only. In /api, an owner's sessions, handles, generations and keys are invisible to
any other non-staff key (404, as for an object that does not exist); staff see and act on everything; nodes and
fleet tokens are staff-only (403 for other keys). The admin and its pages need a staff session (a key is no login).
On /v1 and the websocket, another owner's session or handle id is refused exactly as an id that does not exist.

The walk iterates django.urls.get_resolver(), so a URL added later without an entry in `cases_for` fails here.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.apps import apps
from django.contrib.admin.utils import quote as admin_quote
from django.contrib.auth.models import Group
from django.contrib.contenttypes.models import ContentType
from django.test import Client
from django.urls import URLResolver, get_resolver, reverse
from django.utils import timezone

from api.batches import batch_ref, file_create, file_ref
from api.models import Batch
from api.services import api_key_create
from nodes.services import fleet_token_create
from sessions.models import InferenceSession
from tests.api_support import add_fake_node
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

ANON, OWNER, OTHER, STAFF = "anonymous", "owner", "other", "staff"
PRINCIPALS = (ANON, OWNER, OTHER, STAFF)


def statuses(anon: int, owner: int, other: int, staff: int) -> dict[str, int]:
    return {ANON: anon, OWNER: owner, OTHER: other, STAFF: staff}


PUBLIC = statuses(200, 200, 200, 200)
KEYS_ONLY = statuses(401, 200, 200, 401)  # /v1: a staff session is no API key
ANY_KEY = statuses(401, 200, 200, 200)
OWNED = statuses(401, 200, 404, 200)
STAFF_ONLY = statuses(401, 403, 403, 200)
ADMIN = statuses(302, 302, 302, 200)  # to the login page


@dataclass
class Route:
    """One URL pattern as the walk found it: the full route, its name (namespaced) and what it captures."""

    route: str
    name: str | None
    kwargs: tuple[str, ...]

    def __str__(self) -> str:
        return self.name or self.route


def _walk(resolver, prefix: str = "", namespace: str | None = None):
    for pattern in resolver.url_patterns:
        if isinstance(pattern, URLResolver):
            inner = ":".join(n for n in (namespace, pattern.namespace) if n) or None
            yield from _walk(pattern, prefix + str(pattern.pattern), inner)
        else:
            name = f"{namespace}:{pattern.name}" if namespace and pattern.name else pattern.name
            yield Route(prefix + str(pattern.pattern), name, tuple(pattern.pattern.regex.groupindex))


ROUTES = list(_walk(get_resolver()))


@dataclass
class World:
    """The objects the URLs are filled with: all of them the owner's, but the node and the fleet token."""

    owner: Any
    owner_key: Any
    owner_secret: str
    other_secret: str
    staff: Any
    node: Any
    token: Any
    session: Any
    grammar: Any
    bias: Any
    generation: Any
    group: Any
    batch_file: Any = None
    batch: Any = None

    def session_fresh(self):
        return SessionFactory(owner=self.owner, api_key=self.owner_key)

    def stored_fresh(self):
        """A stored /v1/responses answer of the owner's key."""
        from sessions.services import stored_response_create

        # "_24" is what the admin's unquote reads as "$": an id the admin must quote in a URL (1 in 40 real ones)
        return stored_response_create(response_id=f"resp_24{uuid.uuid4().hex[2:]}", model="smollm2",
                                      api_key=self.owner_key, messages=[{"role": "user", "content": "Hi"}],
                                      input_items=[], body={})

    def object_of(self, model) -> Any:
        label = model._meta.label_lower
        built = {
            "auth.user": lambda: self.owner, "auth.group": lambda: self.group, "nodes.node": lambda: self.node,
            "nodes.fleettoken": lambda: self.token, "api.apikey": lambda: self.owner_key,
            "inference_sessions.inferencesession": lambda: self.session,
            "inference_sessions.generation": lambda: self.generation,
            "inference_sessions.grammarhandle": lambda: self.grammar,
            "inference_sessions.logitbiashandle": lambda: self.bias,
            "nodes.revokednodekey": lambda: model.objects.get_or_create(public_key="ab" * 32, identity="gone")[0],
            "api.batchfile": lambda: self.batch_file, "api.batch": lambda: self.batch,
            "nodes.model": lambda: registry_model("walk-model"),
            "nodes.deployment": lambda: deployment(),
            "inference_sessions.storedresponse": lambda: self.stored_fresh(),
            "nodes.modelalias": lambda: alias(),
        }.get(label)
        if built is None:
            pytest.fail(f"the URL walk has no object of {label}: add one to World.object_of")
        return built()


def registry_model(name: str):
    """A registry entry (no file behind it: the walk only asks who may see and delete it)."""
    from nodes.models import Model

    return Model.objects.get_or_create(name=name, defaults={
        "sha256": "ab" * 32, "size": 1, "architecture": "llama", "quantization": "Q4_1", "context_length": 8,
        "kv_bytes_per_token": 1})[0]


def alias():
    from nodes.models import ModelAlias

    return ModelAlias.objects.create(name=f"alias-{uuid.uuid4().hex[:8]}", target="smollm2")


def deployment():
    """A deployment of a registry model on a node by name (no node is linked: nobody is told)."""
    from nodes.models import Deployment

    return Deployment.objects.create(model=registry_model("walk-model"), nodes=["walk-node"])


@pytest.fixture(autouse=True)
def _quick_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # four users per route


@pytest.fixture
def world() -> World:
    add_fake_node()
    owner = UserFactory(is_staff=False, is_superuser=False)
    owner_key, owner_secret = api_key_create(owner=owner, name="mine")
    _, other_secret = api_key_create(owner=UserFactory(is_staff=False, is_superuser=False), name="theirs")
    session = SessionFactory(owner=owner, api_key=owner_key)
    MessageFactory(session=session, index=0)
    batch_file = file_create(owner=owner, filename="in.jsonl", purpose="batch", content=b'{"custom_id": "a"}\n')
    batch = Batch.objects.create(owner=owner, api_key=owner_key, endpoint="/v1/chat/completions",
                                 input_file=batch_file, input_file_ref=file_ref(batch_file), completion_window="24h",
                                 expires_at=timezone.now() + timedelta(days=1))  # not enqueued: nothing runs it
    return World(
        owner=owner, owner_key=owner_key, owner_secret=owner_secret, other_secret=other_secret,
        staff=UserFactory(username="operator"), node=NodeFactory(), token=fleet_token_create(name="rack")[0],
        session=session, grammar=GrammarHandleFactory(owner=owner, api_key=owner_key),
        bias=LogitBiasHandleFactory(owner=owner, api_key=owner_key),
        generation=GenerationFactory(api_key=owner_key, session=session), group=Group.objects.create(name="ops"),
        batch_file=batch_file, batch=batch,
    )


def client_for(principal: str, world: World) -> Client:
    if principal == OWNER:
        return Client(HTTP_AUTHORIZATION=f"Bearer {world.owner_secret}")
    if principal == OTHER:
        return Client(HTTP_AUTHORIZATION=f"Bearer {world.other_secret}")
    client = Client()
    if principal == STAFF:
        client.force_login(world.staff)
    return client


@dataclass
class Case:
    """A request to make to a route, and the status each principal gets. `kwargs` fills the URL (a fresh object
    for each principal where the request destroys it); `body` is sent as JSON."""

    method: str
    expect: dict[str, int]
    kwargs: Callable[[World], dict[str, Any]] | None = None
    body: Callable[[World], dict[str, Any]] | None = None


def chat(**extra) -> Callable[[World], dict[str, Any]]:
    return lambda w: {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                      **{k: v(w) for k, v in extra.items()}}


API_OBJECTS: dict[str, Callable[[World], Any]] = {
    "node": lambda w: w.node, "fleet-token": lambda w: w.token, "api-key": lambda w: w.owner_key,
    "session": lambda w: w.session, "grammar": lambda w: w.grammar, "logit-bias": lambda w: w.bias,
    "generation": lambda w: w.generation, "model": lambda w: registry_model("walk-model"),
    "deployment": lambda w: deployment(), "model-alias": lambda w: alias(),
}
API_FRESH: dict[str, Callable[[World], Any]] = {
    "fleet-token": lambda w: fleet_token_create(name="spare")[0],
    "api-key": lambda w: api_key_create(owner=w.owner, name="spare")[0],
    "session": lambda w: w.session_fresh(),
    "grammar": lambda w: GrammarHandleFactory(owner=w.owner, api_key=w.owner_key),
    "logit-bias": lambda w: LogitBiasHandleFactory(owner=w.owner, api_key=w.owner_key),
    "model": lambda w: registry_model(f"walk-{uuid.uuid4().hex[:8]}"),
    "deployment": lambda w: deployment(),
    "model-alias": lambda w: alias(),
}


def message(**extra) -> Callable[[World], dict[str, Any]]:
    return lambda w: {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}


def stored(w: World) -> dict[str, Any]:
    return {"response_id": w.stored_fresh().id}


NAMED: dict[str, list[Case]] = {
    "healthz": [Case("GET", PUBLIC)],
    "home": [Case("GET", statuses(302, 302, 302, 302))],  # everyone is sent on to the admin (its login page)
    "metrics": [Case("GET", statuses(401, 401, 401, 200))],  # an API key is no scrape token; a staff session is
    "fleet-overview": [Case("GET", ADMIN)],
    "fleet-playground": [Case("GET", ADMIN)],
    "v1-openapi": [Case("GET", PUBLIC)],
    "v1-docs": [Case("GET", PUBLIC)],
    "v1-models": [Case("GET", KEYS_ONLY)],
    "v1-model": [Case("GET", KEYS_ONLY, kwargs=lambda w: {"model": "smollm2"})],
    "v1-chat-completions": [
        Case("POST", KEYS_ONLY, body=chat()),
        Case("POST", statuses(401, 200, 400, 401), body=chat(session=lambda w: str(w.session.id))),
        Case("POST", statuses(401, 200, 400, 401), body=chat(grammar=lambda w: str(w.grammar.id))),
        Case("POST", statuses(401, 200, 400, 401), body=chat(logit_bias_handle=lambda w: str(w.bias.id))),
    ],
    "v1-completions": [
        Case("POST", statuses(401, 200, 400, 401),
             body=lambda w: {"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "grammar": str(w.grammar.id)}),
    ],
    "v1-embeddings": [Case("POST", KEYS_ONLY, body=lambda w: {"model": "smollm2", "input": "Hi"})],
    # a key gets as far as the form: JSON is no multipart upload (tests/test_transcriptions_e2e.py sends one); so does
    # a staff session, which the playground uses (its CSRF token is checked, which Django's test client skips: the
    # refusal without it is tests/test_transcriptions.py's)
    "v1-audio-transcriptions": [Case("POST", statuses(401, 415, 415, 415), body=lambda w: {"model": "whisper"})],
    "v1-responses": [
        Case("POST", KEYS_ONLY, body=lambda w: {"model": "smollm2", "input": "Hi", "max_output_tokens": 2}),
        # another owner's stored response is one that does not exist
        Case("POST", statuses(401, 200, 404, 401), body=lambda w: {
            "model": "smollm2", "input": "Hi", "max_output_tokens": 2, "previous_response_id": w.stored_fresh().id}),
    ],
    "v1-response": [Case("GET", statuses(401, 200, 404, 401), kwargs=stored),
                    Case("DELETE", statuses(401, 200, 404, 401), kwargs=stored)],
    "v1-response-input-items": [Case("GET", statuses(401, 200, 404, 401), kwargs=stored)],
    "v1-messages": [Case("POST", KEYS_ONLY, body=message())],
    "v1-messages-count-tokens": [Case("POST", KEYS_ONLY, body=message())],
    "v1-files": [Case("GET", KEYS_ONLY)],
    "v1-file": [Case("GET", statuses(401, 200, 404, 401), kwargs=lambda w: {"file_id": file_ref(w.batch_file)})],
    "v1-file-content": [Case("GET", statuses(401, 200, 404, 401),
                             kwargs=lambda w: {"file_id": file_ref(w.batch_file)})],
    "v1-batches": [Case("GET", KEYS_ONLY)],
    "v1-batch": [Case("GET", statuses(401, 200, 404, 401), kwargs=lambda w: {"batch_id": batch_ref(w.batch)})],
    "v1-batch-cancel": [Case("POST", statuses(401, 200, 404, 401), kwargs=lambda w: {"batch_id": batch_ref(w.batch)})],
    "api-fleet": [Case("GET", ANY_KEY)],
    "api-schema": [Case("GET", PUBLIC)],
    "api-docs": [Case("GET", PUBLIC)],
    "api-root": [Case("GET", ANY_KEY)],
    "node-list": [Case("GET", STAFF_ONLY)],
    "node-detail": [Case("GET", STAFF_ONLY)],
    "node-drain": [Case("POST", STAFF_ONLY)],
    "node-cordon": [Case("POST", STAFF_ONLY)],
    "node-uncordon": [Case("POST", STAFF_ONLY)],
    "fleet-token-list": [Case("GET", STAFF_ONLY)],
    "fleet-token-detail": [Case("GET", STAFF_ONLY), Case("DELETE", statuses(401, 403, 403, 204))],
    "fleet-token-revoke": [Case("POST", STAFF_ONLY)],
    "api-key-list": [Case("GET", ANY_KEY)],
    "api-key-detail": [Case("GET", OWNED), Case("DELETE", statuses(401, 204, 404, 204))],
    "session-list": [Case("GET", ANY_KEY)],
    "session-detail": [Case("GET", OWNED), Case("DELETE", statuses(401, 204, 404, 204))],
    "session-messages": [Case("GET", OWNED), Case("POST", OWNED, body=lambda w: {"content": "Hi", "max_tokens": 2})],
    "grammar-list": [Case("GET", ANY_KEY)],
    "grammar-detail": [Case("GET", OWNED), Case("DELETE", statuses(401, 204, 404, 204))],
    "logit-bias-list": [Case("GET", ANY_KEY)],
    "logit-bias-detail": [Case("GET", OWNED), Case("DELETE", statuses(401, 204, 404, 204))],
    "generation-list": [Case("GET", ANY_KEY)],
    "generation-detail": [Case("GET", OWNED)],
    "model-list": [Case("GET", STAFF_ONLY)],
    "model-detail": [Case("GET", STAFF_ONLY), Case("DELETE", statuses(401, 403, 403, 204))],
    "model-upload-start": [Case("POST", statuses(401, 403, 403, 201))],
    # staff: a part with no ?offset is a 400 that says to give one
    "model-upload-part": [Case("PUT", statuses(401, 403, 403, 400), kwargs=lambda w: {"upload_id": "0" * 32})],
    "model-alias-list": [Case("GET", STAFF_ONLY)],
    "model-alias-detail": [Case("GET", STAFF_ONLY), Case("DELETE", statuses(401, 403, 403, 204))],
    "deployment-list": [Case("GET", STAFF_ONLY)],
    "deployment-detail": [Case("GET", STAFF_ONLY), Case("DELETE", statuses(401, 403, 403, 204))],
    # the registry's files answer only to a node's pull grant: no API key or staff session opens them
    "model-blob": [Case("GET", statuses(401, 401, 401, 401), kwargs=lambda w: {"sha256": "ab" * 32})],
    # The admin's own pages.
    "admin:index": [Case("GET", ADMIN)],
    "admin:login": [Case("GET", statuses(200, 200, 200, 302))],  # staff: already in, sent to the index
    "admin:logout": [Case("GET", statuses(302, 302, 302, 405))],  # logging out is a POST
    "admin:password_change": [Case("GET", ADMIN)],
    "admin:password_change_done": [Case("GET", ADMIN)],
    "admin:autocomplete": [Case("GET", statuses(302, 302, 302, 403))],  # staff: no such autocomplete field
    "admin:jsi18n": [Case("GET", ADMIN)],
    "admin:api_batchfile_download": [Case("GET", ADMIN, kwargs=lambda w: {"pk": w.batch_file.pk})],
    "admin:view_on_site": [Case("GET", statuses(302, 302, 302, 404), kwargs=lambda w: {  # nodes have no page
        "content_type_id": ContentType.objects.get_for_model(w.node).pk, "object_id": w.node.pk})],
    "admin:app_list": [Case("GET", ADMIN, kwargs=lambda w: {"app_label": "api"})],
    "admin:auth_user_password_change": [Case("GET", ADMIN, kwargs=lambda w: {"id": w.owner.pk})],
}
ADMIN_MODEL_VIEWS = ("changelist", "add", "history", "delete", "change")
# Admin pages a staff user may not open: the records that are written by the fleet, never by hand.
ADMIN_READ_ONLY = {"inference_sessions_generation_add": 403, "nodes_node_add": 403, "nodes_revokednodekey_add": 403,
                   "inference_sessions_storedresponse_add": 403, "api_batch_add": 403, "api_batchfile_add": 403}


def _admin_model(name: str):
    """`admin:<app>_<model>_<view>` of a registered ModelAdmin: (model, view), else None."""
    from django.contrib import admin

    for model in admin.site._registry:
        prefix = f"admin:{model._meta.app_label}_{model._meta.model_name}_"
        if name.startswith(prefix) and name[len(prefix):] in ADMIN_MODEL_VIEWS:
            return model, name[len(prefix):]
    return None


def cases_for(route: Route) -> list[Case] | None:
    """What to ask of this route, or None when it is not classified."""
    if route.name in NAMED:
        return NAMED[route.name]
    if route.name and route.name.startswith("admin:") and (found := _admin_model(route.name)):
        model, view = found
        # The admin quotes an id in its own links ("resp_24…" would otherwise unquote to "resp$…").
        kwargs = (lambda w, m=model: {"object_id": admin_quote(w.object_of(m).pk)}) if "object_id" in route.kwargs \
            else None
        staff = ADMIN_READ_ONLY.get(route.name.removeprefix("admin:"), 200)
        return [Case("GET", statuses(302, 302, 302, staff), kwargs=kwargs)]
    if route.name is None and route.route.startswith("admin/") and route.route.endswith("<path:object_id>/"):
        model = _admin_model_at(route.route)
        return [Case("GET", statuses(302, 302, 302, 302),
                     kwargs=lambda w: {"object_id": admin_quote(w.object_of(model).pk)})]
    if route.name is None and route.route == "admin/(?P<url>.*)$":  # the admin's catch-all
        return [Case("GET", statuses(302, 302, 302, 404), kwargs=lambda w: {"url": "no-such-page/"})]
    return None


def _admin_model_at(route: str):
    app_label, model_name = route.split("/")[1:3]
    return apps.get_model(app_label, model_name)


def _url(route: Route, kwargs: dict[str, Any]) -> str:
    if route.name:
        return reverse(route.name, kwargs=kwargs or None)
    path = route.route
    for name, value in kwargs.items():
        path = path.replace(f"<path:{name}>", str(value)).replace(f"(?P<{name}>.*)$", str(value))
    return "/" + path


def _kwargs(route: Route, case: Case, world: World) -> dict[str, Any]:
    if case.kwargs is not None:
        kwargs = case.kwargs(world)
    elif "pk" in route.kwargs:
        basename = route.name.rsplit("-", 1)[0]  # session-detail, fleet-token-revoke: the router's basename
        make = API_FRESH[basename] if case.method == "DELETE" else API_OBJECTS[basename]
        kwargs = {"pk": make(world).pk}
    else:
        kwargs = {}
    if "format" in route.kwargs:
        kwargs["format"] = "json"
    return kwargs


@pytest.mark.parametrize("route", ROUTES, ids=[f"{r}{' ' + ','.join(r.kwargs) if r.kwargs else ''}" for r in ROUTES])
def test_who_gets_what(route: Route, world: World):
    cases = cases_for(route)
    if cases is None:
        pytest.fail(f"{route.route!r} ({route.name}) is not classified: add what an anonymous client, the owner's "
                    "key, another user's key and a staff session get to NAMED in tests/test_api_access.py")
    got, wanted = {}, {}
    for number, case in enumerate(cases):
        for principal in PRINCIPALS:
            url = _url(route, _kwargs(route, case, world))
            body = json.dumps(case.body(world)) if case.body else None
            response = client_for(principal, world).generic(case.method, url, data=body or "",
                                                            content_type="application/json")
            got[(number, case.method, principal)] = response.status_code
            wanted[(number, case.method, principal)] = case.expect[principal]
    assert got == wanted


# --- another owner's ids on /v1 and the websocket are as ids that do not exist ----------------------------------


def _refusal(client: Client, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = client.post("/v1/chat/completions", json.dumps(body), content_type="application/json")
    return response.status_code, response.json()["error"]


@pytest.mark.parametrize("param, owned", [("session", "session"), ("grammar", "grammar"),
                                          ("logit_bias_handle", "bias")])
def test_another_owners_id_on_v1_gets_what_an_unknown_id_gets(world, param, owned):
    other = client_for(OTHER, world)
    theirs = str(getattr(world, owned).id)
    nobody = str(uuid.uuid4())
    status, error = _refusal(other, chat(**{param: lambda w: theirs})(world))
    unknown_status, unknown = _refusal(other, chat(**{param: lambda w: nobody})(world))
    assert status == unknown_status == 400 and error["param"] == param
    assert {**error, "message": error["message"].replace(theirs, nobody)} == unknown


@pytest.mark.django_db(transaction=True)
async def test_another_owners_session_on_the_websocket_gets_what_an_unknown_one_gets():
    from asgiref.sync import sync_to_async
    from channels.routing import URLRouter
    from channels.testing import WebsocketCommunicator

    from fleet.routing import websocket_urlpatterns

    add_fake_node()
    owner = await sync_to_async(UserFactory)(is_staff=False, is_superuser=False)
    theirs = await sync_to_async(InferenceSession.objects.create)(model="smollm2", owner=owner)
    _, key = await sync_to_async(api_key_create)(owner=await sync_to_async(UserFactory)(is_staff=False), name="x")
    comm = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/v1/generate",
                                 headers=[(b"authorization", f"Bearer {key}".encode())])
    assert (await comm.connect())[0]
    frames = []
    for session in (str(theirs.id), str(uuid.uuid4())):
        await comm.send_json_to({"type": "generate", "id": session, "model": "smollm2", "session": session,
                                 "messages": [{"role": "user", "content": "Hi"}]})
        frame = await comm.receive_json_from(timeout=5)
        frames.append({**frame, "id": None, "message": frame["message"].replace(session, "<id>")})
    await comm.disconnect()
    assert frames[0] == frames[1] and frames[0]["code"] == "session_not_found"


def test_staff_see_every_owners_keys_and_other_keys_only_their_own(world):
    staff_ids = {k["id"] for k in client_for(STAFF, world).get("/api/keys/").json()["results"]}
    other_ids = {k["id"] for k in client_for(OTHER, world).get("/api/keys/").json()["results"]}
    assert str(world.owner_key.pk) in staff_ids and len(staff_ids) == 2
    assert str(world.owner_key.pk) not in other_ids and len(other_ids) == 1
