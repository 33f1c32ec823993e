"""The model registry on the head: figures from the GGUF's own metadata, blobs stored once by hash, bad files refused
with what is wrong, `manage.py model_add`, `/api/models/` uploads in parts, and pull grants for the blob endpoint."""

from __future__ import annotations

import hashlib
import shutil

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import AsyncClient, override_settings
from rest_framework.test import APIClient

from nodes import registry
from nodes.agent.engine.local import bundled_model_path
from nodes.blobs import blob_dir
from nodes.models import Model
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

MODEL = bundled_model_path()
MODEL_SHA256 = hashlib.sha256(open(MODEL, "rb").read()).hexdigest()  # noqa: SIM115 - read once for the whole module


@pytest.fixture(autouse=True)
def home(tmp_path):
    with override_settings(FLEET_HOME=tmp_path):
        yield tmp_path


@pytest.fixture
def staff():
    api = APIClient()
    api.force_authenticate(UserFactory(username="operator"))
    return api


def blobs(home):
    return sorted(p.name for p in (home / "blobs").iterdir() if p.is_file())


def test_a_model_is_described_by_its_own_metadata_and_stored_by_its_hash(home):
    model = registry.model_add(path=MODEL, name="tiny-chat")
    assert (model.architecture, model.quantization, model.context_length) == ("llama", "Q4_1", 8192)
    # SmolLM2-135M: 30 layers x 3 KV heads x (64 + 64) head dims x 2 bytes
    assert model.kv_bytes_per_token == 30 * 3 * 128 * 2
    assert "<|im_start|>" in model.chat_template and model.size == 98362432
    assert model.sha256 == MODEL_SHA256 and blobs(home) == [MODEL_SHA256]
    assert hashlib.sha256((home / "blobs" / MODEL_SHA256).read_bytes()).hexdigest() == MODEL_SHA256


def test_the_same_file_added_twice_is_stored_once_and_kept_until_its_last_name_goes(home):
    first = registry.model_add(path=MODEL, name="tiny-chat")
    second = registry.model_add(path=MODEL, name="tiny-too")
    assert first.sha256 == second.sha256 and blobs(home) == [MODEL_SHA256]
    assert not list((home / "blobs" / "uploads").iterdir())
    registry.model_delete(model=first)
    assert blobs(home) == [MODEL_SHA256]
    registry.model_delete(model=second)
    assert blobs(home) == []


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_bytes(b"PK\x03\x04 a zip, not a model" * 100), "it is not a GGUF file"),
        (lambda p: p.write_bytes(open(MODEL, "rb").read()[: 50_000_000]), "it is truncated: its tensors need"),  # noqa: SIM115
        (lambda p: p.write_bytes(open(MODEL, "rb").read()[:3000]), "its header is unreadable, truncated or corrupt"),  # noqa: SIM115
    ],
    ids=["not-gguf", "truncated-data", "truncated-header"],
)
def test_a_file_that_is_not_a_whole_gguf_model_is_refused_with_what_is_wrong(home, tmp_path_factory, make, message):
    path = tmp_path_factory.mktemp("bad") / "bad.gguf"
    make(path)
    with pytest.raises(registry.RegistryError) as info:
        registry.model_add(path=path, name="bad")
    assert message in str(info.value)
    assert Model.objects.count() == 0 and blobs(home) == [] and not list((home / "blobs" / "uploads").iterdir())


def test_names_are_checked_and_never_taken_twice():
    registry.model_add(path=MODEL, name="tiny-chat")
    with pytest.raises(registry.RegistryError, match="already in the registry"):
        registry.model_add(path=MODEL, name="tiny-chat")
    with pytest.raises(registry.RegistryError, match="is not valid"):
        registry.model_add(path=MODEL, name="../etc")


def test_model_add_command_prints_the_figures_and_refuses_in_one_line(home):
    from io import StringIO

    out = StringIO()
    call_command("model_add", MODEL, "--name", "tiny-chat", stdout=out)
    assert "Model 'tiny-chat' added: llama, Q4_1, 98,362,432 bytes, trained context 8,192 tokens" in out.getvalue()
    assert "node_join <head> --model tiny-chat" in out.getvalue()
    with pytest.raises(CommandError) as info:
        call_command("model_add", str(home / "nothing.gguf"), "--name", "x")
    assert info.value.returncode == 2 and "no file at" in str(info.value)


def upload(api, data: bytes, part: int) -> str:
    started = api.post("/api/models/uploads/")
    assert started.status_code == 201 and started.json()["offset"] == 0
    upload_id = started.json()["upload"]
    for offset in range(0, len(data), part):
        sent = api.put(f"/api/models/uploads/{upload_id}/?offset={offset}", data[offset:offset + part],
                       content_type="application/octet-stream")
        assert sent.status_code == 200, sent.content
        assert sent.json()["offset"] == min(len(data), offset + part)
    return upload_id


def test_the_api_adds_a_model_uploaded_in_parts(staff, home):
    data = open(MODEL, "rb").read()  # noqa: SIM115
    upload_id = upload(staff, data, 3 << 20)
    created = staff.post("/api/models/", {"name": "tiny-chat", "upload": upload_id}, format="json")
    assert created.status_code == 201, created.content
    body = created.json()
    assert (body["name"], body["sha256"], body["size"], body["context_length"]) == ("tiny-chat", MODEL_SHA256,
                                                                                    len(data), 8192)
    assert blobs(home) == [MODEL_SHA256]
    assert [m["name"] for m in staff.get("/api/models/").json()["results"]] == ["tiny-chat"]
    assert staff.delete(f"/api/models/{body['id']}/").status_code == 204
    assert blobs(home) == [] and Model.objects.count() == 0


def test_upload_mistakes_get_clear_answers(staff):
    upload_id = staff.post("/api/models/uploads/").json()["upload"]
    octet = "application/octet-stream"
    staff.put(f"/api/models/uploads/{upload_id}/?offset=0", b"GGUF" + b"\0" * 60, content_type=octet)
    again = staff.put(f"/api/models/uploads/{upload_id}/?offset=0", b"GGUF", content_type=octet)
    assert again.status_code == 409 and again.json()["offset"] == 64 and "at offset 64, not 0" in again.json()["detail"]
    no_offset = staff.put(f"/api/models/uploads/{upload_id}/", b"x", content_type="application/octet-stream")
    assert no_offset.status_code == 400 and "offset" in no_offset.json()
    unknown = staff.put(f"/api/models/uploads/{'0' * 32}/?offset=0", b"x", content_type="application/octet-stream")
    assert unknown.status_code == 404 and "start one first" in unknown.json()["detail"]
    refused = staff.post("/api/models/", {"name": "junk", "upload": upload_id}, format="json")
    assert refused.status_code == 400 and "its header is unreadable" in refused.json()["detail"]
    bad_name = staff.post("/api/models/", {"name": "a b", "upload": upload_id}, format="json")
    assert bad_name.status_code == 400 and "is not valid" in bad_name.json()["detail"]


def test_the_registry_is_for_staff_only():
    from api.services import api_key_create

    _, key = api_key_create(owner=UserFactory(is_staff=False, is_superuser=False), name="dev")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert api.get("/api/models/").status_code == 403
    assert api.post("/api/models/uploads/").status_code == 403


def test_a_grant_names_the_file_and_the_blob_answers_only_to_it(settings):
    model = registry.model_add(path=MODEL, name="tiny-chat")
    grant = registry.model_grant(name="tiny-chat", identity="gpu-1")
    assert (grant.sha256, grant.size, grant.path, grant.error) == (model.sha256, model.size,
                                                                   f"/models/blobs/{model.sha256}", "")
    assert grant.expires_s == settings.FLEET_PULL_GRANT_S and grant.grant
    assert "has no model named 'nope'" in registry.model_grant(name="nope", identity="gpu-1").error
    with pytest.raises(registry.GrantRefused, match="another file"):
        registry.model_grant_open(grant=grant.grant, sha256="0" * 64)
    with pytest.raises(registry.GrantRefused, match="not one this head signed"):
        registry.model_grant_open(grant=grant.grant[:-2] + "xx", sha256=model.sha256)
    settings.FLEET_PULL_GRANT_S = -1
    with pytest.raises(registry.GrantRefused, match="expired"):
        registry.model_grant_open(grant=grant.grant, sha256=model.sha256)


async def read(response) -> bytes:
    return b"".join([chunk async for chunk in response.streaming_content])


@pytest.mark.django_db(transaction=True)
async def test_the_blob_is_served_in_ranges_to_a_grant_in_a_header_only():
    from asgiref.sync import sync_to_async

    model = await sync_to_async(registry.model_add)(path=MODEL, name="tiny-chat")
    grant = await sync_to_async(registry.model_grant)(name="tiny-chat", identity="gpu-1")
    client, url = AsyncClient(), grant.path
    assert (await client.get(url)).status_code == 401
    assert (await client.get(f"{url}?grant={grant.grant}")).status_code == 401  # never in the URL
    assert (await client.get(url, headers={"Authorization": "Fleet-Grant forged"})).status_code == 403
    auth = {"Authorization": f"Fleet-Grant {grant.grant}"}
    piece = await client.get(url, headers={**auth, "Range": "bytes=1000-1999"})
    assert piece.status_code == 206 and piece["Content-Range"] == f"bytes 1000-1999/{model.size}"
    assert await read(piece) == open(MODEL, "rb").read()[1000:2000]  # noqa: SIM115
    tail = await client.get(url, headers={**auth, "Range": f"bytes={model.size - 10}-"})
    assert tail.status_code == 206 and len(await read(tail)) == 10
    beyond = await client.get(url, headers={**auth, "Range": f"bytes={model.size}-"})
    assert beyond.status_code == 416 and beyond["Content-Range"] == f"bytes */{model.size}"
    await sync_to_async(shutil.rmtree)(blob_dir())
    assert (await client.get(url, headers=auth)).status_code == 404


def test_the_admin_lists_models_and_adds_them_through_the_parts_api(client):
    from django.contrib.auth import get_user_model

    registry.model_add(path=MODEL, name="tiny-chat")
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.com", "pw"))
    listed = client.get("/admin/nodes/model/").content.decode()
    assert "tiny-chat" in listed and "Q4_1" in listed and MODEL_SHA256[:12] in listed
    page = client.get("/admin/nodes/model/add/").content.decode()
    assert 'id="model-file"' in page and "/api/models/uploads/" in page and "application/octet-stream" in page


@pytest.mark.django_db
def test_an_alias_change_is_seen_at_once_in_the_process_that_made_it(monkeypatch):
    """Made, changed and deleted here, an alias resolves anew at the next request, on the loop as off it, though the
    table would otherwise be kept for ALIASES_TTL_S (an hour here)."""
    from asgiref.sync import async_to_sync

    from fleet import aliases
    from fleet.links import registry
    from nodes.models import ModelAlias

    on_loop = async_to_sync(registry().aliases.atable)  # as the streaming endpoints read it
    monkeypatch.setattr(aliases, "ALIASES_TTL_S", 3600.0)
    assert on_loop().get("gpt-4o") is None  # loaded, and fresh for an hour
    row = ModelAlias.objects.create(name="gpt-4o", target="smollm2")
    assert on_loop()["gpt-4o"] == "smollm2"
    row.target = "qwen-7b"
    row.save()
    assert registry().aliases.resolve("gpt-4o") == "qwen-7b"
    row.delete()
    assert on_loop().get("gpt-4o") is None
