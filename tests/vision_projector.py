"""A tiny multimodal projector for the bundled SmolLM2, written at test time with the `gguf` writer, and test images.

No small vision model is available offline, so this is a LLaVA-style CLIP file (`clip.projector_type = mlp`) with
random weights: a 56x56 image in 14x14 patches (16 image tokens), a two-layer ViT of width 32 (llama.cpp's LLaVA graph
runs all but the last), and the two-layer MLP projector (`mm.0`, `mm.2`) whose output width is the text model's
n_embd (576), as mtmd requires. It proves the path (an image decoded, embedded, its tokens counted and a stream
returned) and nothing about what a real model would say about the image.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import gguf
import numpy as np

from nodes.agent.engine.local import bundled_model_path

IMAGE_SIZE, PATCH, WIDTH, FF, LAYERS = 56, 14, 32, 64, 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2


def _text_width() -> int:
    base = gguf.GGUFReader(bundled_model_path())
    arch = str(base.fields["general.architecture"].contents())
    return int(base.fields[f"{arch}.embedding_length"].contents())


def build_projector(path: Path, *, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)

    def weights(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    n_embd = _text_width()
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("general.name", "fleet test projector (random weights)")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH)
    writer.add_uint32("clip.vision.embedding_length", WIDTH)
    writer.add_uint32("clip.vision.feed_forward_length", FF)
    writer.add_uint32("clip.vision.projection_dim", n_embd)
    writer.add_uint32("clip.vision.block_count", LAYERS)
    writer.add_uint32("clip.vision.attention.head_count", 2)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_bool("clip.use_gelu", True)
    # numpy shapes are ggml's reversed: a weight of ne [n_in, n_out] is (n_out, n_in)
    writer.add_tensor("v.patch_embd.weight", weights(WIDTH, 3, PATCH, PATCH))
    writer.add_tensor("v.position_embd.weight", weights(IMAGE_TOKENS, WIDTH))
    for il in range(LAYERS):
        for name, shape in (("attn_q", (WIDTH, WIDTH)), ("attn_k", (WIDTH, WIDTH)), ("attn_v", (WIDTH, WIDTH)),
                            ("attn_out", (WIDTH, WIDTH)), ("ffn_up", (FF, WIDTH)), ("ffn_down", (WIDTH, FF))):
            writer.add_tensor(f"v.blk.{il}.{name}.weight", weights(*shape))
            writer.add_tensor(f"v.blk.{il}.{name}.bias", weights(shape[0]))
        for norm in ("ln1", "ln2"):
            writer.add_tensor(f"v.blk.{il}.{norm}.weight", np.ones(WIDTH, dtype=np.float32))
            writer.add_tensor(f"v.blk.{il}.{norm}.bias", np.zeros(WIDTH, dtype=np.float32))
    writer.add_tensor("mm.0.weight", weights(n_embd, WIDTH))
    writer.add_tensor("mm.0.bias", weights(n_embd))
    writer.add_tensor("mm.2.weight", weights(n_embd, n_embd))
    writer.add_tensor("mm.2.bias", weights(n_embd))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def png(width: int = 32, height: int = 24, seed: int = 0) -> bytes:
    """A small RGB PNG of random pixels (zlib and struct only: the tests need no image library)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
