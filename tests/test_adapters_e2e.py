"""LoRA adapters from the registry with real processes: a head (daphne) whose registry holds the bundled SmolLM2 as
`smol`, two `manage.py node_join --model smol` nodes (each pulls it), and an adapter built at test time uploaded
through /api/models/ with `base: smol`. Both nodes load it while serving and the official `openai` client gets its
changed answer as model `smol:style`; deleting it unloads it from both, and the base answers as before."""

from __future__ import annotations

import httpx
import openai
import pytest

from nodes.agent.engine.local import bundled_model_path
from tests.live import make_head, start_node, wait_for
from tests.lora_adapter import build_adapter

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    head = make_head(tmp)
    head.manage("model_add", bundled_model_path(), "--name", "smol")
    head.start()
    nodes = [start_node(head, "--max-batch", "2", "--max-context", "512", model="smol", identity=name,
                        offline=False, extra_env={"FLEET_HOME": str(tmp / name)}) for name in ("lora-a", "lora-b")]
    try:
        head.wait_nodes(2, timeout=240)
        yield head, nodes, build_adapter(tmp / "style.gguf")
    finally:
        for node in nodes:
            node.stop()
        head.stop()


def upload_adapter(head, path) -> dict:
    with httpx.Client(base_url=head.url, headers={"Authorization": f"Bearer {head.api_key}"}, timeout=60) as api:
        upload = api.post("/api/models/uploads/").json()["upload"]
        sent = api.put(f"/api/models/uploads/{upload}/", params={"offset": 0}, content=path.read_bytes(),
                       headers={"Content-Type": "application/octet-stream"})
        assert sent.status_code == 200, sent.text
        made = api.post("/api/models/", json={"name": "style", "upload": upload, "base": "smol"})
        assert made.status_code == 201, made.text
        return made.json()


def answer(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=12)
    return reply.choices[0].message.content


def test_an_adapter_added_to_the_registry_is_loaded_and_unloaded_on_every_node_serving_its_base(fleet):
    head, nodes, adapter_path = fleet
    client = openai.OpenAI(base_url=f"{head.url}/v1", api_key=head.api_key, max_retries=0, timeout=120)
    plain = answer(client, "smol")

    adapter = upload_adapter(head, adapter_path)
    for node in nodes:
        wait_for(lambda node=node: "LoRA adapter style loaded on smol" in node.log(), 120,
                 f"a node never loaded the adapter: {node.log()[-3000:]}")
    wait_for(lambda: "smol:style" in {m.id for m in client.models.list()}, 30, "/v1/models never listed smol:style")
    tuned = answer(client, "smol:style")
    by_field = client.chat.completions.create(model="smol", messages=QUESTION, temperature=0, max_tokens=12,
                                              extra_body={"lora": [{"name": "style"}]}).choices[0].message.content
    assert tuned and tuned != plain and by_field == tuned

    with httpx.Client(base_url=head.url, headers={"Authorization": f"Bearer {head.api_key}"}) as api:
        assert api.delete(f"/api/models/{adapter['id']}/").status_code == 204
    for node in nodes:
        wait_for(lambda node=node: "LoRA adapter style unloaded from smol" in node.log(), 60,
                 f"a node never unloaded the adapter: {node.log()[-3000:]}")
    wait_for(lambda: "smol:style" not in {m.id for m in client.models.list()}, 30, "smol:style is still listed")
    with pytest.raises(openai.APIStatusError):
        answer(client, "smol:style")
    assert answer(client, "smol") == plain
