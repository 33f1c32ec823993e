"""The node's engine: batched llama.cpp decoding (or a mock) in a worker process of its own.

`EngineWorker` is what the agent uses; `create_engine` builds an engine in-process (tests, benchmarks).
Nothing here imports Django.
"""

from nodes.agent.engine.base import (
    Engine,
    EngineConfig,
    EngineError,
    EngineLoadError,
    Event,
    StateOpError,
)
from nodes.agent.engine.factory import create_engine
from nodes.agent.engine.worker import EngineWorker

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineLoadError",
    "EngineWorker",
    "Event",
    "StateOpError",
    "create_engine",
]
