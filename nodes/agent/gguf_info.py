"""What a GGUF file says about itself: architecture, quantization, trained context, chat template, KV bytes per token.

Read with the `gguf` package's reader, which memory-maps the file, so only the header's pages are read: a model of
any size costs the reader almost no memory. Shared by the head (the registry) and the node (sizing its window), so
it imports nothing from Django.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

GGUF_MAGIC = b"GGUF"
F16_BYTES = 2  # the engine's KV cache holds K and V as f16


class GgufError(Exception):
    """The file is not a GGUF model this fleet can serve; the message says what is wrong."""


@dataclass(frozen=True)
class GgufInfo:
    architecture: str
    quantization: str
    context_length: int  # the trained context (`<arch>.context_length`)
    kv_bytes_per_token: int
    chat_template: str
    size: int
    # "model"; "adapter": a LoRA adapter (general.type "adapter"); "projector": a multimodal projector (a CLIP GGUF,
    # general.architecture "clip"). Neither of the last two has a context or KV of its own.
    kind: str = "model"
    blocks: int = 0  # `<arch>.block_count`: its repeating layers (llama.cpp offloads one more, the output layer)


def _attachment(reader: Any, arch: str, size: int) -> GgufInfo | None:
    """A LoRA adapter's or a projector's facts; None for a model."""
    if arch == "clip":
        if not _value(reader, "clip.has_vision_encoder"):
            raise GgufError("it is a CLIP file without a vision encoder; only image projectors (mmproj) are served")
        kind = "projector"
    elif _value(reader, "general.type") == "adapter":
        if (lora := _value(reader, "adapter.type")) != "lora":
            raise GgufError(f"it is an adapter of type {lora!r}; only LoRA adapters (adapter.type \"lora\") are served")
        kind = "adapter"
    else:
        return None
    return GgufInfo(architecture=arch, quantization=_quantization(reader), context_length=0, kv_bytes_per_token=0,
                    chat_template="", size=size, kind=kind)


def _value(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        return None
    value = field.contents()
    return value.tolist() if hasattr(value, "tolist") else value


def _required_int(reader: Any, key: str) -> int:
    value = _value(reader, key)
    if isinstance(value, list):  # some architectures give a figure per layer
        value = max(value) if value else None
    if not isinstance(value, int) or value <= 0:
        raise GgufError(f"its metadata lacks {key!r} (needed to size the KV cache)")
    return value


def kv_bytes_per_token(reader: Any, arch: str) -> int:
    """K and V of one token in every layer, as f16: n_layer x n_head_kv x (key + value head dims) x 2 bytes."""
    layers = _required_int(reader, f"{arch}.block_count")
    heads = _required_int(reader, f"{arch}.attention.head_count")
    kv_heads = _value(reader, f"{arch}.attention.head_count_kv")
    per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads or heads] * layers
    head_dim = _required_int(reader, f"{arch}.embedding_length") // heads
    key_dim = _value(reader, f"{arch}.attention.key_length") or head_dim
    value_dim = _value(reader, f"{arch}.attention.value_length") or head_dim
    return sum(int(n) for n in per_layer[:layers]) * (key_dim + value_dim) * F16_BYTES


def _quantization(reader: Any) -> str:
    from gguf import GGMLQuantizationType, LlamaFileType

    file_type = _value(reader, "general.file_type")
    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        pass
    # No file type: name it after the type most of the weights' bytes have.
    sizes: dict[int, int] = {}
    for tensor in reader.tensors:
        sizes[tensor.tensor_type] = sizes.get(tensor.tensor_type, 0) + int(tensor.n_bytes)
    return GGMLQuantizationType(max(sizes, key=sizes.get)).name if sizes else "unknown"


def _reader(path: str | os.PathLike, size: int) -> Any:
    """gguf's reader, checking before it maps the tensors that the file holds them all (else numpy fails to reshape
    a short slice, and the message would not say the file is truncated)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

    class Reader(GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int):
            # gguf walks an array item by item, a numpy view each: 9 s for a 49,152-token vocabulary. We need no
            # array's items (only their sizes), so a scalar array is one slice and a string array is skipped over.
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            offs = orig_offs + 12
            kind = GGUFValueType(int(item_type[0]))
            scalar = self.gguf_scalar_to_np.get(kind)
            if scalar is not None:
                items = self._get(offs, scalar, int(count[0]))
                return 12 + int(items.nbytes), [item_type, count, items], [2], [GGUFValueType.ARRAY, kind]
            if kind != GGUFValueType.STRING:
                return super()._get_field_parts(orig_offs, raw_type)
            raw = memoryview(self.data)
            for _ in range(int(count[0])):
                offs += 8 + int.from_bytes(raw[offs:offs + 8], "little")
            return offs - orig_offs, [item_type, count], [], [GGUFValueType.ARRAY, GGUFValueType.STRING]

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            end = start_offs
            for field in fields:
                _, _, _, dims, raw_dtype, offset = field.parts
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
                n_elements = 1
                for dim in dims.tolist():
                    n_elements *= int(dim)
                end = max(end, start_offs + int(offset[0]) + n_elements * type_size // block)
            if end > size:
                raise GgufError(f"it is truncated: its tensors need {end} bytes, the file has {size}")
            super()._build_tensors(start_offs, fields)

    return Reader(path)


def read_gguf(path: str | os.PathLike) -> GgufInfo:
    """The model's facts from its own metadata. Raises GgufError saying what is wrong (not GGUF, truncated, ...)."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise GgufError(f"it is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        reader = _reader(path, size)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as exc:
        # The reader fails with whatever numpy says when the header runs past the end of the file.
        raise GgufError(f"its header is unreadable, truncated or corrupt ({exc})") from None
    arch = _value(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GgufError("its metadata names no architecture (general.architecture)")
    if (attachment := _attachment(reader, arch, size)) is not None:
        return attachment
    context = _required_int(reader, f"{arch}.context_length")
    template = _value(reader, "tokenizer.chat_template")
    return GgufInfo(architecture=arch, quantization=_quantization(reader), context_length=context,
                    kv_bytes_per_token=kv_bytes_per_token(reader, arch), size=size,
                    chat_template=template if isinstance(template, str) else "",
                    blocks=_required_int(reader, f"{arch}.block_count"))


FINGERPRINT_SPAN = 1 << 20  # bytes read from each end of the file


def file_fingerprint(path: str | os.PathLike) -> str:
    """A model file's identity, cheap at any size: the SHA-256 of its size and its first and last MiB (a GGUF's
    header and tensor index, and the tail of its data). Two nodes with the same file send the same, whatever they
    named it; the head renames a node's model only to a name served from the same file (nodes.services)."""
    import hashlib

    size = os.path.getsize(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(FINGERPRINT_SPAN))
        if size > FINGERPRINT_SPAN:
            f.seek(max(size - FINGERPRINT_SPAN, FINGERPRINT_SPAN))
            digest.update(f.read(FINGERPRINT_SPAN))
    return digest.hexdigest()
