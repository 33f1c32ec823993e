"""What this head process remembers for on-demand models (fleet.loading): kept on the process's Registry, so tests
make it fresh with the rest of the process state."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class LoadingState:
    waits: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)  # model -> (placed at, seconds waited)
    scaled_at: dict[str, float] = field(default_factory=dict)  # model -> when it last asked for another replica
    placed: dict[tuple[str, str], float] = field(default_factory=dict)  # (node id, model) -> last placement there
    loading_seen: dict[str, float] = field(default_factory=dict)  # model -> when a load of it was last under way
