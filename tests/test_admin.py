"""Every admin changelist and the fleet page render for staff, with their query counts pinned.

The counts are baselines (as NetBox pins them): a change that adds a query per row fails here, because the
fixtures below create several rows of each kind.
"""

import pytest
from django.contrib.contenttypes.models import ContentType
from django.urls import reverse

from api.services import api_key_create
from nodes.models import ModelAlias, Node
from nodes.services import fleet_token_create
from sessions.services import stored_response_create
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
    "admin:inference_sessions_storedresponse_changelist": 6,
    "admin:nodes_modelalias_changelist": 5,
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
        key, _ = api_key_create(owner=user, name=f"r-{node.identity}")
        stored_response_create(response_id=f"resp_{node.identity}", model="smollm2", api_key=key, messages=[],
                               input_items=[], body={})
        ModelAlias.objects.create(name=f"alias-{node.identity}", target="smollm2")
    return client


@pytest.mark.parametrize(("name", "queries"), CHANGELISTS.items())
def test_changelist_renders_with_pinned_queries(staff_client, django_assert_num_queries, name, queries):
    with django_assert_num_queries(queries):
        response = staff_client.get(reverse(name))
    assert response.status_code == 200


def test_fleet_page_renders_nodes_and_models(staff_client, django_assert_num_queries):
    from nodes.models import NodeModel

    NodeFactory(identity="gpu-down", state=Node.State.OFFLINE)
    pulling = NodeFactory(identity="gpu-new")
    NodeModel.objects.create(node=pulling, model="qwen-big", state=NodeModel.State.PULLING, progress=0.425)
    NodeModel.objects.create(node=pulling, model="qwen-small", state=NodeModel.State.LOADING)
    NodeModel.objects.create(node=pulling, model="smollm2", state=NodeModel.State.SERVING)
    with django_assert_num_queries(6):
        response = staff_client.get(reverse("fleet-overview"))
    body = response.content.decode()
    assert response.status_code == 200
    assert "gpu-down" in body and "offline" in body and "smollm2" in body
    assert ('<span class="fleet-preparing">qwen-big: pulling <progress max="100" value="42"></progress> 42%</span>'
            '<span class="fleet-preparing">qwen-small: loading </span>') in body  # not the pair it serves


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


def _placed(node: Node, at: float, *, others: list[tuple[str, int, int]], after=None) -> dict:
    rows = [{"node": node.identity, "node_id": str(node.pk), "cost": 40, "reread_tokens": 40, "load_tokens": 0,
             "matched_tokens": 200, "running": 0}]
    rows += [{"node": name, "node_id": name, "cost": reread + load, "reread_tokens": reread, "load_tokens": load,
              "matched_tokens": 240 - reread, "running": load // 3000} for name, reread, load in others]
    evidence = {"node": node.identity, "node_id": str(node.pk), "cost": 40, "matched_tokens": 200,
                "prompt_tokens_estimate": 240, "runner_up": None, "candidates": len(rows), "ranking": rows,
                "placed_at": at}
    return {**evidence, "after": after} if after else evidence


def test_a_generations_page_shows_its_timeline_and_every_candidates_cost(staff_client, django_assert_num_queries):
    from datetime import UTC, datetime

    first, second = NodeFactory(identity="gpu-lost"), NodeFactory(identity="gpu-took-over")
    t0 = 1_800_000_000.0
    placement = _placed(first, t0 + 0.002, others=[("gpu-busy", 240, 3000)])
    lost = {"code": "node_lost", "message": "node 'gpu-lost' was lost", "at": t0 + 0.8}
    placement["failover"] = [_placed(second, t0 + 0.9, others=[], after=lost)]
    generation = GenerationFactory(node=second, nodes_used=["gpu-lost", "gpu-took-over"], placement=placement,
                                   created_at=datetime.fromtimestamp(t0, UTC), ttft_ms=120.0,
                                   finished_at=datetime.fromtimestamp(t0 + 1.5, UTC))
    ContentType.objects.clear_cache()  # the content type's query counted whatever tests ran before in this process
    with django_assert_num_queries(6):  # session, user, the generation (the admin's and the page's), content type, node
        response = staff_client.get(reverse("admin:inference_sessions_generation_change", args=[generation.pk]))
    body = response.content.decode()
    timeline = body[body.index('id="generation-timeline"'):body.index('id="placement-1"')]
    steps = ["queued", "placed", "first token", "failed over", "node_lost: node &#x27;gpu-lost&#x27; was lost",
             "placed", "on gpu-took-over", "done"]
    positions = [timeline.index(step, timeline.index(steps[i - 1]) if i else 0) for i, step in enumerate(steps)]
    assert positions == sorted(positions)
    evidence = body[body.index('id="placement-1"'):body.index('id="placement-2"')]
    assert '<tr class="chosen" style="font-weight: bold"><td>gpu-lost</td><td>40</td><td>40</td><td>0</td>' in evidence
    assert "<td>gpu-busy</td><td>3240</td><td>240</td><td>3000</td>" in evidence
    assert "Placement 2, after node_lost: gpu-took-over" in body


def test_a_nodes_page_shows_its_models_replicas_generations_and_link_history(staff_client, django_assert_num_queries):
    from nodes.models import LinkEvent
    from nodes.services import link_event_record

    node = NodeFactory(identity="gpu-page", replicas=[{"index": 0, "alive": True, "running": 0, "routed": 3},
                                                      {"index": 1, "alive": False, "running": 0, "routed": 1}])
    generation = GenerationFactory(node=node)
    link_event_record(kind=LinkEvent.Kind.JOINED, node_id=node.pk, identity="gpu-page", peer="10.0.0.9")
    link_event_record(kind=LinkEvent.Kind.DROPPED, node_id=node.pk, identity="gpu-page", code=1006)
    with django_assert_num_queries(7):
        response = staff_client.get(reverse("admin:nodes_node_change", args=[node.pk]))
    body = response.content.decode()
    replicas = body[body.index('id="node-replicas"'):body.index('id="node-generations"')]
    assert "<td>0</td><td>alive</td>" in replicas and "<td>1</td><td>down</td>" in replicas
    history = body[body.index('id="node-link-history"'):]
    assert history.index("dropped") < history.index("joined") and "<td>1006</td>" in history
    assert reverse("admin:inference_sessions_generation_change", args=[generation.pk]) in body


def test_a_nodes_page_shows_what_its_engine_measured_and_the_load_cost_learned_from_it(staff_client):
    from django.core.cache import cache

    from fleet.links import registry
    from fleet.names import liveness_key
    from nodes.link.placement import NodeSlot

    node = NodeFactory(identity="paced")
    cache.set(liveness_key(str(node.pk)), {"lanes_busy": 1, "lanes": 4, "kv_used": 10, "kv_total": 2048,
                                           "tokens_per_s": 12.5, "prefill_tps": 2000.0, "decode_slowdown_ms": 1.5})
    registry().placement.node_up(NodeSlot(str(node.pk), "paced", ["smollm2"], 4, prefill_tps=2000.0,
                                          decode_slowdown_ms=1.5, answer_tokens=100.0))

    body = staff_client.get(reverse("admin:nodes_node_change", args=[node.pk])).content.decode()

    assert "reads prompts at 2,000 tokens/s" in body and "adds 1.50 ms to a decode step" in body
    assert "load cost per running generation: 150 prompt tokens (learned)" in body  # 2000 x 1.5 ms x 100 / 2



def test_a_nodes_page_shows_which_head_processes_hold_its_links(staff_client, settings):
    from fleet import heads
    from fleet.links import registry
    from nodes.link.placement import NodeSlot

    settings.FLEET_LINK_URL = "ws://10.0.0.1:8001/ws/node/"
    node = NodeFactory(identity="linked")
    page = reverse("admin:nodes_node_change", args=[node.pk])
    assert "none (offline)" in staff_client.get(page).content.decode()
    registry().placement.node_up(NodeSlot(str(node.pk), "linked", ["smollm2"], 4), head=heads.PROCESS_ID)
    body = staff_client.get(page).content.decode()
    assert "ws://10.0.0.1:8001/ws/node/ since " in body
    registry().placement.node_down(str(node.pk), heads.PROCESS_ID)


def _add_form_data(response) -> dict | None:
    """What the add page's form (and its inlines' management forms) would post as rendered, untouched."""
    data = {}
    if "adminform" not in response.context:  # a page of its own (the registry's upload): posts nothing as rendered
        return None
    forms = [response.context["adminform"].form]
    for inline in response.context.get("inline_admin_formsets") or []:
        forms.append(inline.formset.management_form)
        forms += list(inline.formset.forms)
    for form in forms:
        for bound in form:
            value = bound.value()
            if value is not None and not bound.field.disabled:
                data[bound.html_name] = value
    return data


def test_every_add_the_admin_offers_saves_or_says_why_and_none_answers_5xx(staff_client):
    """A model the admin cannot create (a batch, an uploaded file, a node) is offered no Add; every Add offered,
    posted as it renders, saves or shows the form's errors: never a 500."""
    from django.contrib import admin
    from django.test import RequestFactory

    request = RequestFactory().get("/admin/")
    request.user = UserFactory(username="walker")
    staff_client.raise_request_exception = False
    for model, model_admin in admin.site._registry.items():
        meta = model._meta
        listed = staff_client.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist"))
        assert listed.status_code == 200, meta.label
        add_url = reverse(f"admin:{meta.app_label}_{meta.model_name}_add")
        if not model_admin.has_add_permission(request):
            assert add_url not in listed.content.decode(), f"{meta.label}: an Add button it cannot save"
            continue
        page = staff_client.get(add_url)
        assert page.status_code == 200, meta.label
        data = _add_form_data(page)
        saved = staff_client.post(add_url, data or {})
        assert saved.status_code in (200, 302), f"{meta.label}: {saved.status_code}"


def test_a_batch_page_offers_its_files_for_download_to_staff_only(staff_client, client):
    from datetime import timedelta

    from django.utils import timezone

    from api.batches import file_create, file_ref
    from api.models import Batch

    owner = UserFactory(username="batcher", is_staff=False, is_superuser=False)
    source = file_create(owner=owner, filename="in.jsonl", purpose="batch", content=b'{"custom_id": "a"}\n')
    answers = file_create(owner=owner, filename="out.jsonl", purpose="batch", content=b'{"id": "answer"}\n')
    batch = Batch.objects.create(owner=owner, endpoint="/v1/chat/completions", input_file=source,
                                 input_file_ref=file_ref(source), output_file=answers, completion_window="24h",
                                 expires_at=timezone.now() + timedelta(days=1))
    page = staff_client.get(reverse("admin:api_batch_change", args=[batch.pk])).content.decode()
    url = reverse("admin:api_batchfile_download", args=[answers.pk])
    assert url in page
    got = staff_client.get(url)
    assert got.status_code == 200 and b"".join(got) == b'{"id": "answer"}\n'
    assert file_ref(answers) in got["Content-Disposition"]
    client.force_login(owner)  # not staff: the admin's login page
    assert client.get(url).status_code == 302


def test_a_batch_page_links_to_the_generations_its_lines_made(staff_client):
    from datetime import timedelta

    from django.utils import timezone

    from api.batches import batch_ref
    from api.models import Batch, BatchLine

    batch = Batch.objects.create(owner=UserFactory(username="batcher"), endpoint="/v1/chat/completions",
                                 completion_window="24h", expires_at=timezone.now() + timedelta(days=1))
    made = [GenerationFactory(), GenerationFactory()]
    other = GenerationFactory()  # not the batch's: an interactive request's record
    for index, request_id in enumerate([made[0].pk.hex, made[1].pk.hex, ""]):  # the last refused before a node
        BatchLine.objects.create(batch=batch, index=index, custom_id=f"line-{index}", request_id=request_id)
    page = staff_client.get(reverse("admin:api_batch_change", args=[batch.pk])).content.decode()
    changelist = reverse("admin:inference_sessions_generation_changelist")
    link = f'<a id="batch-generations" href="{changelist}?batch={batch_ref(batch)}">2 generations</a>'
    assert link in page, page
    listed = staff_client.get(f"{changelist}?batch={batch_ref(batch)}").content.decode()
    assert all(str(g.pk) in listed for g in made) and str(other.pk) not in listed
    assert "2 results" in listed and batch_ref(batch) in listed  # the filter shows while it filters
    for wrong in ("batch_" + "0" * 32, "not-a-batch"):
        response = staff_client.get(f"{changelist}?batch={wrong}")
        assert response.status_code == 200 and "0 results" in response.content.decode(), wrong


def test_an_empty_list_says_what_to_do_next(client):
    from django.contrib import admin

    client.force_login(UserFactory(username="first-day"))
    hinted = [(model, model_admin.empty_hint) for model, model_admin in admin.site._registry.items()
              if getattr(model_admin, "empty_hint", "")]
    assert len(hinted) >= 9
    for model, hint in hinted:
        meta = model._meta
        page = client.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist")).content.decode()
        assert "fleet-empty-hint" in page and hint.split(".")[0] in page, meta.label


def test_a_generations_figures_have_units_and_its_parameters_are_a_table(staff_client):
    generation = GenerationFactory(ttft_ms=123.4, duration_ms=2500.0, decode_tps=41.26,
                                   parameters={"temperature": 0.2, "max_tokens": 64},
                                   placement={"node": "gpu-a", "cost": 40})
    listed = staff_client.get(reverse("admin:inference_sessions_generation_changelist")).content.decode()
    assert "123 ms" in listed and "41.3 tokens/s" in listed
    page = staff_client.get(reverse("admin:inference_sessions_generation_change", args=[generation.pk]))
    body = page.content.decode()
    assert "2.50 s" in body and "<tr><th>temperature</th><td>0.2</td></tr>" in body
    assert '{"temperature": 0.2' not in body and "&quot;temperature&quot;" not in body  # no JSON blob


def test_the_registry_list_names_the_models_nodes_serve_from_their_own_files(staff_client):
    NodeFactory(identity="bundled", models_served=["smollm2", "whisper-tiny.en", "smollm2:style"])
    page = staff_client.get(reverse("admin:nodes_model_changelist")).content.decode()
    assert "Also served now by nodes from their own files" in page and "smollm2, whisper-tiny.en." in page
