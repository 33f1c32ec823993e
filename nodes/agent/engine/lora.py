"""LoRA adapters loaded on a llama.cpp model, and the set its context runs with (see `adapters`)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import llama_cpp as L

from nodes.agent.engine.adapters import AdapterKey
from nodes.agent.engine.base import EngineError, EngineLoadError
from nodes.link.codes import ErrorCode


class LoraAdapters:
    """The adapters loaded on one llama.cpp model, by name, and the set the context runs with now."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.loaded: dict[str, Any] = {}
        self.paths: dict[str, str] = {}
        self.active: AdapterKey = ()

    def load(self, name: str, path: str) -> None:
        if name in self.loaded:
            raise EngineLoadError(f"a LoRA adapter named {name!r} is already loaded")
        if not Path(path).is_file():
            raise EngineLoadError(f"LoRA adapter {name!r}: no file at {path}")
        adapter = L.llama_adapter_lora_init(self.model, str(path).encode())
        if not adapter:
            raise EngineLoadError(f"llama.cpp could not load {path} as a LoRA adapter for this model (not a GGUF "
                                  "LoRA, or made for another architecture or shape)")
        self.loaded[name], self.paths[name] = adapter, str(path)

    def unload(self, ctx: Any, name: str) -> None:
        """Free an adapter. The caller makes sure no running or queued generation uses it."""
        if name not in self.loaded:
            raise EngineError(ErrorCode.INVALID_REQUEST, f"this node has no LoRA adapter {name!r}")
        self.apply(ctx, ())  # the context must not point at an adapter that is freed
        L.llama_adapter_lora_free(self.loaded.pop(name))
        self.paths.pop(name)

    def apply(self, ctx: Any, key: AdapterKey) -> None:
        """Make the context run with exactly `key`'s adapters."""
        if key == self.active:
            return
        n = len(key)
        adapters = (L.llama_adapter_lora_p_ctypes * max(n, 1))(*[self.loaded[name] for name, _ in key])
        scales = (ctypes.c_float * max(n, 1))(*[scale for _, scale in key])
        rc = L.llama_set_adapters_lora(ctx, adapters if n else None, n, scales if n else None)
        if rc != 0:
            raise EngineError(ErrorCode.ENGINE_FAILED, f"llama.cpp could not set the LoRA adapters ({rc})")
        self.active = key

    def close(self) -> None:
        for adapter in self.loaded.values():
            L.llama_adapter_lora_free(adapter)
        self.loaded.clear()
