"""Lanes' KV caches through host memory, for the llama.cpp engine: two idle lanes swapped, and a lane's prompt prefix
read out for export and written in on import (nodes.agent.engine.kv_transfer).

Each goes through llama.cpp's serialized sequence state (`llama_state_seq_get_data` / `set_data`): a queued
cross-stream `seq_cp` can neither swap two lanes (the second copy would overwrite the first) nor be trimmed before it
is read, since llama.cpp makes it only at the next decode. A prefix is cut out of the state itself
(nodes.agent.engine.kv_cells).
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp as L

from nodes.agent.engine import kv_cells
from nodes.agent.engine.kv_payload import KvHeader, PayloadError
from nodes.agent.engine.kv_transfer import refused
from nodes.agent.engine.model import LoadedModel
from nodes.agent.engine.scheduler import Lane
from nodes.link.codes import KvRefusal

GGML_TYPE_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 20: "iq4_nl", 30: "bf16"}


class SequenceStates:
    """The lanes of one context (`n_lanes` sequences, a KV stream each) as llama.cpp serializes them."""

    def __init__(self, ctx: Any, model: LoadedModel, n_lanes: int, tokenizer: str) -> None:
        self.ctx, self.mem, self.model, self.n_lanes, self.tokenizer = ctx, L.llama_get_memory(ctx), model, n_lanes, \
            tokenizer
        # LoadedModel.new_context keeps llama.cpp's default cache types
        params = L.llama_context_default_params()
        self.kv_types = (int(params.type_k), int(params.type_v))
        self._identity: dict[str, Any] | None = None

    def state(self, lane: Lane) -> ctypes.Array | None:
        """The lane's KV as llama.cpp serializes one sequence; None for an empty lane."""
        if not lane.tokens:
            return None
        size = L.llama_state_seq_get_size(self.ctx, lane.index)
        state = (ctypes.c_uint8 * size)()
        return state if L.llama_state_seq_get_data(self.ctx, state, size, lane.index) == size else None

    def swap(self, a: Lane, b: Lane) -> bool:
        """Exchange two idle lanes' KV, a memcpy each way; False: it failed and both lanes are empty."""
        states = [self.state(a), self.state(b)]
        ok = all(state is not None or not lane.tokens for lane, state in zip((a, b), states, strict=True))
        for lane, state in ((a, states[1]), (b, states[0])):
            L.llama_memory_seq_rm(self.mem, lane.index, -1, -1)
            if ok and state is not None and not L.llama_state_seq_set_data(self.ctx, state, len(state), lane.index):
                ok = False
        if not ok:
            for lane in (a, b):
                L.llama_memory_seq_rm(self.mem, lane.index, -1, -1)
        return ok

    # -- prefixes leaving and arriving ----------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        """What a payload's cells were computed with (KvTransferEngine._kv_identity)."""
        if self._identity is None:
            from nodes.agent.gguf_info import file_fingerprint

            kv = {"type_k": type_name(self.kv_types[0]), "type_v": type_name(self.kv_types[1])}
            self._identity = {"model": file_fingerprint(self.model.path), "engine": "llama.cpp", "kv": kv,
                              "engine_version": L.__version__, "tokenizer": self.tokenizer,
                              "n_layer": self.model.n_layer}
        return self._identity

    def read_prefix(self, lane: Lane, n: int) -> bytes | None:
        """The cells of the lane's first `n` positions as a one-stream state; None when the lane's cache lacks one."""
        state = self.state(lane)
        if state is None:
            return None
        try:
            cells = kv_cells.parse(memoryview(state).cast("B"))
        except kv_cells.CellsError as exc:
            raise PayloadError(KvRefusal.UNSUPPORTED, f"this model's KV cache cannot be cut to a prefix: {exc}") \
                from None
        prefix = cells.prefix(n)
        return None if prefix is None else prefix.to_bytes(n_stream=1)

    def write_prefix(self, lane: Lane, data: memoryview, header: KvHeader) -> dict[str, Any] | None:
        """A payload's cells into the empty `lane`; a refusal, the lane left empty, when they are not what the header
        names or llama.cpp will not read them."""
        try:
            cells = kv_cells.parse(data)
        except kv_cells.CellsError as exc:
            return refused(KvRefusal.CORRUPT, f"the payload's data is not llama.cpp's KV cells: {exc}")
        if not cells.holds_positions(len(header.tokens)):
            return refused(KvRefusal.CORRUPT, f"the payload's cells are not positions 0..{len(header.tokens) - 1}")
        if cells.types() != ({self.kv_types[0]}, {self.kv_types[1]}):
            return refused(KvRefusal.CORRUPT, "the payload's cells are not of the K/V types its header names")
        blob = cells.to_bytes(n_stream=self.n_lanes, seq_id=lane.index)
        buffer = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        if not L.llama_state_seq_set_data(self.ctx, buffer, len(blob), lane.index):
            L.llama_memory_seq_rm(self.mem, lane.index, -1, -1)
            return refused(KvRefusal.REJECTED, "llama.cpp refused the payload's cells (a KV layout of other context "
                           "settings: flash attention on one node and off on the other?)")
        return None


def type_name(ggml_type: int) -> str:
    return GGML_TYPE_NAMES.get(int(ggml_type), f"ggml_type_{int(ggml_type)}")
