"""Who may be a node, with real processes: identity binding against an impostor, head key pinning, revocation."""

import os
import re
import time

import httpx
import pytest

from tests.live import free_port, make_head, make_peer_head, start_node, wait_for
from tests.test_node_link_e2e import admin_session

pytestmark = pytest.mark.slow


@pytest.fixture
def head(tmp_path):
    head = make_head(tmp_path, port=free_port())
    head.start()
    yield head
    head.stop()


def fleet_token(head, name: str = "nodes") -> str:
    return re.search(r"FLEET_TOKEN=(\S+)", head.manage("fleet_token", "--name", name).stdout).group(1)


def own_home(tmp_path, name: str) -> dict[str, str]:
    """A node host of its own: its own FLEET_HOME, so its own key and pin."""
    home = tmp_path / name
    home.mkdir()
    return {"FLEET_HOME": str(home)}


def test_an_impostor_with_the_same_token_cannot_take_a_serving_nodes_identity(head, tmp_path):
    token = fleet_token(head)
    victim = start_node(head, "--token", token, "--max-batch", "2", identity="gpu-1",
                        extra_env=own_home(tmp_path, "victim"))
    try:
        head.wait_nodes(1, timeout=180)
        body = {"model": "smollm2", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Count from one to one hundred, in words."}]}
        with httpx.stream("POST", f"{head.url}/v1/chat/completions", json=body, timeout=180,
                          headers={"Authorization": f"Bearer {head.api_key}"}) as response:
            lines = response.iter_lines()
            before = [next(lines) for _ in range(3)]  # the stream is under way on the victim
            impostor = start_node(head, "--token", token, identity="gpu-1", extra_env=own_home(tmp_path, "impostor"))
            wait_for(lambda: impostor.proc.poll() is not None, 120, f"the impostor was not refused: {impostor.log()}")
            after = [line for line in lines if line.startswith("data: ")]
        assert impostor.proc.returncode == 2
        errors = [line for line in impostor.log().splitlines() if line.startswith("node_join:")]
        assert len(errors) == 1 and "another node key already holds this identity" in errors[0], impostor.log()
        assert head.log().count("bound to key") == 1  # one line on the head
        # The victim's stream went on to its end, with no error event, and the victim is still the node.
        assert before and after[-1] == "data: [DONE]"
        assert not any('"error"' in line for line in after)
        finish = [line for line in after if '"finish_reason": "length"' in line or '"finish_reason":"length"' in line]
        assert finish, after[-3:]
        assert victim.proc.poll() is None and (head.health() or {}).get("nodes") == 1
        assert "Traceback" not in head.log() and "Traceback" not in impostor.log()
    finally:
        victim.stop()


def test_a_node_refuses_a_head_whose_key_differs_from_the_pinned_one(head, tmp_path):
    env = own_home(tmp_path, "pinned")
    pin = tmp_path / "pinned" / "fleet" / "head_key"
    pin.parent.mkdir(parents=True)
    pin.write_text("11" * 32 + "\n")  # a key this head does not have
    node = start_node(head, "--token", fleet_token(head), identity="gpu-pin", extra_env=env)
    wait_for(lambda: node.proc.poll() is not None, 120, f"node_join did not stop: {node.log()}")
    assert node.proc.returncode == 2
    errors = [line for line in node.log().splitlines() if line.startswith("node_join:")]
    assert len(errors) == 1 and "but this node pinned" in errors[0] and "--accept-new-head" in errors[0]
    assert head.health()["nodes"] == 0
    node = start_node(head, "--accept-new-head", identity="gpu-pin", extra_env=env)  # the kept token, a new pin
    try:
        head.wait_nodes(1, timeout=180)
        assert pin.read_text().strip() != "11" * 32
        head_key = re.search(r"first join: (SHA256:\S+)", head.manage("fleet_token", "--name", "x").stdout).group(1)
        assert f"pinned the head's link key {head_key}" in node.log()
    finally:
        node.stop()


def _revoke_node_in_the_admin(head, identity: str) -> None:
    admin = admin_session(head)
    page = admin.get("/admin/nodes/node/").text
    pk = re.search(r'name="_selected_action" value="([^"]+)"', page).group(1)
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    response = admin.post("/admin/nodes/node/", data={"csrfmiddlewaretoken": csrf, "action": "revoke",
                                                       "_selected_action": pk, "index": "0"})
    assert "node key(s) revoked" in response.text
    assert identity in admin.get("/admin/nodes/revokednodekey/").text


@pytest.mark.parametrize("how", ["token", "node"])
def test_revocation_closes_the_link_on_the_head_process_that_holds_it(head, tmp_path, how):
    """With Redis, on another head process than the one the operator used; on the embedded default, on the one head.
    The node links both heads with Redis: whichever closes its link first cuts the node off (it says goodbye on the
    other link as it exits), so the refusal is looked for in both logs. A token revoked by `manage.py` reaches a
    head only through the channel layer either way."""
    holder = head
    if os.environ.get("REDIS_URL"):
        holder = make_peer_head(head, tmp_path)
        holder.start()
    token = fleet_token(head)
    node = start_node(holder, "--token", token, identity="gpu-r", extra_env=own_home(tmp_path, "r"))
    try:
        holder.wait_nodes(1, timeout=180)
        started = time.monotonic()
        if how == "token":
            head.manage("fleet_token", "--revoke", token.split(".")[0])
        else:
            _revoke_node_in_the_admin(head, "gpu-r")
        wait_for(lambda: node.proc.poll() is not None, 60, f"the node was not cut off: {node.log()}")
        print(f"revoked by {how}: node exited {time.monotonic() - started:.2f} s after the revocation began")
        assert node.proc.returncode == 2
        expected = "fleet token was revoked" if how == "token" else "the operator revoked this node's key"
        errors = [line for line in node.log().splitlines() if line.startswith("node_join:")]
        assert len(errors) == 1 and expected in errors[0], node.log()
        logs = holder.log_path.read_text() + (head.log_path.read_text() if holder is not head else "")
        assert "fleet refused node gpu-r from 127.0.0.1" in logs
        again = start_node(holder, "--token", token, identity="gpu-r", extra_env={"FLEET_HOME": str(tmp_path / "r")})
        wait_for(lambda: again.proc.poll() is not None, 120, f"the revoked node rejoined: {again.log()}")
        assert again.proc.returncode == 2
    finally:
        node.stop()
        if holder is not head:
            holder.stop()
