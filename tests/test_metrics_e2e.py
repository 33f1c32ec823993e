"""/metrics on a real head (daphne) with a real SmolLM2 node: it parses as Prometheus' text format, a generation
moves the token counters by exactly the usage its client was told, and the node's heartbeats show as gauges."""

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.live import wait_for

pytestmark = pytest.mark.slow

MODEL = "smollm2"
ON_NODE = {"model": MODEL, "node": "node-a"}
PROMPT = [{"role": "user", "content": "Name one colour of the rainbow."}]


def scrape(head) -> dict[tuple, float]:
    response = httpx.get(f"{head.url}/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {head.env['FLEET_METRICS_TOKEN']}"})
    assert response.status_code == 200, response.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def sample(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_scraping_without_the_token_is_a_clear_401(live_head):
    response = httpx.get(f"{live_head.url}/metrics", timeout=30)
    assert response.status_code == 401 and response.text.startswith("/metrics needs `Authorization: Bearer")


def test_a_generation_moves_the_token_counters_by_exactly_its_usage(live_head, live_node):
    client = openai.OpenAI(base_url=f"{live_head.url}/v1", api_key=live_head.api_key, max_retries=0, timeout=180)
    client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4, temperature=0)  # the node keeps it
    before = scrape(live_head)
    answer = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=6, temperature=0)
    after = scrape(live_head)

    def moved(name: str, **labels) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    usage = answer.usage
    assert usage.prompt_tokens_details.cached_tokens > 0 and usage.completion_tokens > 0
    assert moved("fleet_prompt_tokens_total", **ON_NODE) == usage.prompt_tokens
    assert moved("fleet_cached_tokens_total", **ON_NODE) == usage.prompt_tokens_details.cached_tokens
    assert moved("fleet_completion_tokens_total", **ON_NODE) == usage.completion_tokens
    assert moved("fleet_generations_total", **ON_NODE, status="done", code="") == 1
    assert moved("fleet_time_to_first_token_seconds_count", **ON_NODE) == 1
    assert moved("fleet_placements_total", **ON_NODE, reason="only_candidate") == 1
    assert sample(after, "fleet_node_up", node="node-a") == 1
    assert sample(after, "fleet_lanes", **ON_NODE) == 4  # --max-batch 4
    assert sample(after, "fleet_generations_running", **ON_NODE) == 0


def test_the_nodes_heartbeats_show_as_gauges(live_head, live_node):
    capacity = wait_for(lambda: sample(scrape(live_head), "fleet_node_kv_cache_capacity_tokens", **ON_NODE), 30,
                        "no heartbeat reached /metrics")
    assert capacity % 4 == 0  # four lanes of one window each
    busy_key = ("fleet_lanes_busy", tuple(sorted(ON_NODE.items())))
    # The gauge is the node's last heartbeat: one sent while an earlier test's cancelled generation was winding down
    # still says busy until the next beat (every FLEET_HEARTBEAT_S), so wait for a beat of an idle node.
    samples = wait_for(lambda: (s := scrape(live_head)).get(busy_key) == 0 and s, 30,
                       "no heartbeat said the idle node's lanes were free")
    assert ("fleet_node_decode_tokens_per_second", tuple(sorted(ON_NODE.items()))) in samples
