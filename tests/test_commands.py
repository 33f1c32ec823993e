"""The management commands' output and exit codes, as a host owner or operator sees them."""

import subprocess
import sys
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from api.models import ApiKey
from nodes.models import FleetToken
from nodes.services import fleet_token_verify
from tests.factories import UserFactory
from tests.live import ROOT

pytestmark = pytest.mark.django_db


def run_manage(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)


def test_fleet_token_prints_the_token_once_with_the_node_join_line():
    out = StringIO()
    call_command("fleet_token", "--name", "gpu hosts", "--head", "head.example:8000", stdout=out)
    text = out.getvalue()
    token_line = next(line.strip() for line in text.splitlines() if line.strip().count(".") == 1 and " " not in
                      line.strip())
    assert fleet_token_verify(token_string=token_line)
    assert f"FLEET_TOKEN={token_line} make node HEAD=head.example:8000" in text
    assert f"FLEET_TOKEN={token_line} .venv/bin/python manage.py node_join head.example:8000 --model" in text
    out = StringIO()
    call_command("fleet_token", "--list", stdout=out)
    assert "gpu hosts" in out.getvalue() and token_line.split(".")[1] not in out.getvalue()


def test_fleet_token_revoke_and_unknown_id():
    call_command("fleet_token", "--name", "x", stdout=StringIO())
    token = FleetToken.objects.get()
    out = StringIO()
    call_command("fleet_token", "--revoke", token.public_id, stdout=out)
    assert "Revoked" in out.getvalue()
    token.refresh_from_db()
    assert token.revoked_at is not None
    with pytest.raises(CommandError) as info:
        call_command("fleet_token", "--revoke", "nope")
    assert info.value.returncode == 2 and "no fleet token with id 'nope'" in str(info.value)


def test_create_api_key_prints_it_once():
    UserFactory(username="dev")
    out = StringIO()
    call_command("create_api_key", "--user", "dev", "--name", "app", stdout=out)
    key = next(line.strip() for line in out.getvalue().splitlines() if line.strip().startswith("fk-"))
    row = ApiKey.objects.get()
    assert key.startswith(row.prefix) and key not in row.key_hash
    with pytest.raises(CommandError) as info:
        call_command("create_api_key", "--user", "ghost", "--name", "app")
    assert info.value.returncode == 2 and "no user named 'ghost'" in str(info.value)


def test_create_api_key_takes_the_keys_share_of_a_full_fleet():
    UserFactory(username="dev")
    call_command("create_api_key", "--user", "dev", "--name", "tenant", "--priority", "high", "--weight", "3",
                 "--max-waiting", "20", stdout=StringIO())
    row = ApiKey.objects.get()
    assert (row.priority, row.weight, row.max_waiting) == ("high", 3, 20)
    with pytest.raises(CommandError) as info:
        call_command("create_api_key", "--user", "dev", "--name", "tenant", "--weight", "0")
    assert info.value.returncode == 2 and "--weight must be from 1 to 100" in str(info.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give --model (a text model), --transcribe (a speech model), or both"),
        (["--transcribe", "/no/such/folder"], "is no CTranslate2 model folder (no model.bin there)"),
        (["--model", "smollm2", "--max-batch", "eight"], "'eight' is not a number"),
        (["--model", "smollm2", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--model", "/no/such/model.gguf"], "model file '/no/such/model.gguf' does not exist"),
        (["--model", "smollm2", "--replicas", "3", "--gpus", "0,1"], "--replicas 3 does not divide the 2 GPUs"),
        (["--model", "smollm2", "--replicas", "2", "--gpus", "0,1;1,2"], "GPU 1 is in two groups"),
        (["--model", "smollm2", "--label", "gpu"], "argument --label: 'gpu' is not KEY=VALUE"),
    ],
)
def test_node_join_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    import os

    result = run_manage("node_join", "127.0.0.1:9", *args, env={**os.environ, "FLEET_HOME": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("abcdef123456", "has no '.'"),
        ("abcdef123456.", "got 0 characters"),
        ("abcdef123456." + "A" * 42, "got 42 characters"),
        ("abcdef123456." + "A" * 44, "got 44 characters"),
        ("abcdef123456." + "A" * 42 + "B", "not canonical"),  # 43 characters whose last one carries stray bits
        ("bad id!." + "A" * 43, "token id before the '.'"),
        ("x" * 65 + "." + "A" * 43, "token id before the '.'"),
        ("abcdef123456." + "A" * 42 + "=", "unpadded urlsafe base64"),
    ],
    ids=["no-dot", "empty-secret", "short-secret", "long-secret", "non-canonical", "bad-id", "long-id", "padded"],
)
def test_node_join_malformed_token_is_one_line_and_exit_2(token, message, tmp_path):
    import os

    result = run_manage("node_join", "127.0.0.1:9", "--model", "smollm2", "--token", token,
                        env={**os.environ, "FLEET_HOME": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "fleet token from --token is malformed" in lines[0] and message in lines[0], lines
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "fleet" / "token").exists()  # a malformed token is never kept


def test_node_join_without_any_token_says_how_to_get_one(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("FLEET_LOCAL_NODE_TOKEN", "FLEET_TOKEN")}
    result = run_manage("node_join", "127.0.0.1:9", "--model", "smollm2", env={**env, "FLEET_HOME": str(tmp_path)})
    assert result.returncode == 2
    assert result.stderr.strip() == ("node_join: no fleet token: make one on the head with `manage.py fleet_token` "
                                     "and pass it with --token-file PATH, $FLEET_TOKEN or --token")


def test_fleet_token_expires_in():
    out = StringIO()
    call_command("fleet_token", "--name", "short", "--expires-in", "12h", stdout=out)
    token = FleetToken.objects.get()
    assert token.expires_at is not None and "valid until" in out.getvalue()
    assert 11.9 * 3600 < (token.expires_at - token.created_at).total_seconds() <= 12 * 3600
    with pytest.raises(CommandError) as info:
        call_command("fleet_token", "--expires-in", "soon")
    assert info.value.returncode == 2 and "like 30m, 12h or 90d" in str(info.value)


def test_node_join_with_a_corrupt_kept_token_file_is_one_line_and_exit_2(tmp_path):
    import os

    kept = tmp_path / "fleet" / "token"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"\xff\xfe\x00garbage\x80")  # not UTF-8: a disk error, a stray binary write
    env = {k: v for k, v in os.environ.items() if k != "FLEET_LOCAL_NODE_TOKEN"}
    result = run_manage("node_join", "127.0.0.1:9", "--model", "smollm2", env={**env, "FLEET_HOME": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"the kept fleet token in {kept} is unreadable" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("bound", "warned"), [("127.0.0.1:8765", True), ("0.0.0.0:8765", False)])
def test_fleet_token_prints_the_port_up_is_bound_to_and_warns_of_a_loopback_head(settings, tmp_path, monkeypatch,
                                                                                 bound, warned):
    import socket

    from nodes.services import head_served_address_path

    monkeypatch.delenv("FLEET_PUBLIC_ADDRESS", raising=False)
    settings.FLEET_HOME = tmp_path
    head_served_address_path().write_text(bound + "\n")
    out, err = StringIO(), StringIO()
    call_command("fleet_token", "--name", "far", stdout=out, stderr=err)
    assert f"make node HEAD={socket.gethostname()}:8765" in out.getvalue()
    assert ("nodes on other machines cannot reach it" in err.getvalue()) is warned


def test_the_admins_token_page_prints_the_same_lines_for_the_address_it_was_opened_at(client, monkeypatch):
    monkeypatch.delenv("FLEET_PUBLIC_ADDRESS", raising=False)
    client.force_login(UserFactory(username="operator"))
    page = client.post("/admin/nodes/fleettoken/add/", {"name": "rack"}, HTTP_HOST="head.lan:8765", follow=True)
    assert "make node HEAD=head.lan:8765" in page.content.decode()


def test_node_join_reads_the_token_from_fleet_token_and_keeps_it(tmp_path, monkeypatch):
    from nodes.agent.main import NodeOptions, remember_token, token_path
    from nodes.services import fleet_token_create

    _, secret = fleet_token_create(name="env")
    monkeypatch.setenv("FLEET_TOKEN", secret)
    assert remember_token(NodeOptions(head="h:1", model="smollm2", home=tmp_path)) == secret
    assert token_path(tmp_path).read_text().strip() == secret


def test_node_join_token_file_is_read_and_an_unreadable_one_is_one_line(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("FLEET_LOCAL_NODE_TOKEN", "FLEET_TOKEN")}
    bad = tmp_path / "token"
    bad.write_text("not-a-token\n")
    results = [run_manage("node_join", "127.0.0.1:9", "--model", "smollm2", "--token-file", str(path),
                          env={**env, "FLEET_HOME": str(tmp_path)}) for path in (bad, tmp_path / "missing")]
    lines = [[line for line in r.stderr.splitlines() if line.strip()] for r in results]
    assert [r.returncode for r in results] == [2, 2] and [len(x) for x in lines] == [1, 1], lines
    assert f"the fleet token from --token-file {bad} is malformed" in lines[0][0]
    assert "--token-file" in lines[1][0] and "cannot be read" in lines[1][0]


def test_up_on_a_taken_port_is_one_line_and_exit_2():
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        result = run_manage("up", "--port", str(holder.getsockname()[1]), "--no-node", "--no-celery")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "cannot listen on 127.0.0.1:" in lines[0], result.stderr
    assert "Fleet is up" not in result.stdout


def test_sample_wav_speaks_the_sentence_into_a_16_khz_wav(tmp_path):
    import wave

    import numpy as np

    out = StringIO()
    call_command("sample_wav", str(tmp_path / "hello.wav"), stdout=out)
    with wave.open(str(tmp_path / "hello.wav")) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 16_000)
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype=np.int16)
    assert len(samples) > 3 * 16_000 and np.abs(samples).mean() > 100  # seconds of sound, not silence
    assert "Wrote" in out.getvalue() and "hello.wav" in out.getvalue()


def test_sample_wav_to_a_path_it_cannot_write_is_one_line_and_exit_2(tmp_path):
    out = run_manage("sample_wav", str(tmp_path / "no" / "such" / "dir.wav"))
    assert out.returncode == 2 and "cannot write" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("park", [True, False])
def test_node_join_park_gives_each_engine_worker_a_park_folder(monkeypatch, settings, tmp_path, park):
    """`--park` reaches the engine: each worker's config names its folder (the engine then starts warm from it:
    tests/test_engine_llama.py, test_park_saves_lanes_and_a_new_engine_starts_warm)."""
    from nodes.agent.main import engine_configs

    asked = []
    monkeypatch.setattr("nodes.management.commands.node_join.run_node", lambda options: asked.append(options) or 0)
    settings.FLEET_HOME = tmp_path
    call_command("node_join", "127.0.0.1:1", "--model", "smollm2", "--max-context", "512", "--replicas", "2",
                 *(["--park"] if park else []))
    configs, name, _ = engine_configs(asked[0])
    expected = [str(tmp_path / "park" / name / f"r{i}") for i in range(2)] if park else [None, None]
    assert [config.park_dir for config in configs] == expected


def test_first_admin_makes_an_admin_and_a_key_with_no_prompt_and_a_second_run_makes_nothing():
    """Production heads are started by daphne, not `up`: `manage.py first_admin` makes what `up`'s first run makes."""
    import re

    from django.contrib.auth import authenticate, get_user_model

    from api.services import api_key_authenticate

    first = StringIO()
    call_command("first_admin", stdout=first)
    password = re.search(r"user admin\s+password (\S+)", first.getvalue()).group(1)
    key = re.search(r"export KEY=(\S+)", first.getvalue()).group(1)
    assert authenticate(username="admin", password=password).is_superuser
    assert api_key_authenticate(key=key).owner.username == "admin"

    again = StringIO()
    call_command("first_admin", "--username", "other", stdout=again)
    said = again.getvalue()
    assert "An admin user exists already (admin): nothing was made." in said
    assert "manage.py changepassword admin" in said and "create_api_key --user admin --name NAME" in said
    assert password not in said and key not in said
    assert get_user_model().objects.count() == 1 and ApiKey.objects.count() == 1


def test_first_admin_refuses_a_name_a_plain_user_holds_with_one_line():
    UserFactory(username="admin", is_superuser=False)
    with pytest.raises(CommandError) as info:
        call_command("first_admin", stdout=StringIO())
    assert info.value.returncode == 2 and "a user named 'admin' exists and is no superuser" in str(info.value)
    assert ApiKey.objects.count() == 0


def test_fleet_token_says_its_head_address_is_a_guess_when_nothing_names_it(settings, tmp_path, monkeypatch):
    """Heads run by daphne write no address: without FLEET_PUBLIC_ADDRESS the printed HEAD= is only a guess."""
    import socket

    monkeypatch.delenv("FLEET_PUBLIC_ADDRESS", raising=False)
    settings.FLEET_HOME = tmp_path
    out, err = StringIO(), StringIO()
    call_command("fleet_token", "--name", "far", stdout=out, stderr=err)
    assert f"make node HEAD={socket.gethostname()}:8000" in out.getvalue()
    assert "FLEET_PUBLIC_ADDRESS is not set" in err.getvalue() and "HEAD= is a guess" in err.getvalue()

    monkeypatch.setenv("FLEET_PUBLIC_ADDRESS", "fleet.example.com:80")
    out, err = StringIO(), StringIO()
    call_command("fleet_token", "--name", "near", stdout=out, stderr=err)
    assert "make node HEAD=fleet.example.com:80" in out.getvalue() and "warning: FLEET" not in err.getvalue()


def test_node_join_split_options_reach_each_engine_workers_config(monkeypatch, settings, tmp_path):
    """`--split-mode` and `--tensor-split` (one worker over several GPUs) reach the engine's config; a share list
    that is not one is refused by the parser."""
    from nodes.agent import gpu
    from nodes.agent.main import engine_configs, offload
    from nodes.link.device import DeviceMemory

    asked = []
    monkeypatch.setattr("nodes.management.commands.node_join.run_node", lambda options: asked.append(options) or 0)
    settings.FLEET_HOME = tmp_path
    call_command("node_join", "127.0.0.1:1", "--model", "smollm2", "--max-context", "512", "--split-mode", "row",
                 "--tensor-split", "3,1")
    assert (asked[0].split_mode, asked[0].tensor_split) == ("row", (3.0, 1.0))
    two = [gpu.BuildGpu("cuda", DeviceMemory("GPU 0")), gpu.BuildGpu("cuda", DeviceMemory("GPU 1"))]
    configs, _, _ = engine_configs(asked[0], plan=offload(asked[0], host=[], build=two))
    assert [(c.split_mode, c.tensor_split) for c in configs] == [("row", [3.0, 1.0])]
    with pytest.raises(CommandError, match="is not a list of GPU shares"):
        call_command("node_join", "127.0.0.1:1", "--model", "smollm2", "--tensor-split", "3,x")
