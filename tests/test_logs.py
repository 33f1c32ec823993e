"""JSON logs (FLEET_LOG_FORMAT=json): one JSON object a line, and every line about a generation carries its gen_id,
on the head (through the generation's context or `extra`) and on the node (Django-free)."""

import io
import json
import logging
import os
import subprocess
import sys
from contextlib import contextmanager

import pytest

import fleet.asgi  # noqa: F401 - sets Django up (and so its logging) once, before the tests add their handlers
from nodes.link import logs
from nodes.link.handshake import LOCAL_TOKEN_ID, format_token, make_secret
from tests.api_support import FakeLink, Script, add_fake_node, request
from tests.live import ROOT, Head, free_port, wait_for
from tests.mock_node import start_mock_node

pytest_plugins = ["tests.api_fixtures"]


@contextmanager
def json_lines(*names: str):
    """The lines these loggers write meanwhile, through the JSON handler the settings use, parsed."""
    out = io.StringIO()
    handler = logs.handler("json")
    handler.setStream(out)
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(handler)
    lines: list[dict] = []
    try:
        yield lines
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        lines.extend(json.loads(line) for line in out.getvalue().splitlines())


@pytest.mark.django_db(transaction=True)
async def test_head_lines_about_a_generation_carry_its_id(bearer):
    add_fake_node(FakeLink("11111111-1111-1111-1111-111111111111", "lost-node",
                           Script(error=("node_lost", "the link dropped"))))
    add_fake_node(FakeLink("22222222-2222-2222-2222-222222222222", "steady-node"))
    with json_lines("fleet", "api") as lines:
        ex = await request("POST", "/v1/chat/completions", key=bearer,
                           body={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]})
    assert ex.status == 200 and ex.headers["x-fleet-node"] == "steady-node"
    gen_id = ex.headers["x-fleet-generation"]
    about = [line for line in lines if gen_id in line["message"]]
    # Neither line passes the id along: the dispatcher's step and the record run in the generation's context.
    failover = next(line for line in about if "placing it again" in line["message"])
    ended = next(line for line in about if line["message"].startswith("api: generation"))
    assert failover["gen_id"] == ended["gen_id"] == gen_id
    assert ended["logger"] == "api" and ended["level"] == "INFO" and "done on steady-node" in ended["message"]
    assert all(line.get("gen_id") == gen_id for line in about)


def test_the_generation_context_reaches_lines_that_do_not_name_it():
    with json_lines("fleet") as lines:
        with logs.generation_context("gen-1"):
            logging.getLogger("fleet").warning("inside")
        logging.getLogger("fleet").warning("outside")
    inside, outside = lines
    assert inside["gen_id"] == "gen-1" and inside["message"] == "inside" and "gen_id" not in outside


def test_node_lines_about_a_generation_carry_its_id(tmp_path):
    from nodes.agent.dialer import AgentConfig, NodeAgent
    from nodes.link.messages import Done, Error

    agent = NodeAgent(AgentConfig(head=None, token=format_token(LOCAL_TOKEN_ID, make_secret()), home=tmp_path), None)
    with json_lines("nodes.agent") as lines:
        agent.on_engine_event(Done(gen_id="g-done", seq=1, finish_reason="stop", timings={},
                                   usage={"prompt_tokens": 9, "cached_tokens": 4, "completion_tokens": 3}))
        agent.on_engine_event(Error(gen_id="g-crash", code="engine_crashed", message="abort"))
    done, crash = lines
    assert done["gen_id"] == "g-done" and "9 prompt tokens (4 cached), 3 completion tokens" in done["message"]
    assert crash["gen_id"] == "g-crash" and crash["level"] == "WARNING" and crash["code"] == "engine_crashed"


def _env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}, **extra}


def test_the_settings_log_json_when_asked_as_node_join_does():
    code = ("import django, logging; django.setup(); from nodes.link.logs import generation_context\n"
            "with generation_context('g-7'): logging.getLogger('nodes.agent').warning('hello')")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=_env(DJANGO_SETTINGS_MODULE="fleet.settings", FLEET_LOG_FORMAT="json"))
    line = json.loads(run.stderr.strip().splitlines()[-1])
    assert (line["logger"], line["level"], line["message"]) == ("nodes.agent", "WARNING", "hello")
    assert line["gen_id"] == "g-7"
    plain = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env=_env(DJANGO_SETTINGS_MODULE="fleet.settings", FLEET_LOG_FORMAT="plain"))
    assert plain.stderr.strip().endswith("WARNING nodes.agent: hello")


def test_a_node_without_django_logs_json_and_refuses_an_unknown_format(tmp_path):
    nowhere = Head(home=tmp_path, port=free_port(), env=_env(
        FLEET_LOG_FORMAT="json", FLEET_LOCAL_NODE_TOKEN=format_token(LOCAL_TOKEN_ID, make_secret())))
    node = start_mock_node(nowhere, "json-node")
    try:
        wait_for(lambda: "redialing" in node.log(), 60, "the node never tried its link")
    finally:
        node.stop()
    lines = [json.loads(line) for line in node.log().splitlines() if line.startswith("{")]
    assert any(line["logger"] == "nodes.agent" and "redialing" in line["message"] for line in lines)

    bogus = subprocess.run([sys.executable, "-m", "tests.mock_node", nowhere.address, "x", str(tmp_path), "{}",
                            "smollm2", "2"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={**nowhere.env, "FLEET_LOG_FORMAT": "xml"})
    assert bogus.returncode == 2
    assert bogus.stderr == "node_join: FLEET_LOG_FORMAT is 'xml'; set it to plain or json\n"
    joining = subprocess.run([sys.executable, "manage.py", "node_join", nowhere.address, "--model", "smollm2",
                              "--offline"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={**nowhere.env, "FLEET_LOG_FORMAT": "xml"})
    assert joining.returncode == 2
    assert joining.stderr == "fleet: FLEET_LOG_FORMAT is 'xml'; set it to plain or json\n"


def test_a_5xx_fleet_chose_is_a_warning_and_a_500_stays_an_error():
    """Django logs every 5xx at ERROR: a deadline that passed (503) is an answer, not a fault of the head."""
    import logging

    from django.http import HttpResponse
    from django.test import RequestFactory
    from django.utils.log import log_response

    seen: list[int] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.levelno)

    logger = logging.getLogger("django.request")
    keep = Keep()
    logger.addHandler(keep)
    try:
        for status in (503, 500):
            log_response("%s", status, response=HttpResponse(status=status), request=RequestFactory().get("/v1/x"))
    finally:
        logger.removeHandler(keep)
    assert seen == [logging.WARNING, logging.ERROR]


def test_progress_in_json_mode_is_log_records_not_plain_lines(monkeypatch, caplog):
    import io
    import logging

    from nodes.agent.pull import Progress

    monkeypatch.setenv("FLEET_LOG_FORMAT", "json")
    caplog.set_level(logging.INFO, logger="nodes.agent")
    stream = io.StringIO()
    bar = Progress("pulling m", 100, stream)
    for done in (0, 55, 100):
        bar(done)
    assert stream.getvalue() == ""
    assert [r.progress for r in caplog.records if r.name == "nodes.agent"] == [0, 50, 100]


def test_a_loads_progress_in_a_log_file_is_one_line_and_a_pulls_a_line_per_tenth():
    import io

    from nodes.agent.pull import Progress

    load, pull = io.StringIO(), io.StringIO()
    loading, pulling = Progress("loading m", 100, load, figures=False), Progress("pulling m", 2_000_000, pull)
    for done in (0, 15, 30, 55, 100):
        loading(done)
        pulling(done * 20_000)
    assert load.getvalue() == "loading m: 0% 10% 30% 50% 100%\n"
    assert pull.getvalue().splitlines() == [f"pulling m: {p:3d}% ({mb} of 2.0 MB)" for p, mb in
                                            ((0, "0.0"), (10, "0.3"), (30, "0.6"), (50, "1.1"), (100, "2.0"))]


def test_a_load_that_fails_ends_its_progress_line():
    import io

    from nodes.agent.pull import Progress

    stream = io.StringIO()
    bar = Progress("loading m", 100, stream, figures=False)
    bar(0)
    bar(40)
    bar.abandon()
    assert stream.getvalue() == "loading m: 0% 40%\n"
