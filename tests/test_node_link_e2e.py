"""The node link with real processes: a head (daphne) and `manage.py node_join` on the bundled model."""

import re
import signal
import time

import httpx
import pytest

from tests.live import free_port, make_head, start_node, wait_for

pytestmark = pytest.mark.slow


def admin_session(head) -> httpx.Client:
    """Log into the admin as a person would: the login form, its CSRF token, then the session cookie."""
    client = httpx.Client(base_url=head.url, timeout=20, follow_redirects=True)
    page = client.get("/admin/login/")
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    response = client.post("/admin/login/?next=/admin/", data={
        "csrfmiddlewaretoken": csrf, "username": "admin", "password": "test-password-1", "next": "/admin/"})
    assert "Log out" in response.text or "logout" in response.text
    return client


@pytest.fixture
def head(tmp_path):
    head = make_head(tmp_path, port=free_port())
    head.start()
    yield head
    head.stop()


@pytest.fixture(scope="module")
def refusing_head(tmp_path_factory):
    """One head for the bad-token shapes: each refusal is a node that never joins, and leaves the head as it was."""
    head = make_head(tmp_path_factory.mktemp("refusals"), port=free_port())
    head.start()
    yield head
    head.stop()


def test_node_joins_with_a_token_and_is_online_in_the_admin(head):
    out = head.manage("fleet_token", "--name", "e2e", "--head", head.address).stdout
    token = re.search(r"FLEET_TOKEN=(\S+)", out).group(1)
    node = start_node(head, "--token", token, "--max-batch", "3", identity="gpu-e2e")
    try:
        head.wait_nodes(1, timeout=180)
        admin = admin_session(head)
        page = admin.get("/admin/nodes/node/").text
        assert "gpu-e2e" in page and "online" in page
        fleet = admin.get("/admin/fleet/").text
        assert "gpu-e2e" in fleet and "smollm2" in fleet and "/ 3" in fleet
        assert "joined from 127.0.0.1: smollm2, context window" in head.log()
        assert (head.home / "fleet" / "token").read_text().strip() == token
    finally:
        node.stop()


def test_head_restart_gets_the_node_back_within_one_backoff_step(head):
    node = start_node(head, identity="gpu-restart")
    try:
        head.wait_nodes(1, timeout=180)
        head.stop()
        time.sleep(1.0)
        head.start()
        back_at = time.monotonic()
        head.wait_nodes(1, timeout=35)
        # The node's backoff had grown to at most 4-8 s while the head was down; one step is at most 30 s.
        assert time.monotonic() - back_at < 12
        # /healthz counts the link as soon as it is placeable; the line is logged after the link's group is joined,
        # which on Redis is one more round trip away.
        wait_for(lambda: "rejoined from 127.0.0.1" in head.log(), 10, f"no rejoin logged: {head.log()}")
    finally:
        node.stop()


@pytest.mark.parametrize(
    ("shape", "line"),
    [
        ("unknown", "node_join: the head refused this node's fleet token (unknown, or wrong secret)"),
        ("wrong-secret", "node_join: the head refused this node's fleet token (unknown, or wrong secret)"),
        ("revoked", "node_join: this node's fleet token was revoked"),
        ("expired", "node_join: this node's fleet token has expired"),
    ],
)
def test_every_bad_token_stops_node_join_with_one_line_and_exit_2(refusing_head, shape, line):
    head = refusing_head
    refused_before = head.log_path.read_text().count("refused node")  # the whole log: log() is its tail
    if shape == "unknown":
        token = "abcdef012345." + "A" * 43
    else:
        expiry = ["--expires-in", "1m"] if shape == "expired" else []
        out = head.manage("fleet_token", "--name", shape, *expiry).stdout
        token = re.search(r"FLEET_TOKEN=(\S+)", out).group(1)
        if shape == "wrong-secret":
            token = token.split(".")[0] + "." + "A" * 43
        elif shape == "revoked":
            head.manage("fleet_token", "--revoke", token.split(".")[0])
        elif shape == "expired":
            head.manage("shell", "-c", "from django.utils import timezone; from nodes.models import FleetToken; "
                        f"FleetToken.objects.filter(name={shape!r}).update(expires_at=timezone.now())")
    node = start_node(head, "--token", token, identity="gpu-bad")
    wait_for(lambda: node.proc.poll() is not None, 180, f"node_join did not stop: {node.log()}")
    assert node.proc.returncode == 2
    errors = [text for text in node.log().splitlines() if text.startswith("node_join:")]
    assert len(errors) == 1 and errors[0].startswith(line), node.log()
    assert "Traceback" not in node.log() and "Traceback" not in head.log()
    assert head.log_path.read_text().count("refused node") == refused_before + 1


def test_node_sigterm_is_a_clean_stop(head):
    node = start_node(head, identity="gpu-stop")
    head.wait_nodes(1, timeout=180)
    node.stop(signal.SIGTERM)
    assert node.proc.returncode == 0, node.log()
    wait_for(lambda: (head.health() or {}).get("nodes") == 0, 20, "the head did not notice the node left")
    assert "Traceback" not in node.log()
