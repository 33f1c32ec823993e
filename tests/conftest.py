"""Shared fixtures, and the suite's tiers. `live_head` and `live_node` are real processes: daphne and `manage.py
node_join`.

Every test file has one tier, named here (or by a tier marker in the file's own `pytestmark`); `make test TIERS=...`
selects by them (docs/testing.md):
  django_free  the node agent, engines, link, Noise: no Django settings, database or head
  in_process   a head in this process: Django's test client, Channels' communicators, the ORM
  real_procs   real processes: daphne heads, `node_join`, Celery workers (and a `slow` test of an in_process file)
  browser      a real head driven by headless Chromium
Each test whose outcome can depend on the database, cache, channel layer, placement state, quotas or broker is also
marked `backend` (every in_process, real_procs and browser test but those of BACKEND_FREE): CI runs those a second
time on PostgreSQL + Redis (`make test TIERS=backend`). A file named nowhere here runs in every pass, with a warning.
"""

from __future__ import annotations

import os

import pytest

from tests.live import Head, NodeProc, make_head, start_node

pytest_plugins = ["pytester"]  # tests/test_tiers.py runs a pytest of its own

TIERS: dict[str, set[str]] = {
    "django_free": {
        "test_dialer.py", "test_engine_llama.py", "test_engine_grammar_beside.py", "test_engine_kv_transfer.py",
        "test_engine_lora.py", "test_engine_mock.py", "test_engine_pace.py", "test_engine_speech.py",
        "test_engine_vision.py", "test_engine_worker.py", "test_link_channel.py",
        "test_link_noise.py", "test_media_cache.py", "test_replicas.py", "test_thinking.py", "test_timers.py",
        "test_window.py",
        "test_on_demand_node.py", "test_shutdown.py", "test_makefile_gpu.py", "test_gpu.py",
    },
    "in_process": {
        "test_adapters.py", "test_admin.py", "test_api_access.py", "test_api_fuzz_regressions.py",
        "test_api_keys.py", "test_api_limits.py", "test_api_management.py", "test_api_tools.py",
        "test_api_v1_errors.py", "test_api_v1_generations.py", "test_api_websocket.py", "test_batch_priority.py",
        "test_celery_tasks.py", "test_channel_layer.py", "test_chat_images.py", "test_commands.py",
        "test_dbsweep.py", "test_deployments.py", "test_deployments_link.py", "test_fleet_live.py", "test_heap.py",
        "test_json_out.py", "test_link_fuzz.py", "test_logs.py", "test_maintenance.py", "test_metrics.py",
        "test_metrics_events.py", "test_model_registry.py", "test_node_consumer.py", "test_node_figures.py",
        "test_nodes_services.py", "test_placement.py", "test_placement_redis.py", "test_playground.py",
        "test_quotas.py", "test_record_inline.py", "test_request_path.py", "test_sessions_services.py",
        "test_settings.py", "test_tiers.py", "test_tokenizers.py",
        "test_transcriptions.py", "test_writer.py", "test_api_agents.py", "test_hardening.py", "test_head_pin.py",
        "test_grammar_bound.py",
        "test_tracing.py", "test_up_command.py", "test_waiting_room.py", "test_on_demand.py", "test_node_device.py",
        "test_cuts.py", "test_running.py", "test_admin_pages.py",
    },
    "real_procs": {
        "test_adapters_e2e.py", "test_api_e2e.py", "test_batches_e2e.py", "test_celery_worker.py",
        "test_deployments_e2e.py", "test_discovery.py", "test_failover_e2e.py", "test_fuzz_api.py",
        "test_lora_e2e.py", "test_metrics_e2e.py", "test_model_pull_e2e.py", "test_model_upload_e2e.py",
        "test_multihead_e2e.py", "test_node_link_e2e.py", "test_node_trust_e2e.py", "test_replicas_e2e.py",
        "test_soak.py", "test_tokenizers_e2e.py", "test_transcriptions_e2e.py", "test_up_e2e.py",
        "test_vision_e2e.py", "test_agents_e2e.py", "test_hardening_e2e.py", "test_tracing_e2e.py",
        "test_waiting_room_e2e.py", "test_on_demand_e2e.py", "test_redis_calls_e2e.py",
        "test_shutdown_e2e.py", "test_agents_cli_e2e.py", "test_production_e2e.py", "test_gpu_vulkan.py",
        "test_database_outage_e2e.py",
    },
    "browser": {"test_model_admin_browser.py", "test_pages_browser.py"},
}
TIER_NAMES = tuple(TIERS)
# Django runs in these, but on nothing a backend changes: settings read in a subprocess, a consumer's frames with the
# database sweep patched out, JSON bytes, the heap; `manage.py up`, which always starts on the embedded default;
# mDNS (what a node finds on the network; and CI's passes run side by side, so one pass's announcements would reach
# the other's "nothing announced" test).
BACKEND_FREE = {"test_dbsweep.py", "test_heap.py", "test_json_out.py", "test_record_inline.py", "test_settings.py",
                "test_up_e2e.py", "test_discovery.py",
                "test_agents_cli_e2e.py", "test_gpu_vulkan.py"}


def file_tier(name: str) -> str | None:
    return next((tier for tier, files in TIERS.items() if name in files), None)


def pytest_collection_modifyitems(config, items):
    untiered: set[str] = set()
    for item in items:
        own = [tier for tier in TIER_NAMES if item.get_closest_marker(tier)]
        tier = own[0] if own else file_tier(item.path.name)
        if tier is None:
            untiered.add(item.path.name)
            tier = "real_procs"
        elif tier == "in_process" and item.get_closest_marker("slow"):
            tier = "real_procs"
        if not own:
            item.add_marker(tier)
        if tier != "django_free" and item.path.name not in BACKEND_FREE:
            item.add_marker("backend")
    config.stash[_UNTIERED] = sorted(untiered)


_UNTIERED = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for name in config.stash.get(_UNTIERED, []):
        terminalreporter.write_line(
            f"tests/{name} has no tier: it ran as real_procs + backend (in every pass). Name it in TIERS in "
            f"tests/conftest.py, or give it `pytestmark = pytest.mark.<tier>` (one of {', '.join(TIER_NAMES)}).",
            red=True, bold=True)


@pytest.fixture(scope="session")
def live_head(tmp_path_factory) -> Head:
    """One real head for the session (daphne on a free port, its own FLEET_HOME and database)."""
    head = make_head(tmp_path_factory.mktemp("live"))
    head.start()
    yield head
    head.stop()


@pytest.fixture
def fresh_head(tmp_path) -> Head:
    """A real head of this test's own (daphne on a free port), stopped after it."""
    head = make_head(tmp_path)
    head.start()
    yield head
    head.stop()


@pytest.fixture(scope="session")
def live_node(live_head) -> NodeProc:
    """A real node on the bundled SmolLM2 model, joined to `live_head` over loopback (no token needed)."""
    node = start_node(live_head, "--max-batch", "4", identity="node-a")
    live_head.wait_nodes(1, timeout=180)
    yield node
    node.stop()


@pytest.fixture
def records_inline(settings):
    """Generation records written on the request's own thread and connection (FLEET_RECORD_WRITERS 0), not on a
    writer thread: a test whose requests run on its own thread (Django's test client) sees them inside its
    rolled-back transaction, so it needs no `transaction=True` for them."""
    settings.FLEET_RECORD_WRITERS = 0


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each in-process test starts with an empty link registry and placement state."""
    from django.conf import settings

    if not settings.configured:  # plain (Django-free) runs of the link and engine tests
        yield
        return
    from channels.layers import channel_layers

    from fleet.links import registry, registry_reset

    # In-process tests never share placement keys with a live head, a real fleet or another pytest run on the same
    # Redis (each test's clear() would wipe the other run's nodes).
    settings.FLEET_REDIS_PREFIX = f"fleet-pytest-{os.getpid()}:"
    # Nor a channel layer: each test runs on an event loop of its own, and channels-redis keeps asyncio locks per
    # layer; one left held by a receive an earlier test's loop never finished is "bound to a different event loop".
    channel_layers.backends.clear()
    registry_reset()
    _clear_placement(registry())
    yield
    _clear_placement(registry())
    registry_reset()
    from sessions.writer import writers_close

    writers_close()  # their connections would outlive the test's database (PostgreSQL cannot drop it then)


def _clear_placement(reg) -> None:
    clear = getattr(reg.placement, "clear", None)
    if clear is not None:
        clear()
