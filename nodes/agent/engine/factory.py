"""The engine factory: which engine a node's configuration asks for, built in this process.

It lives apart from the interface (`base`), which every engine imports: the factory imports the engines, so with
it in `base` the interface and each engine imported each other.
"""

from __future__ import annotations

from typing import Any

from nodes.agent.engine.base import Engine, EngineConfig


def create_engine(config: EngineConfig, on_progress: Any = None) -> Engine:
    """Build the engine `config` asks for: the mock when `config.mock` is set, none for a node that serves a speech
    model alone (its worker's Transcriber does the work), else llama.cpp."""
    if config.model_path is None and config.mock is None and config.speech_model_path:
        from nodes.agent.engine.speech import SpeechOnlyEngine

        return SpeechOnlyEngine(config)
    if config.mock is not None:
        from nodes.agent.engine.mock import MockEngine

        return MockEngine(config, on_progress=on_progress)
    from nodes.agent.engine.llama import LlamaEngine

    return LlamaEngine(config, on_progress=on_progress)
