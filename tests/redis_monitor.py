"""What head processes ask Redis, by kind, as MONITOR shows it: for bench/scale.py and the tests that count calls.

MONITOR shows each command a client sent (a Lua script's own commands come marked `lua` and are left out here: the
script is one call). A MULTI ... EXEC block is one round trip and one call, named by the kinds inside it; any other
command counts as one (a pipeline without MULTI would count once per command: an upper bound on its round trips).
A command's kind is its name and the family of its first key, with the prefix and every id left out
(`get cache:*:api-keys:stamp`, `evalsha choose`, `multi[hincrbyfloat metrics:fleet_generations]`).
"""

from __future__ import annotations

import hashlib
import re
import threading
import uuid
from collections import Counter

ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{12,}|\d+")


def script_names() -> dict[str, str]:
    """sha1 -> name of every Lua script the head runs (EVALSHA names scripts by their sha1)."""
    from api.quota_counts import ADMIT
    from fleet.placement_lua import SCRIPTS

    scripts = {**SCRIPTS, "quota_admit": ADMIT}
    return {hashlib.sha1(source.encode()).hexdigest(): name for name, source in scripts.items()}  # noqa: S324


def kind_of(command: str, prefix: str, scripts: dict[str, str]) -> str:
    parts = command.split(" ")
    name = parts[0].lower()
    if name == "evalsha" and len(parts) > 1:
        return f"{name} {scripts.get(parts[1], parts[1][:8])}"
    if name == "eval":  # a script sent whole (channels-redis's): named by its first words
        words = [w for w in command.replace("\\n", " ").replace("\\t", " ").split()[1:] if w]
        return f"{name} {' '.join(words[:2])}"
    if len(parts) == 1:
        return name
    key = parts[1].split(prefix, 1)[-1] if prefix else parts[1]
    return f"{name} {ID.sub('*', key)}"


class Monitor:
    """Counts what clients send to one Redis database (`db`) under one key prefix, from `start` to `stop`."""

    def __init__(self, client, *, db: int, prefix: str) -> None:
        self.r, self.db, self.prefix = client, db, prefix
        self.scripts = script_names()
        self.kinds: Counter[str] = Counter()
        self._open: dict[str, list[str]] = {}
        self._hello: set[str] = set()
        self._end = ""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.kinds = Counter()
        self._end = f"monitor-end-{uuid.uuid4().hex}"
        ready = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)

    def _watch(self, ready: threading.Event) -> None:
        with self.r.monitor() as monitor:
            ready.set()
            while True:
                command = monitor.next_command()
                text = command.get("command", "")
                if self._end in text:  # stop's marker: everything sent before it has been seen
                    return
                if command.get("client_type") != "lua" and int(command.get("db", -1)) == self.db:
                    self.seen(text, f"{command.get('client_address')}:{command.get('client_port')}")

    def seen(self, command: str, client: str) -> None:
        """One command MONITOR showed, from `client` (address:port)."""
        name = command.split(" ", 1)[0].lower()
        if name == "hello":  # a new connection: named by what it then sends, to see who opens connections
            self._hello.add(client)
            return
        if client in self._hello and name not in ("client", "select"):
            self._hello.discard(client)
            self.kinds[f"hello (then {kind_of(command, self.prefix, self.scripts)})"] += 1
        if name == "multi":
            self._open[client] = []
        elif name == "exec" and client in self._open:
            inside = self._open.pop(client)
            if any(self.prefix in raw for raw in inside):
                kinds = sorted({kind_of(raw, self.prefix, self.scripts).split(":", 1)[0] for raw in inside})
                self.kinds[f"multi[{', '.join(kinds)}]"] += 1
        elif client in self._open:
            self._open[client].append(command)
        elif self.prefix in command and name != "monitor":
            self.kinds[kind_of(command, self.prefix, self.scripts)] += 1

    def stop(self) -> Counter[str]:
        self.r.echo(self._end)  # MONITOR shows commands in the order Redis ran them: this one comes after the rest
        if self._thread is not None:
            self._thread.join(30)
        return self.kinds
