"""A 1 GiB model uploaded to a real head (daphne) in parts through /api/models/: the head's peak memory grows by at
most 64 MB, and the stored file is the uploaded one. The file is a valid GGUF whose one tensor is a sparse 1 GiB of
zeros, so making it costs no disk; every byte of it still crosses the HTTP path."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.slow

MB = 10**6


def sparse_gguf(path: Path, data_bytes: int) -> int:
    """A GGUF file with llama metadata and one f32 tensor of `data_bytes` zeros, left sparse. Returns its size."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(4096)
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_embedding_length(256)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tensor_info("blob.weight", (data_bytes // 4,), np.dtype(np.float32), data_bytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    start = (path.stat().st_size + 31) // 32 * 32  # tensor data starts at the default 32-byte alignment
    with open(path, "r+b") as handle:
        handle.truncate(start + data_bytes)
    return start + data_bytes


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_a_1_gib_upload_raises_the_heads_peak_memory_by_at_most_64_mb(fresh_head, tmp_path):
    head = fresh_head
    path = tmp_path / "big.gguf"
    size = sparse_gguf(path, 1 << 30)
    digest = hashlib.sha256()
    api = httpx.Client(base_url=head.url, headers={"Authorization": f"Bearer {head.api_key}"}, timeout=120)
    pid = head.proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the peak (VmHWM) to the resident size now
    before = status_kb(pid, "VmRSS")
    upload = api.post("/api/models/uploads/").json()
    part = upload["part_max_bytes"]
    with open(path, "rb") as handle:
        while chunk := handle.read(part):
            digest.update(chunk)
            sent = api.put(f"/api/models/uploads/{upload['upload']}/", params={"offset": upload["offset"]},
                           content=chunk, headers={"Content-Type": "application/octet-stream"})
            assert sent.status_code == 200, sent.text
            upload = sent.json()
    created = api.post("/api/models/", json={"name": "big", "upload": upload["upload"]})
    peak = status_kb(pid, "VmHWM")
    assert created.status_code == 201, created.text
    model = created.json()
    assert (model["size"], model["sha256"], model["quantization"]) == (size, digest.hexdigest(), "F32")
    growth_mb = (peak - before) * 1024 / MB
    print(f"head RSS before {before * 1024 / MB:.1f} MB, peak during the upload {peak * 1024 / MB:.1f} MB: "
          f"+{growth_mb:.1f} MB for {size / MB:.0f} MB in {size // part + 1} parts of {part / MB:.1f} MB")
    assert growth_mb <= 64
    assert os.path.getsize(head.home / "blobs" / model["sha256"]) == size
