"""A node's copies of registry models: `$FLEET_HOME/models/<name>/<sha256>.gguf`, pulled from the head.

`node_join --model NAME` for a name that is no file and no bundled id asks the head over the link for a grant
(`Pull` -> `PullGrant`), then fetches the file with HTTP Range requests of at most PIECE bytes into a `.part` file,
so an interrupted pull resumes where it stopped. The whole file's sha256 is checked before use, at every start: a
copy that fails it is discarded and pulled again. `--offline` pulls nothing: the copy must already be here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from nodes.link.messages import PullGrant

log = logging.getLogger("nodes.agent")

CHUNK = 1 << 20
PIECE = 8 << 20  # bytes a Range request asks for: bounds what one response may buffer and what a kill wastes
TIMEOUT_S = 30


class PullError(Exception):
    """The model could not be pulled or is not on this node; the message says what to do."""


class GrantExpired(PullError):
    """The head no longer takes this pull's grant (FLEET_PULL_GRANT_S passed): ask for a new one and go on."""


class Progress:
    """A bar redrawn in place on a terminal; in a log file (stderr not a TTY) one line per 10% of a pull (minutes,
    between other lines), and a load's steps on one line (seconds: "loading m: 0% 10% ... 100%"); with
    FLEET_LOG_FORMAT=json a log record per 10% (JSON like every other line, with `progress`)."""

    def __init__(self, label: str, total: int, stream=None, *, figures: bool = True):
        """`total` bytes (or any count, with `figures` False: then only the percentage is shown)."""
        self.label, self.total, self.stream = label, max(total, 1), stream or sys.stderr
        self.as_log = (os.environ.get("FLEET_LOG_FORMAT") or "").strip().lower() == "json"
        self.tty, self.figures = self.stream.isatty() and not self.as_log, figures
        self.shown = -1

    def __call__(self, done: int) -> None:
        percent = max(0, min(100, done * 100 // self.total))
        step = percent if self.tty else percent // 10 * 10
        if step == self.shown:
            return
        first, self.shown = self.shown == -1, step
        figures = f"{step:3d}%" + (f" ({done / 1e6:.1f} of {self.total / 1e6:.1f} MB)" if self.figures else "")
        if self.as_log:
            log.info("%s: %s", self.label, figures.strip(), extra={"progress": step})
            return
        if self.tty:
            bar = "#" * (step * 30 // 100)
            self.stream.write(f"\r{self.label} [{bar:.<30}] {figures}" + ("\n" if step == 100 else ""))
        elif self.figures:
            self.stream.write(f"{self.label}: {figures}\n")
        else:
            self.stream.write((f"{self.label}:" if first else "") + f" {step}%" + ("\n" if step == 100 else ""))
        self.stream.flush()

    def abandon(self) -> None:
        """End a line left open (a load that failed before 100%), so what is said next starts a line of its own."""
        if not self.as_log and 0 <= self.shown < 100 and (self.tty or not self.figures):
            self.stream.write("\n")
            self.stream.flush()


def model_dir(home: Path, name: str) -> Path:
    return home / "models" / name


def _manifest(home: Path, name: str) -> dict | None:
    try:
        data = json.loads((model_dir(home, name) / "model.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("sha256"), str) else None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def local_copy(home: Path, name: str) -> tuple[Path, str] | None:
    """This node's verified copy of `name` (path, sha256); a copy that fails its hash is discarded (None)."""
    manifest = _manifest(home, name)
    if manifest is None:
        return None
    path = model_dir(home, name) / f"{manifest['sha256']}.gguf"
    if not path.is_file():
        return None
    if sha256_of(path) != manifest["sha256"]:
        log.warning("fleet node: the copy of %s at %s is corrupt (its sha256 differs); discarded", name, path)
        path.unlink()
        return None
    return path, manifest["sha256"]


def _fetch_piece(url: str, grant: str, first: int, last: int, out, progress, done: int) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Fleet-Grant {grant}",  # noqa: S310 - http(s)
                                                   "Range": f"bytes={first}-{last}"})
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)  # noqa: S310 - the head's own http(s) URL
    except urllib.error.HTTPError as exc:
        detail = exc.read(2000).decode("utf-8", "replace")
        if exc.code == 403 and "expired" in detail:
            raise GrantExpired(detail) from None
        raise PullError(f"the head refused the pull ({exc.code}): {detail}") from None
    with response:
        if response.status != 206:
            raise PullError(f"the head answered a Range request with {response.status}, not 206")
        while chunk := response.read(CHUNK):
            out.write(chunk)
            done += len(chunk)
            progress(done)
    return done


def pull(base_url: str, grant: PullGrant, home: Path, progress: Progress | None = None) -> Path:
    """Fetch the granted file into `models/<name>/`, resuming a `.part` left by an interrupted pull. Blocking."""
    folder = model_dir(home, grant.model)
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f"{grant.sha256}.gguf.part"
    done = part.stat().st_size if part.exists() else 0
    if done > grant.size:
        part.unlink()
        done = 0
    if done:
        log.info("fleet node: resuming the pull of %s at %d of %d bytes", grant.model, done, grant.size)
    progress = progress or Progress(f"pulling {grant.model}", grant.size)
    progress(done)
    url = base_url.rstrip("/") + grant.path
    with open(part, "ab") as out:
        while done < grant.size:
            last = min(grant.size, done + PIECE) - 1
            done = _fetch_piece(url, grant.grant, done, last, out, progress, done)
    if sha256_of(part) != grant.sha256:
        part.unlink()
        raise PullError(f"the pulled copy of {grant.model} does not match its sha256; discarded, pull it again")
    final = folder / f"{grant.sha256}.gguf"
    os.replace(part, final)
    for old in folder.glob("*.gguf"):
        if old != final:
            old.unlink()  # an older file of the same name
    (folder / "model.json").write_text(json.dumps({"name": grant.model, "sha256": grant.sha256, "size": grant.size}))
    return final


def fetch_blob(url: str, grant: str, sha256: str, size: int, target: Path) -> None:
    """Fetch a `size`-byte blob into `target` in Range pieces; a copy whose sha256 differs is a PullError. Blocking."""
    part = target.with_name(target.name + ".part")
    done = 0
    with open(part, "wb") as out:
        while done < size:
            done = _fetch_piece(url, grant, done, min(size, done + PIECE) - 1, out, lambda _done: None, done)
    if sha256_of(part) != sha256:
        part.unlink()
        raise PullError(f"the fetched blob does not match its sha256 {sha256}")
    os.replace(part, target)


def http_base(head: str) -> str:
    """The head's HTTP address from what node_join dials: host:port, or a ws(s):// link URI."""
    if head.startswith(("ws://", "wss://")):
        scheme, rest = head.split("://", 1)
        return f"{'https' if scheme == 'wss' else 'http'}://{rest.split('/', 1)[0]}"
    return f"http://{head}"
