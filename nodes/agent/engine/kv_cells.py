"""One lane's KV cells as llama.cpp serializes a sequence (`llama_state_seq_get_data`), cut to a prefix and rewritten
for another context's stream count.

Why parse it: each lane is a KV stream of its own, and llama.cpp copies between streams only at the next decode, so
there is no scratch sequence to copy a lane into and trim before reading it. The state is simple to cut instead, and
cutting it reads nothing of the lane's cache but what was serialized. Its layout (llama-kv-cache.cpp `state_write`,
the vendored llama.cpp of llama-cpp-python 0.3.36), all little-endian:

    u32 magic, i32 seq_id, u32 n_stream, then for each stream: u32 cell_count, and when it is not 0:
      cell_count x (i32 pos, u32 n_seq_id (1), [12-byte cell ext: M-RoPE and PLE models], n_seq_id x i32 seq_id)
      u32 v_trans, u32 n_layer
      n_layer x (i32 k_type, u64 k_row_bytes, cell_count rows)
      v_trans 0: n_layer x (i32 v_type, u64 v_row_bytes, cell_count rows)
      v_trans 1: n_layer x (i32 v_type, u32 v_elem_bytes, u32 n_embd_v, n_embd_v x cell_count elements)

A sequence's state fills one stream (its own); the others say 0 cells. Reading it back, llama.cpp wants as many
streams as its own context has, and puts the cells in the destination sequence's stream whichever one they came in.
Anything that does not parse to exactly these bytes (a hybrid, recurrent or sliding-window model's memory, another
llama.cpp) is refused by `parse`, never guessed at.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

SEQ_MAGIC = 0xAF143CD8  # llama-context.cpp `io_magic`
CELL_EXT_BYTES = 12  # llama_kv_cell_ext: x, y, tok


class CellsError(ValueError):
    """Bytes that are not one sequence's KV cells in the layout above."""


@dataclass
class Layer:
    """One layer's K (or V) as serialized: its ggml type, then the cells' rows, or (transposed V) `n_embd` runs of
    per-cell elements."""

    type: int
    unit: int  # bytes per row (or per element, transposed)
    data: np.ndarray  # uint8: (cells, unit), or transposed (n_embd, cells, unit)
    n_embd: int = 0  # transposed V only


@dataclass
class SeqCells:
    """One sequence's cells: their positions, optional ext, and each layer's K and V."""

    pos: np.ndarray  # int32, one per cell
    ext: np.ndarray | None  # uint8 (cells, CELL_EXT_BYTES), or None
    v_trans: bool
    keys: list[Layer]
    values: list[Layer]

    @property
    def count(self) -> int:
        return len(self.pos)

    def types(self) -> tuple[set[int], set[int]]:
        return {layer.type for layer in self.keys}, {layer.type for layer in self.values}

    def prefix(self, n: int) -> SeqCells | None:
        """The cells of positions 0..n-1, in position order; None when these cells do not hold each of them once."""
        order = np.argsort(self.pos, kind="stable")
        order = order[self.pos[order] < n]
        if len(order) != n or not np.array_equal(self.pos[order], np.arange(n, dtype=np.int32)):
            return None
        return SeqCells(self.pos[order], None if self.ext is None else self.ext[order], self.v_trans,
                        [_take(layer, order) for layer in self.keys], [_take(layer, order) for layer in self.values])

    def holds_positions(self, n: int) -> bool:
        """Whether these are exactly the cells of positions 0..n-1, in that order."""
        return self.count == n and np.array_equal(self.pos, np.arange(n, dtype=np.int32))

    def to_bytes(self, n_stream: int, seq_id: int = 0) -> bytes:
        """These cells as llama.cpp reads a sequence's state back into a context of `n_stream` streams."""
        if not self.count:
            return struct.pack("<IiI", SEQ_MAGIC, seq_id, n_stream) + b"\0\0\0\0" * n_stream
        meta = np.zeros(self.count, dtype=[("pos", "<i4"), ("n_seq", "<u4")] +
                        ([("ext", "V12")] if self.ext is not None else []) + [("seq", "<i4")])
        meta["pos"], meta["n_seq"], meta["seq"] = self.pos, 1, seq_id
        if self.ext is not None:
            meta["ext"] = self.ext.view("V12").reshape(-1)
        parts = [struct.pack("<IiII", SEQ_MAGIC, seq_id, n_stream, self.count), meta.tobytes(),
                 struct.pack("<II", int(self.v_trans), len(self.keys))]
        for layer in self.keys:
            parts += [struct.pack("<iQ", layer.type, layer.unit), layer.data.tobytes()]
        for layer in self.values:
            head = struct.pack("<iII", layer.type, layer.unit, layer.n_embd) if self.v_trans else \
                struct.pack("<iQ", layer.type, layer.unit)
            parts += [head, layer.data.tobytes()]
        parts.append(b"\0\0\0\0" * (n_stream - 1))  # the other streams: 0 cells each
        return b"".join(parts)


def _take(layer: Layer, order: np.ndarray) -> Layer:
    data = layer.data[:, order] if layer.n_embd else layer.data[order]
    return Layer(layer.type, layer.unit, np.ascontiguousarray(data), layer.n_embd)


def parse(buf: bytes | bytearray | memoryview) -> SeqCells:
    """The one sequence `buf` holds; raises CellsError when it is anything else."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    errors: list[str] = []
    for has_ext in (False, True):
        try:
            return _parse(raw, has_ext)
        except (CellsError, struct.error, ValueError) as exc:
            errors.append(str(exc))
    raise CellsError(f"not one sequence's KV cells ({'; '.join(errors)})")


class _Reader:
    def __init__(self, raw: np.ndarray) -> None:
        self.raw, self.at = raw, 0

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.raw):
            raise CellsError("cut short")
        values = struct.unpack_from(fmt, self.raw, self.at)
        self.at += size
        return values

    def take(self, n: int) -> np.ndarray:
        if n < 0 or self.at + n > len(self.raw):
            raise CellsError("cut short")
        block = self.raw[self.at : self.at + n]
        self.at += n
        return block


def _parse(raw: np.ndarray, has_ext: bool) -> SeqCells:
    reader = _Reader(raw)
    magic, _seq, n_stream = reader.unpack("<IiI")
    if magic != SEQ_MAGIC:
        raise CellsError(f"magic {magic:#x}, not llama.cpp's sequence state {SEQ_MAGIC:#x}")
    found: SeqCells | None = None
    for _ in range(n_stream):
        (count,) = reader.unpack("<I")
        if not count:
            continue
        if found is not None:
            raise CellsError("cells in more than one stream")
        found = _stream(reader, count, has_ext)
    if reader.at != len(raw):
        raise CellsError(f"{len(raw) - reader.at} bytes after the cells")
    if found is None:
        return SeqCells(np.zeros(0, dtype=np.int32), None, False, [], [])
    return found


def _stream(reader: _Reader, count: int, has_ext: bool) -> SeqCells:
    dtype = np.dtype([("pos", "<i4"), ("n_seq", "<u4")] + ([("ext", "V12")] if has_ext else []) + [("seq", "<i4")])
    meta = reader.take(count * dtype.itemsize).view(dtype)
    if not np.all(meta["n_seq"] == 1):
        raise CellsError("a cell of another sequence")
    ext = meta["ext"].view(np.uint8).reshape(count, CELL_EXT_BYTES).copy() if has_ext else None
    v_trans, n_layer = reader.unpack("<II")
    keys = [_rows(reader, count) for _ in range(n_layer)]
    values = [_transposed(reader, count) if v_trans else _rows(reader, count) for _ in range(n_layer)]
    return SeqCells(meta["pos"].astype(np.int32), ext, bool(v_trans), keys, values)


def _rows(reader: _Reader, count: int) -> Layer:
    kind, row = reader.unpack("<iQ")
    return Layer(kind, row, reader.take(count * row).reshape(count, row))


def _transposed(reader: _Reader, count: int) -> Layer:
    kind, elem, n_embd = reader.unpack("<iII")
    return Layer(kind, elem, reader.take(n_embd * count * elem).reshape(n_embd, count, elem), n_embd)
