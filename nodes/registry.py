"""The model registry's services: add a GGUF file (from a path or an upload in parts), delete it, and grant nodes a
short-lived right to pull it. Media a request sends (a transcription's audio) share the same blobs and grants
(`media_put`, `media_ref`); beat deletes those no request sent for
FLEET_MEDIA_RETENTION_DAYS (`media_purge`).

Files live once by content hash in `$FLEET_HOME/blobs/<sha256>`; uploads grow in `$FLEET_HOME/blobs/uploads/` and
are hashed and checked when they finish. Nothing here holds more than one chunk of a file in memory.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import secrets
import shutil
import time
import uuid
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.core import signing
from django.db import IntegrityError, transaction

from nodes.agent.gguf_info import GgufError, read_gguf
from nodes.agent.pull import sha256_of
from nodes.agent.vocab import tokenizer_fingerprint
from nodes.blobs import blob_dir, blob_path
from nodes.link.messages import PullGrant
from nodes.models import Model

CHUNK = 1 << 20
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
UPLOAD_RE = re.compile(r"[0-9a-f]{32}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
GRANT_SALT = "fleet.model-pull"


class RegistryError(Exception):
    """A model the registry refuses (a bad name, a taken name, a file that is not a GGUF model); says what to do."""


class UploadUnknown(RegistryError):
    """No upload has this id (never started, or already finished)."""


class UploadOffset(RegistryError):
    """A part sent for another offset than the upload's size so far; `size` is where the next part goes."""

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size


class GrantRefused(Exception):
    """A pull whose grant is missing, forged, expired, or for another file."""


def _uploads() -> Path:
    path = blob_dir() / "uploads"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _check_name(name: str) -> str:
    name = (name or "").strip()
    if not NAME_RE.fullmatch(name):
        raise RegistryError(f"model name {name!r} is not valid: use 1-64 letters, digits, '.', '_' or '-', "
                            "starting with a letter or digit")
    if Model.objects.filter(name=name).exists():
        raise RegistryError(f"a model named {name!r} is already in the registry; delete it first or pick another name")
    return name


def _copy_hashing(source: BinaryIO, target: Path) -> str:
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        while chunk := source.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def _base_for(info, base: str) -> Model | None:
    """The registry model an adapter file adapts (`base`), checked against the file; None for a model file."""
    what = {"adapter": "a LoRA adapter", "projector": "an image projector (mmproj)"}.get(info.kind)
    if what is None:
        if base:
            raise RegistryError("the file is a model, not a LoRA adapter or a projector: add it without a base")
        return None
    if not base:
        raise RegistryError(f"the file is {what}: name the registry model it belongs to as its base")
    model = Model.objects.filter(name=base).first()
    if model is None or model.is_attachment:
        raise RegistryError(f"the base {base!r} is not a model in the registry; add the base model first")
    if info.kind == Model.Kind.PROJECTOR and model.adapters.filter(kind=Model.Kind.PROJECTOR).exists():
        raise RegistryError(f"{base!r} has a projector already; delete it first")
    if info.kind == Model.Kind.ADAPTER and model.architecture != info.architecture:
        raise RegistryError(f"the adapter is for {info.architecture!r} models; {base!r} is {model.architecture!r}")
    return model


def _store(staged: Path, sha256: str, name: str, base: str = "") -> Model:
    """Check the staged file is a GGUF model (or a LoRA adapter or projector of `base`), keep it under its hash
    (once), and record it as `name`."""
    try:
        info = read_gguf(staged)
        base_model = _base_for(info, base)
    except (GgufError, RegistryError) as exc:
        staged.unlink(missing_ok=True)
        raise RegistryError(str(exc) if isinstance(exc, RegistryError) else f"the file is refused: {exc}") from None
    target = blob_path(sha256)
    if target.exists():
        staged.unlink()  # the same file under another name: stored once
    else:
        os.replace(staged, target)
        os.utime(target)  # an upload's part may be old; media_purge must not take it before its row exists
    try:
        with transaction.atomic():
            model = Model.objects.create(
                name=name, sha256=sha256, size=info.size, architecture=info.architecture,
                quantization=info.quantization, context_length=info.context_length,
                kv_bytes_per_token=info.kv_bytes_per_token, chat_template=info.chat_template, base=base_model,
                kind=info.kind, tokenizer=tokenizer_fingerprint(target))
    except IntegrityError:
        raise RegistryError(f"a model named {name!r} was added meanwhile; pick another name") from None
    if base_model is not None:  # every node serving the base loads it
        from nodes.deployments import deployments_changed

        deployments_changed()
    return model


def model_add(*, path: str | os.PathLike, name: str, base: str = "") -> Model:
    """Add the GGUF file at `path` (on the head) as `name` (a LoRA adapter names its `base` model): copied into the
    blobs while it is hashed."""
    name = _check_name(name)
    source = Path(path)
    if not source.is_file():
        raise RegistryError(f"no file at {str(source)!r}")
    staged = _uploads() / f"add-{uuid.uuid4().hex}"
    try:
        with open(source, "rb") as handle:
            sha256 = _copy_hashing(handle, staged)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    return _store(staged, sha256, name, base)


# --- uploads in parts ---------------------------------------------------------------------------------------


def model_upload_start() -> str:
    """A new, empty upload; its id is what the parts and the finish name."""
    upload_id = secrets.token_hex(16)
    (_uploads() / f"{upload_id}.part").touch()
    return upload_id


def _upload_file(upload_id: str) -> Path:
    path = _uploads() / f"{upload_id}.part"
    if not UPLOAD_RE.fullmatch(upload_id or "") or not path.exists():
        raise UploadUnknown(f"no upload {upload_id!r}: start one first")
    return path


def model_upload_append(*, upload_id: str, offset: int, source: BinaryIO) -> int:
    """Append a part at `offset`, which must be the upload's size so far (a resent part is refused, not doubled).
    Returns the new size."""
    path = _upload_file(upload_id)
    size = path.stat().st_size
    if offset != size:
        raise UploadOffset(f"upload {upload_id} has {size} bytes; send the part at offset {size}, not {offset}", size)
    with open(path, "ab") as out:
        shutil.copyfileobj(source, out, CHUNK)
    return path.stat().st_size


def model_upload_finish(*, upload_id: str, name: str, base: str = "") -> Model:
    """Hash the uploaded file, check it is a GGUF model (or a LoRA adapter of `base`) and record it as `name`."""
    name = _check_name(name)
    path = _upload_file(upload_id)
    return _store(path, sha256_of(path), name, base)


def model_delete(*, model: Model) -> None:
    """Delete the entry (its deployments and adapters too: their nodes drain them), and each file no other entry
    uses."""
    from nodes.deployments import deployments_changed

    shas = {model.sha256, *model.adapters.values_list("sha256", flat=True)}
    deployed = model.deployments.exists() or model.is_adapter or bool(shas - {model.sha256})
    model.delete()  # a base takes its adapters with it; nodes unload them
    if deployed:
        deployments_changed()
    for sha256 in shas - set(Model.objects.filter(sha256__in=shas).values_list("sha256", flat=True)):
        blob_path(sha256).unlink(missing_ok=True)


# --- pulling ------------------------------------------------------------------------------------------------


def blob_url_path(sha256: str) -> str:
    return f"/models/blobs/{sha256}"


def model_grant(*, name: str, identity: str) -> PullGrant:
    """The link message that lets node `identity` pull model `name` for FLEET_PULL_GRANT_S seconds."""
    model = Model.objects.filter(name=name).first()
    if model is None:
        return PullGrant(model=name, error=f"the head has no model named {name!r}; add it on the head "
                                           "(`manage.py model_add PATH --name NAME`, the admin or /api/models/)")
    return PullGrant(model=name, sha256=model.sha256, size=model.size, path=blob_url_path(model.sha256),
                     grant=blob_grant(sha256=model.sha256, identity=identity),
                     expires_s=float(settings.FLEET_PULL_GRANT_S))


def blob_grant(*, sha256: str, identity: str = "") -> str:
    """A grant to pull the blob `sha256` for FLEET_PULL_GRANT_S seconds (`identity`: the node it was made for)."""
    return signing.TimestampSigner(salt=GRANT_SALT).sign_object({"sha256": sha256, "node": identity})


# --- media (audio a request sent) ---------------------------------------------------------------------------


def media_put(source: BinaryIO) -> tuple[str, int]:
    """Keep an uploaded media file in the blobs by its sha256 (once: the same file again is not stored twice).
    Returns (sha256, size)."""
    staged = _uploads() / f"media-{uuid.uuid4().hex}"
    try:
        sha256 = _copy_hashing(source, staged)
        size = staged.stat().st_size
        if blob_path(sha256).exists():
            staged.unlink()
            os.utime(blob_path(sha256))  # its age is since a request last sent it (media_purge)
        else:
            os.replace(staged, blob_path(sha256))
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    return sha256, size


def media_ref(*, sha256: str, size: int) -> dict[str, object]:
    """How a generation names a media blob to its node: by hash, with where and the grant to fetch it once."""
    return {"sha256": sha256, "size": size, "path": blob_url_path(sha256), "grant": blob_grant(sha256=sha256)}


def media_purge(*, retention_days: int) -> int:
    """Delete the media blobs no request sent for `retention_days` (0 keeps them forever); returns how many.

    A blob a registry model names is a model file and stays. A running transcription's blob stays too: media_put
    sets a blob's time each time a request sends it, and a transcription lasts minutes, not days."""
    if retention_days <= 0 or not blob_dir().is_dir():
        return 0
    cutoff = time.time() - retention_days * 86400
    models = set(Model.objects.values_list("sha256", flat=True))
    return sum(_unlink(path) for path in blob_dir().iterdir()
               if SHA256_RE.fullmatch(path.name) and path.name not in models and _mtime(path) < cutoff)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # another run took it meanwhile
        return math.inf


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def model_grant_open(*, grant: str, sha256: str) -> Path:
    """The blob a grant allows pulling. Raises GrantRefused with the reason."""
    try:
        granted = signing.TimestampSigner(salt=GRANT_SALT).unsign_object(grant, max_age=settings.FLEET_PULL_GRANT_S)
    except signing.SignatureExpired:
        raise GrantRefused("the pull grant has expired; the node asks the head for a new one") from None
    except signing.BadSignature:
        raise GrantRefused("the pull grant is not one this head signed") from None
    if not SHA256_RE.fullmatch(sha256) or granted.get("sha256") != sha256:
        raise GrantRefused("the pull grant is for another file")
    return blob_path(sha256)
