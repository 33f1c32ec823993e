"""`--park`: lanes' KV caches kept on disk so a restarted node starts warm.

Each idle lane is written with `llama_state_seq_save_file` (its KV cells plus its token list) next to a
small JSON sidecar naming the model it belongs to; on start, files for the same model are read back into
their lanes. Writes go to a temporary name and are renamed, so a crash mid-write leaves the old file.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
from typing import Any

import llama_cpp as L

from nodes.agent.engine.model import LoadedModel
from nodes.agent.engine.scheduler import Lane

log = logging.getLogger(__name__)


class LaneParking:
    """Saves and restores lane KV state under `park_dir`."""

    def __init__(self, park_dir: str, model: LoadedModel, ctx: Any) -> None:
        self.dir = park_dir
        self.model = model
        self.ctx = ctx
        os.makedirs(park_dir, exist_ok=True)
        stat = os.stat(model.path)
        self.identity = {
            "model": os.path.abspath(model.path),
            "size": stat.st_size,
            "mtime": int(stat.st_mtime),
            "llama_cpp": L.__version__,
        }
        self._saved: dict[int, tuple[int, ...]] = {}  # lane -> tokens last written, to skip rewrites

    def _paths(self, index: int) -> tuple[str, str]:
        base = os.path.join(self.dir, f"lane-{index}")
        return base + ".kv", base + ".json"

    def park(self, lane: Lane) -> None:
        """Write the lane's KV cache and token list, unless the files already hold exactly these tokens."""
        tokens = tuple(lane.tokens)
        if not tokens or self._saved.get(lane.index) == tokens:
            return
        kv_path, meta_path = self._paths(lane.index)
        array = (L.llama_token * len(tokens))(*tokens)
        if not L.llama_state_seq_save_file(self.ctx, (kv_path + ".tmp").encode(), lane.index, array, len(tokens)):
            log.warning("could not park lane %s to %s", lane.index, kv_path)
            return
        meta = {**self.identity, "tokens": len(tokens), "holders": lane.holders}
        with open(meta_path + ".tmp", "w") as fh:
            json.dump(meta, fh)
        os.replace(kv_path + ".tmp", kv_path)
        os.replace(meta_path + ".tmp", meta_path)
        self._saved[lane.index] = tokens

    def restore(self, lanes: list[Lane], window: int) -> int:
        """Read parked lanes back; returns how many came back. Files for another model are ignored."""
        restored = 0
        for lane in lanes:
            tokens = self._load(lane.index, window)
            if tokens:
                lane.tokens = tokens
                lane.holders = self._holders(lane.index)
                self._saved[lane.index] = tuple(tokens)
                restored += 1
        return restored

    def _load(self, index: int, window: int) -> list[int]:
        kv_path, meta_path = self._paths(index)
        try:
            with open(meta_path) as fh:
                meta = json.load(fh)
        except (OSError, ValueError):
            return []
        if any(meta.get(k) != v for k, v in self.identity.items()) or not 0 < meta.get("tokens", 0) < window:
            return []
        capacity = window
        tokens = (L.llama_token * capacity)()
        count = ctypes.c_size_t(0)
        read = L.llama_state_seq_load_file(self.ctx, kv_path.encode(), index, tokens, capacity, ctypes.byref(count))
        if not read or count.value != meta["tokens"]:
            L.llama_memory_seq_rm(L.llama_get_memory(self.ctx), index, -1, -1)
            return []
        return list(tokens[: count.value])

    def _holders(self, index: int) -> list[tuple[str, int]]:
        with contextlib.suppress(OSError, ValueError), open(self._paths(index)[1]) as fh:
            return [(str(g), int(n)) for g, n in json.load(fh).get("holders", [])]
        return []
