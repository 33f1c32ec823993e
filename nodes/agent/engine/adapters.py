"""A generation's LoRA adapter set, as the scheduler groups steps by it (llama.cpp's side is in `lora`).

llama.cpp applies adapters to a whole context, not to a sequence, so generations with different adapter sets
never share a step: the scheduler groups lanes by their set (`AdapterKey`) and the engine switches the context's
adapters between steps (`llama_set_adapters_lora` does nothing when the set is unchanged). A lane's KV cache was
computed under its set, so prefix reuse only matches lanes of the same set.
"""

from __future__ import annotations

import math
from typing import Any

from nodes.agent.engine.base import EngineError
from nodes.link.codes import ErrorCode

# A generation's adapters: (name, scale) pairs sorted by name; () is the base model alone.
AdapterKey = tuple[tuple[str, float], ...]

MAX_SCALE = 16.0


def adapter_key(lora: list[Any] | None, loaded: set[str]) -> AdapterKey:
    """The request's adapter set, checked against the adapters this node has; EngineError names what is wrong."""
    pairs: dict[str, float] = {}
    for item in lora or []:
        name, scale = (item[0], item[1]) if isinstance(item, list | tuple) and len(item) == 2 else (None, None)
        if not isinstance(name, str) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise EngineError(ErrorCode.INVALID_REQUEST, "lora must be a list of [name, scale] pairs")
        if name not in loaded:
            have = ", ".join(sorted(loaded)) or "none"
            raise EngineError(ErrorCode.INVALID_REQUEST, f"this node has no LoRA adapter {name!r} (it has: {have})")
        if abs(scale) > MAX_SCALE:
            raise EngineError(ErrorCode.INVALID_REQUEST, f"a LoRA scale must be within ±{MAX_SCALE:g}")
        pairs[name] = float(scale)
    return tuple(sorted((name, scale) for name, scale in pairs.items() if scale != 0.0))
