"""A small LoRA adapter for the bundled SmolLM2, written at test time with the `gguf` writer.

Random low-rank weights on the attention's query and value projections of every layer, in llama.cpp's GGUF LoRA
layout: `general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`, and for each base tensor W of
shape (n_in, n_out) a `<W>.lora_a` of shape (n_in, rank) and a `<W>.lora_b` of shape (rank, n_out). It changes
what the model says, which is all a test of the plumbing needs; it was trained on nothing. The weights are scaled
(0.1) so that the model still answers coherently: at 0.3 it babbles in near-tied logits, where llama.cpp's F32 matmul
for the adapter (not bit-identical between a one-token decode and a many-token prefill on AVX-512 CPUs) flips argmax
and the batched-equals-alone check fails for that reason alone (docs/operations.md, LoRA adapters).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from nodes.agent.engine.local import bundled_model_path


def build_adapter(path: Path, *, rank: int = 4, seed: int = 0, scale: float = 0.1, architecture: str = "") -> Path:
    """`architecture`: say the adapter is for another architecture (the registry must refuse it for this base)."""
    base = gguf.GGUFReader(bundled_model_path())
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture or str(base.fields["general.architecture"].contents()))
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    for tensor in base.tensors:
        if tensor.name.endswith(("attn_q.weight", "attn_v.weight")):
            n_in, n_out = int(tensor.shape[0]), int(tensor.shape[1])  # ggml order; numpy's is reversed
            writer.add_tensor(f"{tensor.name}.lora_a", (rng.standard_normal((rank, n_in)) * scale).astype(np.float32))
            writer.add_tensor(f"{tensor.name}.lora_b", (rng.standard_normal((n_out, rank)) * scale).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
