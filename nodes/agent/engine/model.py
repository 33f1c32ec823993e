"""The loaded GGUF model on llama.cpp's low-level API: vocabulary, chat template, contexts.

Everything here talks to `llama_cpp` through ctypes; the engine never uses the high-level `Llama`
class, so one model serves the batched decode context and the embedding context alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Callable
from typing import Any

import llama_cpp as L

from nodes.agent.engine.base import EngineError, EngineLoadError
from nodes.agent.engine.vision import IMAGE_MARKER
from nodes.link.codes import ErrorCode

# llama.cpp logs every tensor at load; keep only its errors.
logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)

_META_BUF = 1 << 16
SPLIT_MODES = {"none": L.LLAMA_SPLIT_MODE_NONE, "layer": L.LLAMA_SPLIT_MODE_LAYER, "row": L.LLAMA_SPLIT_MODE_ROW}


def model_params(gpu_layers: int = -1, split_mode: str = "", tensor_split: tuple[float, ...] | list[float] = ()):
    """llama.cpp's model parameters for a load, and the ctypes array they point into (keep it while they live)."""
    params = L.llama_model_default_params()
    # The CPU backend repacks weights into AMX tiles when the CPU reports AMX, but VMs that do not grant
    # the tile state (XTILEDATA) then die on SIGILL at the first decode. Plain buffers work everywhere.
    params.use_extra_bufts = False
    params.n_gpu_layers = gpu_layers  # -1: all (llama.cpp's default), 0: none
    if split_mode:
        params.split_mode = SPLIT_MODES[split_mode]
    shares = None
    if tensor_split:
        shares = (ctypes.c_float * L.llama_max_devices())(*tensor_split)
        params.tensor_split = shares
    return params, shares


class LoadedModel:
    """One GGUF model and its vocabulary, with the helpers the engine needs around them."""

    def __init__(self, path: str, on_progress: Callable[[float], Any] | None = None, gpu_layers: int = -1,
                 split_mode: str = "", tensor_split: tuple[float, ...] | list[float] = ()) -> None:
        if not os.path.isfile(path):
            raise EngineLoadError(f"could not load the model: no file at {path!r}")
        L.llama_backend_init()
        params, self._shares = model_params(gpu_layers, split_mode, tensor_split)
        if on_progress is not None:
            # Kept on self: ctypes must not collect the callback while llama.cpp still holds it.
            self._progress_cb = L.llama_progress_callback(lambda p, _data: _report(on_progress, p))
            params.progress_callback = self._progress_cb
        self.model = L.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise EngineLoadError(f"llama.cpp could not load the model file {path!r} (is it a valid GGUF?)")
        self.path = path
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = L.llama_model_n_ctx_train(self.model)
        self.n_embd = L.llama_model_n_embd(self.model)
        self.n_layer = L.llama_model_n_layer(self.model)
        self.eog_ids = frozenset(t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t))
        self._pieces: dict[int, bytes] = {}
        self.chat_template = self.meta("tokenizer.chat_template")
        self._formatter: Any = None

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(_META_BUF)
        n = L.llama_model_meta_val_str(self.model, key.encode(), buf, _META_BUF)
        return None if n < 0 else buf.value.decode("utf-8", errors="replace")

    def close(self) -> None:
        if self.model:
            L.llama_model_free(self.model)
            self.model = None

    # -- text -----------------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (L.llama_token * capacity)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:  # too small a buffer: -n is the size needed
            capacity = -n
            buf = (L.llama_token * capacity)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token_id: int) -> bytes:
        """The bytes a token adds to the output (control tokens add nothing)."""
        cached = self._pieces.get(token_id)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = L.llama_token_to_piece(self.vocab, token_id, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = L.llama_token_to_piece(self.vocab, token_id, buf, -n, 0, False)
            cached = self._pieces[token_id] = buf.raw[:n]
        return cached

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        raw = L.llama_vocab_get_text(self.vocab, token_id)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The chat rendered with the GGUF's own template, ending with the assistant's turn opened."""
        if not self.chat_template:
            raise EngineError(ErrorCode.INVALID_REQUEST, "this model has no chat template; send a raw prompt instead")
        if self._formatter is None:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            self._formatter = Jinja2ChatFormatter(
                template=self.chat_template,
                eos_token=self.token_text(L.llama_vocab_eos(self.vocab)),
                bos_token=self.token_text(L.llama_vocab_bos(self.vocab)),
                add_generation_prompt=True,
            )
        try:
            return self._formatter(messages=[_plain_message(m) for m in messages]).prompt
        except Exception as exc:  # a template raises on messages it does not accept (roles, order)
            raise EngineError(ErrorCode.INVALID_REQUEST,
                              f"the model's chat template rejected the messages: {exc}") from exc

    # -- contexts -------------------------------------------------------------------------------------

    def new_context(
        self,
        n_ctx: int,
        n_seq: int,
        n_batch: int,
        threads: int,
        embeddings: bool = False,
        unified_kv: bool = False,
        flash_attn: int = L.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    ) -> Any:
        params = L.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_seq_max = n_seq
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        # Without a unified KV cache each sequence gets its own stream of n_ctx / n_seq cells.
        params.kv_unified = unified_kv
        params.flash_attn_type = flash_attn
        if embeddings:
            params.embeddings = True
            params.pooling_type = L.LLAMA_POOLING_TYPE_MEAN
        ctx = L.llama_init_from_model(self.model, params)
        if not ctx:
            raise EngineLoadError(f"llama.cpp could not create a context of {n_ctx} tokens (out of memory?)")
        return ctx


def _report(on_progress: Callable[[float], Any], fraction: float) -> bool:
    with contextlib.suppress(Exception):  # a progress report must never abort the load
        on_progress(float(fraction))
    return True


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts flattened to the plain string chat templates expect (an image part becomes IMAGE_MARKER,
    where the engine puts the image's tokens)."""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(IMAGE_MARKER if part.get("type") == "image" else part.get("text", "")
                       for part in content if isinstance(part, dict))
        return {**message, "content": text}
    if content is None:
        return {**message, "content": ""}
    return message
