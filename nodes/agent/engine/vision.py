"""Images in chats: the model's multimodal projector (`node_join --mmproj`) through llama.cpp's mtmd.

A chat with images is rendered by the model's template with IMAGE_MARKER where each image goes; mtmd then splits the
prompt into text chunks (tokenized as usual) and image chunks (the image decoded, resized and embedded by the
projector). In the lane engine's token list an image chunk is `n_tokens` copies of one negative id derived from the
image's sha256, so prefix reuse works across images as across text: the same image at the same place is the same
tokens (its KV is reused, and a conversation's next turn does not embed it again), another image is other tokens.
An image chunk is evaluated on its own (mtmd's helper decodes its embeddings into the lane's sequence), never split
and never in the shared batch; the text around it joins the batch as any prompt does. Image tokens count in
`prompt_tokens`. Projectors with M-RoPE positions (Qwen2-VL and kin) are refused at load: their positions are not
one a token.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as L

from nodes.agent.engine.base import EngineError, EngineLoadError
from nodes.link.codes import ErrorCode

log = logging.getLogger("nodes.agent")

# Where an image goes in the rendered prompt; the rendered text must hold exactly one a image.
IMAGE_MARKER = "<__fleet_image__>"
_CHUNK_TEXT, _CHUNK_IMAGE = 0, 1


@dataclass
class ImageSpan:
    """One image's tokens in a run's prompt: positions start..end, and the mtmd chunk that embeds them."""

    start: int
    end: int
    chunk: Any


@dataclass
class ImagePrompt:
    """A chat prompt with images: its token list (images as placeholder ids), their spans, and the mtmd chunks
    they point into (freed with `close`)."""

    tokens: list[int]
    spans: list[ImageSpan] = field(default_factory=list)
    chunks: Any = None

    def close(self) -> None:
        if self.chunks is not None:
            from llama_cpp import mtmd_cpp as M

            M.mtmd_input_chunks_free(self.chunks)
            self.chunks = None


def image_token(sha256: str) -> int:
    """The placeholder id of an image's tokens: negative (never a vocabulary id), the same for the same image."""
    return -1 - int(sha256[:7] or "0", 16)


_GGML_LOG_LEVEL_ERROR = 4


@L.llama_log_callback
def _log_errors(level: int, text: bytes, _data: Any) -> None:
    """mtmd logs every image it reads at info level; a node keeps its errors only (as for llama.cpp's own log)."""
    if level >= _GGML_LOG_LEVEL_ERROR and text:
        log.error("llama.cpp mtmd: %s", text.decode("utf-8", errors="replace").rstrip())


class Vision:
    """The mtmd context of a model's projector, and the prompts it makes."""

    def __init__(self, path: str, model: Any, threads: int) -> None:
        from llama_cpp import mtmd_cpp as M

        self.M = M
        M.mtmd_log_set(_log_errors, None)
        M.mtmd_helper_log_set(_log_errors, None)
        params = M.mtmd_context_params_default()
        params.n_threads = threads
        params.print_timings = False
        params.warmup = False
        self.ctx = M.mtmd_init_from_file(path.encode(), model, params)
        if not self.ctx:
            raise EngineLoadError(f"llama.cpp could not load the multimodal projector {path!r} for this model (is it "
                                  "the model's own mmproj GGUF? the node's log has llama.cpp's reason)")
        if not M.mtmd_support_vision(self.ctx):
            self.close()
            raise EngineLoadError(f"the projector {path!r} has no vision encoder")
        if M.mtmd_decode_use_mrope(self.ctx):
            self.close()
            raise EngineLoadError(f"the projector {path!r} places image tokens with M-RoPE, which this engine does "
                                  "not support yet")

    def close(self) -> None:
        if self.ctx:
            self.M.mtmd_free(self.ctx)
            self.ctx = None

    def prompt(self, text: str, images: list[dict[str, Any]]) -> ImagePrompt:
        """`text` (the rendered chat, IMAGE_MARKER where each image goes) with `images` (their blobs, with
        `local_path` and `sha256`) as tokens and image spans. Raises EngineError for an image the decoder refuses."""
        pieces = text.split(IMAGE_MARKER)
        if len(pieces) != len(images) + 1:
            raise EngineError(ErrorCode.INVALID_REQUEST, f"the prompt holds {len(pieces) - 1} image places for "
                              f"{len(images)} images; do not write {IMAGE_MARKER} in a message")
        bitmaps = [self._bitmap(i, image) for i, image in enumerate(images)]
        try:
            return self._tokenize(pieces, bitmaps, images)
        finally:
            for bitmap in bitmaps:
                self.M.mtmd_bitmap_free(bitmap)

    def _bitmap(self, index: int, image: dict[str, Any]) -> Any:
        bitmap = self.M.mtmd_helper_bitmap_init_from_file(self.ctx, str(image.get("local_path", "")).encode(), False)
        if not bitmap:
            raise EngineError(ErrorCode.INVALID_REQUEST, f"image {index + 1} of the chat could not be decoded (a "
                              f"damaged or cut-off {image.get('format') or 'image'} file); send a valid PNG, JPEG, "
                              "GIF or BMP")
        return bitmap

    def _tokenize(self, pieces: list[str], bitmaps: list[Any], images: list[dict[str, Any]]) -> ImagePrompt:
        M = self.M
        keep: list[Any] = []  # the ctypes objects the parts point at, alive until mtmd_tokenize returns
        parts = []
        for i, piece in enumerate(pieces):
            if piece:
                data = piece.encode("utf-8")
                text = M.mtmd_input_text(data, len(data), False, True)
                keep += [data, text]
                parts.append(M.mtmd_input_part(ctypes.pointer(text), None))
            if i < len(bitmaps):
                parts.append(M.mtmd_input_part(None, bitmaps[i]))
        array = (ctypes.POINTER(M.mtmd_input_part) * len(parts))(*[ctypes.pointer(p) for p in parts])
        chunks = M.mtmd_input_chunks_init()
        rc = M.mtmd_tokenize_from_parts(self.ctx, chunks, array, len(parts), False)
        if rc != 0:
            M.mtmd_input_chunks_free(chunks)
            raise EngineError(ErrorCode.INVALID_REQUEST, f"the projector could not read the chat's images (mtmd "
                              f"code {rc})")
        prompt = ImagePrompt(tokens=[], chunks=chunks)
        ids = iter(image_token(str(image.get("sha256", ""))) for image in images)
        for index in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, index)
            if M.mtmd_input_chunk_get_type(chunk) == _CHUNK_TEXT:
                n = ctypes.c_size_t(0)
                tokens = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                prompt.tokens.extend(tokens[: n.value])
            elif M.mtmd_input_chunk_get_type(chunk) == _CHUNK_IMAGE:
                n_tokens = M.mtmd_input_chunk_get_n_tokens(chunk)
                start = len(prompt.tokens)
                prompt.tokens.extend([next(ids)] * n_tokens)
                prompt.spans.append(ImageSpan(start, start + n_tokens, chunk))
        return prompt

    def decode(self, lctx: Any, span: ImageSpan, seq: int, n_batch: int) -> None:
        """Embed the image and decode its embeddings into sequence `seq` at the span's positions."""
        new_past = L.llama_pos(0)
        rc = self.M.mtmd_helper_eval_chunk_single(self.ctx, lctx, span.chunk, span.start, seq, n_batch, False,
                                                  ctypes.byref(new_past))
        if rc != 0:
            raise EngineError(ErrorCode.ENGINE_FAILED, f"llama.cpp could not embed an image (code {rc})")
