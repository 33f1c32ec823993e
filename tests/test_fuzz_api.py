"""Fuzzing with schemathesis: /api against drf-spectacular's schema, /v1 against api.openapi_v1's description.

A real head (daphne) and a real node process on the mock engine; every request goes over HTTP through the whole
ASGI app. Checks, on every response: no 5xx, the status and content type are documented, the body conforms to the
schema, data the schema rejects is rejected with a 4xx, and every error body is OpenAI's error object on /v1 and
DRF's shape on /api. The request counts are printed at the end of the run (tests/fuzz_report.py).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import schemathesis
from schemathesis.core.failures import Failure

from tests.fuzz_report import COUNTS, MIN_REQUESTS, STATUSES
from tests.live import make_head
from tests.mock_node import start_mock_node

pytest_plugins = ["tests.fuzz_report"]

pytestmark = pytest.mark.slow

# Examples per operation and phase; FLEET_FUZZ_EXAMPLES raises it for a longer hunt.
EXAMPLES = int(os.environ.get("FLEET_FUZZ_EXAMPLES", "25"))
WINDOW = 256  # the mock node's context window: max_tokens beyond it is a 400
MODEL = "smollm2"


@pytest.fixture(scope="module")
def fuzz_head(tmp_path_factory):
    """A head whose quotas do not get in the fuzzer's way, a mock node, and a non-staff user's key."""
    head = make_head(tmp_path_factory.mktemp("fuzz"), extra_env={
        "FLEET_THROTTLE_RATE": "1000000/min", "FLEET_QUOTA_REQUESTS_PER_MINUTE": "0",
        "FLEET_QUOTA_TOKENS_PER_MINUTE": "0", "FLEET_QUOTA_TOKENS_PER_DAY": "0",
    })
    out = head.manage("shell", "-c", "from django.contrib.auth import get_user_model\n"
                      "from api.services import api_key_create\n"
                      "user = get_user_model().objects.create_user('developer')\n"
                      "print(api_key_create(owner=user, name='fuzz')[1])").stdout
    head.developer_key = out.strip().splitlines()[-1]
    head.start()
    node = start_mock_node(head, model=MODEL, decode_tps=20000, prefill_ms_per_token=0.0, context_window=WINDOW)
    try:
        head.wait_nodes(1, timeout=60)
        yield head
    finally:
        node.stop()
        head.stop()


def _config(*, reject_negative: bool, mode: str, stateful: bool = False) -> schemathesis.Config:
    return schemathesis.Config.from_dict({
        "request-timeout": 30,
        "continue-on-failure": True,
        # The key goes in every request's headers; generated Authorization headers and cookies would only test 401s.
        "generation": {"mode": mode, "max-examples": EXAMPLES, "database": "none", "no-shrink": True,
                       "with-security-parameters": False},
        # The stateful phase runs only where it is asked for (its links are inferred from the schema when enabled).
        "phases": {"stateful": {"enabled": stateful}},
        # Valid-looking data may still be refused (an unknown model is a 404, a session id must exist), so only the
        # other direction is checked: data the schema rejects must be rejected. Not on /api: DRF coerces scalars by
        # design (`"name": 0` is the name "0", `"1"` is the number 1).
        "checks": {"positive_data_acceptance": {"enabled": False},
                   "negative_data_rejection": {"enabled": reject_negative}},
    })


def _schema(document: dict, *, reject_negative: bool, mode: str = "all", stateful: bool = False):
    # The documents are built in-process, from the code the live head runs, so the tests exist at collection.
    document = json.loads(json.dumps(document, default=str))
    return schemathesis.openapi.from_dict(document, config=_config(reject_negative=reject_negative, mode=mode,
                                                                                stateful=stateful))


def _api_document() -> dict:
    from drf_spectacular.generators import SchemaGenerator
    from drf_spectacular.renderers import OpenApiJsonRenderer

    return json.loads(OpenApiJsonRenderer().render(SchemaGenerator().get_schema(request=None, public=True)))


def _v1_document() -> dict:
    from api.openapi_v1 import v1_schema

    return v1_schema()


def _servable(document: dict) -> dict:
    """The /v1 description narrowed to what this fleet serves, so that valid requests reach the node: its one model,
    max_tokens within its window, and none of the parameters that name objects the fuzzer never made (a session,
    handles) or need another one set (top_logprobs, tool_choice). Otherwise nearly every generated request is a
    400 or 404, and the generation path is never fuzzed."""
    document = copy.deepcopy(document)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages",
                 "/v1/messages/count_tokens"):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        body["properties"]["model"] = {"type": "string", "enum": [MODEL]}
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if name in body["properties"]:
                body["properties"][name]["maximum"] = WINDOW
        for name in ("session", "logit_bias_handle", "grammar", "top_logprobs", "tool_choice",
                     "previous_response_id"):
            body["properties"].pop(name, None)
    document["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["schema"] = {"type": "string", "enum": [MODEL]}
    return document


@pytest.fixture(scope="module")
def http():
    with requests.Session() as session:
        yield session


# The two checks below are passed to each call, not registered: a registered check runs on every schema.
def error_shape(ctx, response, case):
    """Every 4xx/5xx body is OpenAI's error object on /v1 and DRF's shape on /api."""
    if response.status_code < 400 or _twisted_multipart_refusal(response, case):
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise Failure(operation=case.operation.label, title="An error body is not JSON",
                      message=f"{response.status_code}: {response.content[:200].decode(errors='replace')!r}") from None
    if case.path.startswith("/v1/messages"):
        problem = anthropic_problem(body)
    else:
        problem = openai_problem(body) if case.path.startswith("/v1") else drf_problem(body)
    if problem:
        raise Failure(operation=case.operation.label, title="An error body has the wrong shape",
                      message=f"{problem}: {body!r}"[:500])
    return True


def node_stays(ctx, response, case):
    """The served model stays served: no request may cost the fleet its node (a 404 model_not_found here means the
    head dropped the node's link while serving the request)."""
    if response.status_code == 404 and b"model_not_found" in response.content:
        raise Failure(operation=case.operation.label, title="The node serving the model was lost",
                      message=response.content[:300].decode(errors="replace"))
    return True


def _twisted_multipart_refusal(response, case) -> bool:
    """A multipart body Twisted cannot parse is refused by daphne's HTTP server itself (an empty 400 before the
    request reaches the app: twisted.web.http.Request.requestReceived parses form bodies for its own `args`)."""
    sent = response.request.headers.get("Content-Type", "")
    return response.status_code == 400 and not response.content and sent.startswith("multipart/form-data")


def openai_problem(body) -> str | None:
    error = body.get("error") if isinstance(body, dict) else None
    if set(body) != {"error"} or not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return "not {error: {message, type, param, code}}"
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return "no message or type"
    return None


def anthropic_problem(body) -> str | None:
    """Anthropic's error object, on its Messages API's paths."""
    error = body.get("error") if isinstance(body, dict) else None
    if set(body) != {"type", "error"} or body["type"] != "error" or not isinstance(error, dict) or \
            set(error) != {"type", "message"} or not error["message"] or not isinstance(error["type"], str):
        return "not {type: error, error: {type, message}}"
    return None


def drf_problem(body) -> str | None:
    if isinstance(body, dict) and set(body) >= {"detail"}:
        return None if isinstance(body["detail"], str) and body["detail"] else "detail is not a message"
    return None if _messages(body) else "neither {detail} nor field errors"


def _messages(value) -> bool:
    """DRF's validation errors: lists of messages, by field, nested as the serializer is."""
    if isinstance(value, str):
        return bool(value)
    if isinstance(value, list):
        return bool(value) and all(_messages(v) for v in value if v != {})
    if isinstance(value, dict):
        return bool(value) and all(isinstance(k, str) and _messages(v) for k, v in value.items())
    return False


def _call(case, head, http, label: str, *checks):
    COUNTS[label] += 1
    auth = {"Authorization": f"Bearer {head.developer_key}"}
    response = case.call(base_url=head.url, session=http, headers=auth)
    STATUSES[label, response.status_code] += 1
    case.validate_response(response, additional_checks=[error_shape, *checks], headers=auth,
                           transport_kwargs={"base_url": head.url, "session": http, "headers": auth})


api = _schema(_api_document(), reject_negative=False)
v1 = _schema(_v1_document(), reject_negative=True)
served = _schema(_servable(_v1_document()), reject_negative=False, mode="positive")


@api.parametrize()
def test_the_management_api_holds_to_its_schema(case, fuzz_head, http):
    _call(case, fuzz_head, http, "/api")


@v1.parametrize()
def test_the_openai_api_holds_to_its_description(case, fuzz_head, http):
    _call(case, fuzz_head, http, "/v1")


@served.parametrize()
def test_generations_the_fleet_can_serve_hold_to_the_description(case, fuzz_head, http):
    _call(case, fuzz_head, http, "/v1 (served)", node_stays)


def test_the_fuzzers_sent_enough_requests(request):
    ran = {item.originalname for item in request.session.items}
    if not {"test_the_management_api_holds_to_its_schema", "test_the_openai_api_holds_to_its_description",
            "test_generations_the_fleet_can_serve_hold_to_the_description"} <= ran:
        pytest.skip("counts only when both fuzzers run")
    assert sum(COUNTS.values()) >= MIN_REQUESTS, dict(COUNTS)


@pytest.mark.parametrize("who", ["developer", "staff"])
def test_the_management_api_holds_to_its_schema_across_calls(fuzz_head, who, tmp_path):
    """Schemathesis' stateful phase over /api, by its own command line against the head's served schema: sequences
    that create an object and then read, change or delete it (links inferred from the schema's responses and path
    parameters), with the conformance checks on every response and the stateful ones (a deleted object is gone, a
    created one can be read). Its engine, not a Hypothesis state machine run here: a live head's state differs
    between a sequence and its replay, which only the engine allows for."""
    key = fuzz_head.developer_key if who == "developer" else fuzz_head.api_key  # `admin`'s: a superuser's
    run = subprocess.run(
        [str(Path(sys.executable).with_name("schemathesis")), "run", f"{fuzz_head.url}/api/schema/",
         "--phases", "stateful", "-H", f"Authorization: Bearer {key}", "--max-examples", str(4 * EXAMPLES),
         "--exclude-checks", "positive_data_acceptance,negative_data_rejection", "--generation-database", "none",
         "--no-color", "--request-timeout", "30", "--continue-on-failure"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "SCHEMATHESIS_HOOKS": ""},
        cwd=tmp_path)  # its request cache (.schemathesis/) there: no replay of another run's requests
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    generated = re.search(r"(\d+) generated", run.stdout)
    assert generated and int(generated[1]) >= 4 * EXAMPLES, run.stdout[-3000:]  # the phase ran, and chained
