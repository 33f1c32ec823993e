"""LoRA adapters in the registry, without processes: an adapter is an entry tied to a base model (refused when the
file or the base does not fit), the head lists each node the adapters of the models it serves, and the node's Deployer
loads them on every engine serving the base (announcing BASE:ADAPTER and `lora:ADAPTER`) and unloads one that goes
once no generation uses it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from django.test import override_settings
from rest_framework.test import APIClient

from nodes import deployments, registry
from nodes.agent.deploy import Deployer
from nodes.agent.engine.base import StateOpError
from nodes.agent.engine.local import bundled_model_path
from nodes.agent.model_set import ModelSet
from nodes.link.codes import ErrorCode
from nodes.link.messages import Deploy, Models, ModelState
from nodes.link.spec import GenerateSpec
from nodes.models import Model
from tests.factories import NodeFactory, UserFactory
from tests.lora_adapter import build_adapter
from tests.test_deployments import FakeWorker

MODEL = bundled_model_path()


@pytest.fixture
def home(tmp_path):
    with override_settings(FLEET_HOME=tmp_path / "home"):
        yield tmp_path


@pytest.fixture(scope="module")
def adapter_file(tmp_path_factory) -> Path:
    return build_adapter(tmp_path_factory.mktemp("adapter") / "style.gguf")


# --- the registry -----------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_an_adapter_is_an_entry_tied_to_its_base_and_goes_with_it(home, adapter_file):
    base = registry.model_add(path=MODEL, name="smol")
    adapter = registry.model_add(path=adapter_file, name="style", base="smol")
    assert adapter.base == base and adapter.is_adapter and not base.is_adapter
    assert (adapter.architecture, adapter.context_length, adapter.kv_bytes_per_token) == ("llama", 0, 0)
    registry.model_delete(model=base)
    assert not Model.objects.exists()
    assert not [p for p in (home / "home" / "blobs").iterdir() if p.is_file()]  # both files went


@pytest.mark.django_db
@pytest.mark.parametrize(("which", "base", "says"), [
    ("adapter", "", "the file is a LoRA adapter: name the registry model it belongs to"),
    ("adapter", "nope", "the base 'nope' is not a model in the registry"),
    ("model", "smol", "the file is a model, not a LoRA adapter or a projector"),
    ("other", "smol", "the adapter is for 'qwen2' models; 'smol' is 'llama'"),
])
def test_an_adapter_that_does_not_fit_its_base_is_refused_saying_why(home, adapter_file, which, base, says):
    registry.model_add(path=MODEL, name="smol")
    path = {"adapter": adapter_file, "model": MODEL,
            "other": build_adapter(home / "other.gguf", architecture="qwen2")}[which]
    with pytest.raises(registry.RegistryError, match=says):
        registry.model_add(path=path, name="style", base=base)
    assert list(Model.objects.values_list("name", flat=True)) == ["smol"]


@pytest.mark.django_db
def test_the_api_adds_an_adapter_with_its_base_and_refuses_to_deploy_it(home, adapter_file):
    api = APIClient()
    api.force_authenticate(UserFactory(username="operator"))
    registry.model_add(path=MODEL, name="smol")
    upload = api.post("/api/models/uploads/").json()["upload"]
    sent = api.put(f"/api/models/uploads/{upload}/?offset=0", adapter_file.read_bytes(),
                   content_type="application/octet-stream")
    assert sent.status_code == 200, sent.content
    blank = api.post("/api/models/", {"name": "style", "upload": upload, "base": ""}, format="json")  # the admin form's
    assert blank.status_code == 400 and "name the registry model it belongs to" in str(blank.json()), blank.content
    upload = api.post("/api/models/uploads/").json()["upload"]
    api.put(f"/api/models/uploads/{upload}/?offset=0", adapter_file.read_bytes(),
            content_type="application/octet-stream")
    made = api.post("/api/models/", {"name": "style", "upload": upload, "base": "smol"}, format="json")
    assert made.status_code == 201, made.content
    assert made.json()["base"] == "smol"
    refused = api.post("/api/deployments/", {"model": "style", "labels": {"pool": "a"}}, format="json")
    assert refused.status_code == 400 and "deploy its base 'smol'" in str(refused.json())


@pytest.mark.django_db
def test_each_node_is_told_the_adapters_of_the_models_it_serves(home, adapter_file):
    registry.model_add(path=MODEL, name="smol")
    adapter = registry.model_add(path=adapter_file, name="style", base="smol")
    serving = NodeFactory(identity="a", models_served=["smol"])
    other = NodeFactory(identity="b", models_served=["smollm2"])
    assert deployments.node_adapters(node_id=serving.pk) == {"smol": [{"name": "style", "sha256": adapter.sha256}]}
    assert deployments.node_adapters(node_id=other.pk) == {}


@pytest.mark.django_db
def test_adding_or_deleting_an_adapter_tells_every_online_node(home, adapter_file, monkeypatch,
                                                               django_capture_on_commit_callbacks):
    told = []
    monkeypatch.setattr(deployments, "tell_nodes", told.append)
    node = NodeFactory(identity="a", state="online", models_served=["smol"])
    registry.model_add(path=MODEL, name="smol")
    with django_capture_on_commit_callbacks(execute=True):
        adapter = registry.model_add(path=adapter_file, name="style", base="smol")
    with django_capture_on_commit_callbacks(execute=True):
        registry.model_delete(model=adapter)
    assert told == [[str(node.pk)], [str(node.pk)]]


# --- the node -----------------------------------------------------------------------------------------------------


class AdapterWorker(FakeWorker):
    """A fake engine worker that keeps LoRA adapters as its real counterpart reports them (capabilities lora:NAME)."""

    def __init__(self, name: str, lanes: int = 2) -> None:
        super().__init__(name, lanes)
        self.loaded, self.busy = {}, set()

    def info(self):
        return {**super().info(), "capabilities": {"lora": True, **{f"lora:{n}": True for n in self.loaded}}}

    async def submit(self, spec):
        self.busy.add(spec.model.partition(":")[2])

    async def adapter(self, name, path):
        if path is None and name in self.busy:
            raise StateOpError(ErrorCode.ADAPTER_IN_USE, f"LoRA adapter {name!r} is in use")
        if path:
            self.loaded[name] = path
        else:
            del self.loaded[name]


def _deployer(monkeypatch, primary: AdapterWorker, made: list) -> tuple[Deployer, ModelSet, list]:
    import nodes.agent.deploy as deploy

    monkeypatch.setattr(deploy, "DRAIN_GRACE_S", 0.01)
    monkeypatch.setattr(deploy, "DRAIN_POLL_S", 0.01)
    monkeypatch.setattr(deploy, "deployed_window", lambda path, **kw: 1024)
    sent: list = []
    models = ModelSet(primary)

    async def fetch(name, progress):
        return Path(f"/models/{name}.gguf")

    def make_worker(config):
        made.append(AdapterWorker(config.model_name, config.lanes))
        return made[-1]

    return Deployer(models, fetch=fetch, send=sent.append, make_worker=make_worker), models, sent


def announced(sent: list) -> list[tuple[list[str], list[str]]]:
    return [([r["name"] for r in m.models], sorted(k for k in m.capabilities if k.startswith("lora:")))
            for m in sent if isinstance(m, Models)]


def test_the_node_loads_an_adapter_on_every_engine_serving_its_base_and_announces_it(monkeypatch):
    async def scenario():
        primary, made = AdapterWorker("smol"), []
        deployer, models, sent = _deployer(monkeypatch, primary, made)
        adapters = {"smol": [{"name": "style", "sha256": "a" * 64}], "big": [{"name": "terse", "sha256": "b" * 64}]}
        deployer.apply(Deploy(models=[{"name": "big", "lanes": 2}], adapters=adapters))
        await deployer.tasks["big"]
        await asyncio.gather(*deployer.adapters.values())
        await models.submit(GenerateSpec(gen_id="g1", model="big:terse", prompt="hi"))
        return primary, made, models, sent

    primary, made, models, sent = asyncio.run(scenario())
    assert primary.loaded == {"style": "/models/style.gguf"} and made[0].loaded == {"terse": "/models/terse.gguf"}
    assert made[0].busy == {"terse"} and not primary.busy  # BASE:ADAPTER runs on BASE's engine
    assert announced(sent)[-1] == (["smol", "smol:style", "big", "big:terse"], ["lora:style", "lora:terse"])
    assert {(m.model, m.state) for m in sent if isinstance(m, ModelState)} >= {("style", "serving"),
                                                                                ("terse", "serving")}


def test_an_adapter_no_longer_listed_is_unannounced_then_unloaded_once_no_generation_uses_it(monkeypatch):
    async def scenario():
        primary = AdapterWorker("smol")
        deployer, models, sent = _deployer(monkeypatch, primary, [])
        deployer.apply(Deploy(models=[], adapters={"smol": [{"name": "style", "sha256": "a" * 64}]}))
        await asyncio.gather(*deployer.adapters.values())
        await models.submit(GenerateSpec(gen_id="g1", model="smol:style", prompt="hi"))
        deployer.apply(Deploy(models=[], adapters={}))
        await asyncio.sleep(0.1)
        still = dict(primary.loaded)  # g1 still runs with it
        primary.busy.clear()
        await asyncio.sleep(0.1)
        return primary, still, sent

    primary, still, sent = asyncio.run(scenario())
    assert still == {"style": "/models/style.gguf"} and primary.loaded == {}
    assert announced(sent)[-2:] == [(["smol"], []), (["smol"], [])]  # unannounced before it was unloaded
    states = [m.state for m in sent if isinstance(m, ModelState)]
    assert states[-2:] == ["draining", "unloaded"]


@pytest.mark.django_db
def test_a_deployment_shows_its_adapters_pairs_and_a_rejoining_node_keeps_them(home, adapter_file):
    from nodes.models import Deployment, NodeModel

    base = registry.model_add(path=MODEL, name="smol")
    registry.model_add(path=adapter_file, name="style", base="smol")
    node = NodeFactory(identity="a", models_served=["smol"])
    deployment = Deployment.objects.create(model=base, nodes=["a"])
    for name in ("smol", "style"):
        deployments.node_model_record(node_id=node.pk, model=name, state="serving")
    assert [(p.model, p.state) for p in deployments.deployment_states(deployment=deployment)] == [
        ("smol", "serving"), ("style", "serving")]
    deployments.node_models_forget(node_id=node.pk, keep=["smol", "smol:style"])  # it rejoined serving both
    assert NodeModel.objects.count() == 2


@pytest.mark.django_db
def test_the_admin_shows_an_adapter_with_its_base_and_each_nodes_state_for_it(home, adapter_file, client):
    registry.model_add(path=MODEL, name="smol")
    adapter = registry.model_add(path=adapter_file, name="style", base="smol")
    node = NodeFactory(identity="gpu-1", models_served=["smol"])
    deployments.node_model_record(node_id=node.pk, model="style", state="failed", detail="no room")
    client.force_login(UserFactory(username="operator"))
    page = client.get(f"/admin/nodes/model/{adapter.pk}/change/").content.decode()
    assert "gpu-1: failed: no room" in page and ">smol<" in page


# --- image projectors ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def projector_file(tmp_path_factory) -> Path:
    from tests.vision_projector import build_projector

    return build_projector(tmp_path_factory.mktemp("projector") / "mmproj.gguf")


@pytest.mark.django_db
def test_a_projector_is_the_registry_entry_of_its_model_and_deployments_of_the_model_load_it(home, projector_file,
                                                                                             adapter_file):
    from nodes.models import Deployment

    base = registry.model_add(path=MODEL, name="smol")
    with pytest.raises(registry.RegistryError, match="the file is an image projector .mmproj.: name the registry"):
        registry.model_add(path=projector_file, name="eyes")
    projector = registry.model_add(path=projector_file, name="eyes", base="smol")
    registry.model_add(path=adapter_file, name="style", base="smol")
    assert (projector.kind, projector.architecture, projector.is_attachment) == ("projector", "clip", True)
    with pytest.raises(registry.RegistryError, match="'smol' has a projector already"):
        registry.model_add(path=projector_file, name="eyes-2", base="smol")
    node = NodeFactory(identity="a", models_served=["smol"], labels={"pool": "a"})
    Deployment.objects.create(model=base, nodes=["a"])
    assert deployments.node_deployments(node_id=node.pk)[0]["mmproj"] == {"name": "eyes", "sha256": projector.sha256}
    assert list(deployments.node_adapters(node_id=node.pk)["smol"][0]) == ["name", "sha256"]
    assert [a["name"] for a in deployments.node_adapters(node_id=node.pk)["smol"]] == ["style"]  # not the projector
    with pytest.raises(deployments.DeploymentError, match="'eyes' is a multimodal projector: deploy its base"):
        deployments.deployment_create(model=projector, nodes=["a"], labels={})


def test_the_node_loads_a_deployed_model_with_its_registry_projector(monkeypatch):
    async def scenario():
        made: list = []
        configs: list = []
        deployer, _, _ = _deployer(monkeypatch, AdapterWorker("own"), made)
        original = deployer.make_worker
        deployer.make_worker = lambda config: (configs.append(config), original(config))[1]
        deployer.apply(Deploy(models=[{"name": "smol", "lanes": 2, "mmproj": {"name": "eyes", "sha256": "c" * 64}}]))
        await deployer.tasks["smol"]
        return configs

    configs = asyncio.run(scenario())
    assert configs[0].mmproj_path == "/models/eyes.gguf" and configs[0].model_path == "/models/smol.gguf"


def test_an_adapter_of_a_model_the_head_renamed_keeps_the_head_s_name_for_its_base():
    from types import SimpleNamespace

    from nodes.link_deploy import _fleet_name

    node = SimpleNamespace(fleet_names={"smollm2": "smol"})  # the node joined serving smollm2; the head calls it smol
    assert [_fleet_name(node, n) for n in ("smollm2", "smollm2:style", "other")] == ["smol", "smol:style", "other"]
