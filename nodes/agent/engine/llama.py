"""The batched llama.cpp engine: one model, one context, every lane decoded in one `llama_decode` per step.

Lanes are llama sequence ids; the context holds `lanes * window` KV cells, a stream of `window` per lane.
Each step packs every busy lane's work — prompt chunks and next tokens together — into one reused batch,
checks its sizes (llama.cpp aborts the whole process on some malformed batches), decodes once and samples
each lane with its own sampler chain.
"""

from __future__ import annotations

import ctypes
import math
import os
from typing import Any

import llama_cpp as L
import numpy as np

from nodes.agent import gpu
from nodes.agent.engine.base import (
    EngineConfig,
    EngineError,
    EngineLoadError,
    StateOpError,
)
from nodes.agent.engine.kv_payload import KvHeader
from nodes.agent.engine.kv_transfer import KV_OPS, KvTransferEngine
from nodes.agent.engine.lora import LoraAdapters
from nodes.agent.engine.model import LoadedModel
from nodes.agent.engine.park import LaneParking
from nodes.agent.engine.runs import Run
from nodes.agent.engine.sampling import LaneSampler, accept_resume, build_sampler, token_logprobs
from nodes.agent.engine.scheduler import Lane, Sample, Work
from nodes.agent.engine.sequences import SequenceStates
from nodes.agent.engine.vision import ImagePrompt, Vision
from nodes.link.codes import ErrorCode
from nodes.link.spec import GenerateSpec

DEFAULT_WINDOW = 2048


def context_settings(batch_invariant: bool) -> dict[str, Any]:
    """The context settings for a node's engine.

    Both keep one KV stream per lane (a unified cache mixes lanes inside one attention matmul, and the lane
    design needs each lane's own `window` cells). By default flash attention is left to llama.cpp ("auto": on
    wherever the device and model support it, as llama-server does): 10-15% faster at 4 and 8 generations and
    in prompt reading, but its kernels change with the batch's size, so a greedy generation's tokens can depend on
    what else shares its batch. `batch_invariant` turns it off: measured on CPU, the only settings where a lane's
    greedy output equals a solo run's.
    """
    flash = L.LLAMA_FLASH_ATTN_TYPE_DISABLED if batch_invariant else L.LLAMA_FLASH_ATTN_TYPE_AUTO
    return {"unified_kv": False, "flash_attn": flash}


class DecodeBatch:
    """A llama_batch over numpy arrays we own, so filling a prompt chunk is a slice copy, not a loop of
    ctypes stores. Every token belongs to exactly one sequence (n_seq_id is always 1). What one `llama_decode`
    reads, not the link's `TokenBatch` message (nodes.link.messages), which carries a generation's new tokens."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        # seq_id[i] points at seq[i]: one sequence id per token, set by writing `seq`.
        stride = self.seq.itemsize
        self.seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *[ctypes.cast(self.seq.ctypes.data + i * stride, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)]
        )
        self.batch = L.llama_batch()
        self.batch.token = self.token.ctypes.data_as(ctypes.POINTER(L.llama_token))
        self.batch.embd = None
        self.batch.pos = self.pos.ctypes.data_as(ctypes.POINTER(L.llama_pos))
        self.batch.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.batch.seq_id = self.seq_ptrs
        self.batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def add(self, tokens: list[int], pos: int, seq: int, want_last: bool) -> int:
        """Append tokens at positions pos.. of sequence `seq`; returns the index of the last one."""
        n, k = self.n, len(tokens)
        if n + k > self.capacity:
            raise EngineError(ErrorCode.ENGINE_FAILED, f"batch overflow: {n + k} tokens > {self.capacity}")
        self.token[n : n + k] = tokens
        self.pos[n : n + k] = np.arange(pos, pos + k, dtype=np.int32)
        self.seq[n : n + k] = seq
        self.logits[n : n + k] = 0
        self.logits[n + k - 1] = 1 if want_last else 0
        self.n = n + k
        return n + k - 1


class LlamaEngine(KvTransferEngine):
    """Continuous batching over llama.cpp with per-lane samplers and prefix reuse."""

    engine_name = "llama.cpp"

    def __init__(self, config: EngineConfig, on_progress: Any = None) -> None:
        from nodes.agent.vocab import tokenizer_fingerprint

        if not config.model_path:
            raise ValueError("the llama.cpp engine needs a model_path")
        self.model = LoadedModel(config.model_path, on_progress, config.gpu_layers, config.split_mode,
                                 config.tensor_split)
        # the GPUs this worker's build sees (CUDA_VISIBLE_DEVICES applied): asked here, where the engine holds them
        self.gpus = gpu.build_gpus() if config.gpu_layers else []
        window = config.max_context or min(self.model.n_ctx_train or DEFAULT_WINDOW, DEFAULT_WINDOW)
        n_batch = max(config.n_batch, config.lanes)
        self.threads = config.threads or len(os.sched_getaffinity(0))
        self.settings = context_settings(config.batch_invariant)
        self.ctx = self.model.new_context(window * config.lanes, config.lanes, n_batch, self.threads, **self.settings)
        if L.llama_n_ctx_seq(self.ctx) < window:
            raise EngineLoadError(f"llama.cpp gave each lane {L.llama_n_ctx_seq(self.ctx)} tokens, not {window}")
        self.mem = L.llama_get_memory(self.ctx)
        self.lora = LoraAdapters(self.model.model)
        for name, path in config.adapters.items():
            self.lora.load(name, path)
        self.vision = Vision(config.mmproj_path, self.model.model, self.threads) if config.mmproj_path else None
        self._image_prompts: dict[str, ImagePrompt] = {}  # gen_id -> its images, for generations that have some
        super().__init__(config, window, L.llama_n_batch(self.ctx))
        self.batch = DecodeBatch(self.n_batch)
        self._embed_ctx: Any = None
        self.parking = LaneParking(config.park_dir, self.model, self.ctx) if config.park_dir else None
        self._unparked: set[int] = set()
        self.warm_lanes = self.parking.restore(self.lanes, self.window) if self.parking is not None else 0
        self.tokenizer = tokenizer_fingerprint(self.model.path)
        self.sequences = SequenceStates(self.ctx, self.model, config.lanes, self.tokenizer)

    def info(self) -> dict[str, Any]:
        return {
            "model_name": self.config.model_name or os.path.basename(self.model.path),
            "context_window": self.window,
            "lanes": len(self.lanes),
            "capabilities": {
                "chat": bool(self.model.chat_template),
                "completion": True,
                "embeddings": True,
                "grammar": True,
                "logprobs": True,
                "lora": True,
                "batch_invariant": self.config.batch_invariant,
                "vision": self.vision is not None,
                **{f"lora:{name}": True for name in sorted(self.lora.loaded)},
            },
            "engine": "llama.cpp",
            "engine_version": L.__version__,
            "tokenizer": self.tokenizer,  # its fingerprint: the head keys prompts with the same tokenizer
            "model_path": self.model.path,
            "n_ctx_train": self.model.n_ctx_train,
            "n_batch": self.n_batch,
            "threads": self.threads,
            "flash_attn": {L.LLAMA_FLASH_ATTN_TYPE_AUTO: "auto", L.LLAMA_FLASH_ATTN_TYPE_DISABLED: "off"}.get(
                self.settings["flash_attn"], "on"),
            "warm_lanes": self.warm_lanes,  # lanes restored from the park directory at start
            # the generations whose prefixes those lanes hold (the head's index keeps what they put there)
            "warm_generations": sorted({gen for lane in self.lanes for gen, _ in lane.holders}),
            "device": self.device(),
        }

    def device(self) -> dict[str, Any]:
        """What this worker runs on (nodes.link.device), each GPU's memory as it is now."""
        build = gpu.build_gpus(memory=True) if self.gpus else []
        return gpu.engine_report(build=build, gpu_layers=self.config.gpu_layers, n_layer=self.model.n_layer,
                                 host=self.config.host_gpus).to_wire()

    def close(self) -> None:
        if self.ctx is None:
            return
        self.preparing.close()
        self.idle_work()
        for lane in self.lanes:
            if lane.run is not None:
                self._release_run(lane.run)
        for ctx in (self._embed_ctx, self.ctx):
            if ctx:
                L.llama_free(ctx)
        self.lora.close()
        if self.vision is not None:
            self.vision.close()
        self._embed_ctx = self.ctx = None
        self.model.close()

    # -- admission ------------------------------------------------------------------------------------

    def _prepare(self, spec: GenerateSpec, submitted_at: float) -> Run:
        images = spec.images()
        if images:
            return self._prepare_images(spec, submitted_at, [part["image"] for part in images])
        if spec.messages is not None:
            prompt = self.model.tokenize(self.model.render_chat(spec.messages), False, True)
        else:
            prompt = self.model.tokenize(spec.prompt or "", True, True)
        if not prompt:
            raise EngineError(ErrorCode.INVALID_REQUEST, "the prompt is empty")
        return self._run_for(spec, prompt, submitted_at)

    def _prepares_beside(self, spec: GenerateSpec) -> bool:
        # images go through the projector, which shares the model's context: those stay on the engine's thread
        return (spec.grammar is not None or spec.json_schema is not None) and not spec.images()

    def _run_for(self, spec: GenerateSpec, prompt: list[int], submitted_at: float) -> Run:
        """The run of a tokenized prompt: the resume tokens after it, its window checked, its sampler built."""
        resume = resume_tokens(self.model, spec)
        tokens = prompt + resume
        if len(tokens) + 1 > self.window:
            extra = f" ({len(resume)} of them already generated)" if resume else ""
            raise EngineError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt is {len(tokens)} tokens{extra} but this model's context window is {self.window} "
                f"tokens, and at least one must remain for the answer; shorten the prompt",
            )
        sampler = build_sampler(self.model, spec)
        try:
            accept_resume(sampler, resume)
        except EngineError:
            sampler.free()
            raise
        run = self._new_run(spec, tokens, submitted_at, sampler)
        run.continue_after([self.model.piece(t) for t in resume])
        return run

    def _prepare_images(self, spec: GenerateSpec, submitted_at: float, images: list[dict[str, Any]]) -> Run:
        """A chat with images: its prompt through the projector (nodes.agent.engine.vision), then as any prompt."""
        if self.vision is None:
            raise EngineError(ErrorCode.INVALID_REQUEST, "this node has no multimodal projector (start it with "
                              "node_join --mmproj PATH) and cannot read images")
        prompt = self.vision.prompt(self.model.render_chat(spec.messages or []), images)
        try:
            run = self._run_for(spec, prompt.tokens, submitted_at)
        except EngineError:
            prompt.close()
            raise
        self._image_prompts[spec.gen_id] = prompt
        return run

    def _forced(self, run: Run, text: str, room: int) -> list[int]:
        ids = self.model.tokenize(text, False, True)  # special: a thinking model's </think> is one token of its own
        accept_resume(run.sampler, ids if len(ids) <= room else [])  # penalties and seeded draws go on past them
        return ids if len(ids) <= room else []

    def _release_run(self, run: Run) -> None:
        if isinstance(run.sampler, LaneSampler):
            run.sampler.free()
        prompt = self._image_prompts.pop(run.gen_id, None)
        if prompt is not None:
            prompt.close()

    def _chunk_end(self, run: Run, start: int, budget: int) -> int:
        """An image's tokens are a chunk of their own (embedded and decoded whole, outside the shared batch); text
        before an image ends its chunk there."""
        prompt = self._image_prompts.get(run.gen_id)
        for span in prompt.spans if prompt is not None else ():
            if span.start <= start < span.end:
                return span.end
            if start < span.start < start + budget:
                return span.start
        return start + budget

    def _trim_lane(self, lane: Lane, keep: int) -> None:
        if not L.llama_memory_seq_rm(self.mem, lane.index, keep, -1):
            # A partial removal can fail (never for a whole sequence): start the lane from scratch instead.
            L.llama_memory_seq_rm(self.mem, lane.index, -1, -1)
            raise EngineError(ErrorCode.ENGINE_FAILED, f"could not trim lane {lane.index} to {keep} tokens")

    def _copy_lane(self, source: Lane, lane: Lane, keep: int) -> None:
        # Lanes are separate KV streams, and llama.cpp copies across streams whole: the copy is queued and done
        # at the start of the next llama_decode, before that batch is read, so `source` may be mid-generation
        # (its first `keep` positions are fixed). What the copy brings past `keep` is dropped at once.
        L.llama_memory_seq_rm(self.mem, lane.index, -1, -1)
        L.llama_memory_seq_cp(self.mem, source.index, lane.index, -1, -1)
        self._trim_lane(lane, keep)

    def _swap_lanes(self, a: Lane, b: Lane) -> bool:
        return self.sequences.swap(a, b)

    def _kv_identity(self) -> dict[str, Any]:
        return self.sequences.identity()

    def _kv_read(self, lane: Lane, n: int) -> bytes | None:
        return self.sequences.read_prefix(lane, n)

    def _kv_write(self, lane: Lane, data: memoryview, header: KvHeader) -> dict[str, Any] | None:
        return self.sequences.write_prefix(lane, data, header)

    def adapter_names(self) -> set[str]:
        return set(self.lora.loaded)

    def load_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter while serving; requests may name it from the next submit on."""
        self.lora.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Free a LoRA adapter no queued or running generation uses, and forget the lanes computed under it."""
        sets = [run.adapters for run in [*self.queue, *(lane.run for lane in self.lanes if lane.run)]]
        users = [key for key in sets + self.preparing.adapter_sets() if any(n == name for n, _ in key)]
        if users:
            raise EngineError(ErrorCode.ADAPTER_IN_USE, f"LoRA adapter {name!r} is in use by {len(users)} "
                              "generation(s); unload it when they end")
        self.lora.unload(self.ctx, name)
        for lane in self.lanes:
            if any(n == name for n, _ in lane.adapters):
                self._trim_lane(lane, 0)
                lane.tokens, lane.holders, lane.adapters = [], [], ()

    def _lane_idle(self, lane: Lane) -> None:
        if self.parking is not None:
            self._unparked.add(lane.index)

    def idle_work(self) -> None:
        """Park lanes that went idle since the last call. Writing a lane's KV costs time proportional to
        its tokens, so it happens while the engine has nothing to decode, never inside a step."""
        if self.parking is None:
            return
        for index in sorted(self._unparked):
            lane = self.lanes[index]
            # a restart restores lanes as the base model's, and without the images a lane's placeholders stand for
            if lane.run is None and not lane.adapters and min(lane.tokens, default=0) >= 0:
                self.parking.park(lane)
        self._unparked.clear()

    # -- the step -------------------------------------------------------------------------------------

    def _decode(self, works: list[Work]) -> dict[int, Sample]:
        for work in works:
            if work.tokens and work.tokens[0] < 0:
                self._decode_image(work)
        works = [work for work in works if work.tokens and work.tokens[0] >= 0]
        if not works:
            return {}
        total = sum(len(w.tokens) for w in works)
        if total > self.n_batch:
            raise EngineError(ErrorCode.ENGINE_FAILED, f"a step of {total} tokens exceeds n_batch {self.n_batch}")
        batch = self.batch
        batch.clear()
        outputs: list[tuple[Work, int]] = []
        # In lane order: llama.cpp puts only sequences whose ids follow one another, in batch order, into one pass
        for work in sorted(works, key=lambda item: item.lane.index):
            if work.pos != len(work.lane.tokens) or work.pos + len(work.tokens) > self.window:
                raise EngineError(ErrorCode.ENGINE_FAILED, f"lane {work.lane.index} would read past its window")
            index = batch.add(work.tokens, work.pos, work.lane.index, work.sample)
            if work.sample:
                outputs.append((work, index))
        batch.batch.n_tokens = batch.n
        self.lora.apply(self.ctx, works[0].lane.run.adapters if works[0].lane.run else ())
        rc = L.llama_decode(self.ctx, batch.batch)
        if rc != 0:
            raise EngineError(ErrorCode.ENGINE_FAILED, f"llama_decode failed with code {rc}")
        return {work.lane.index: self._sample(work.lane.run, index) for work, index in outputs}

    def _decode_image(self, work: Work) -> None:
        """One image chunk (see _chunk_end) into its lane's sequence, on its own."""
        run = work.lane.run
        prompt = self._image_prompts.get(run.gen_id) if run is not None else None
        span = next((s for s in prompt.spans if s.start == work.pos), None) if prompt is not None else None
        if self.vision is None or span is None or span.end != work.pos + len(work.tokens) or work.sample:
            raise EngineError(ErrorCode.ENGINE_FAILED, f"lane {work.lane.index} was given part of an image")
        if work.pos != len(work.lane.tokens) or span.end > self.window:
            raise EngineError(ErrorCode.ENGINE_FAILED, f"lane {work.lane.index} would read past its window")
        self.lora.apply(self.ctx, run.adapters)
        self.vision.decode(self.ctx, span, work.lane.index, self.n_batch)

    def _sample(self, run: Run | None, index: int) -> Sample:
        assert run is not None
        try:
            token_id = run.sampler.sample(self.ctx, index, self.model.n_vocab)
        except EngineError as exc:
            return exc
        logprob = None
        if run.spec.logprobs:
            # Sampling copies the logits, so these are still the model's own, untouched by bias or grammar.
            logprob = token_logprobs(self.model, self.ctx, index, token_id, run.spec.top_logprobs)
        return token_id, logprob

    def _piece(self, token_id: int) -> bytes:
        return self.model.piece(token_id)

    def _is_eog(self, token_id: int) -> bool:
        return token_id in self.model.eog_ids

    # -- state operations -----------------------------------------------------------------------------

    def state_op(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "tokenize":
            return {"tokens": self.model.tokenize(str(args.get("text", "")), True, True)}
        if op == "detokenize":
            return {"text": self.model.detokenize([int(t) for t in args.get("tokens", [])])}
        if op == "embed":
            texts = args.get("texts")
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise StateOpError(ErrorCode.INVALID_REQUEST, "embed needs `texts`, a list of strings")
            embedded = [self._embed(text) for text in texts]
            return {"embeddings": [vector for vector, _ in embedded], "prompt_tokens": sum(n for _, n in embedded),
                    "model": self.info()["model_name"]}
        if op == "capabilities":
            return self.info()["capabilities"]
        if op in ("lora_load", "lora_unload"):
            return self._adapter_op(op, args)
        if op in KV_OPS:
            return self.kv_state_op(op, args)
        raise StateOpError(ErrorCode.UNKNOWN_OP, f"this engine has no state operation {op!r}")

    def _adapter_op(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """A deployment's LoRA adapter loaded or unloaded while serving; answers the capabilities after it."""
        try:
            if op == "lora_load":
                self.load_adapter(str(args.get("name", "")), str(args.get("path", "")))
            else:
                self.unload_adapter(str(args.get("name", "")))
        except EngineError as exc:
            raise StateOpError(exc.code, exc.message) from None
        except EngineLoadError as exc:
            raise StateOpError(ErrorCode.ENGINE_FAILED, str(exc)) from None
        return {"capabilities": self.info()["capabilities"]}

    def _embed(self, text: str) -> tuple[list[float], int]:
        """Mean-pooled, L2-normalised embedding from a second context on the same model, and its token count."""
        if self._embed_ctx is None:
            self._embed_ctx = self.model.new_context(self.window, 1, self.window, self.threads, embeddings=True)
        tokens = self.model.tokenize(text, True, False)
        if not tokens:
            raise StateOpError(ErrorCode.INVALID_REQUEST, "cannot embed an empty text")
        if len(tokens) > self.window:
            raise StateOpError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"a text is {len(tokens)} tokens; the embedding window is {self.window}",
            )
        L.llama_memory_clear(L.llama_get_memory(self._embed_ctx), True)
        batch = DecodeBatch(len(tokens))
        batch.add(tokens, 0, 0, True)
        batch.logits[: len(tokens)] = 1  # pooling reads every token's output
        batch.batch.n_tokens = batch.n
        rc = L.llama_decode(self._embed_ctx, batch.batch)
        if rc != 0:
            raise StateOpError(ErrorCode.ENGINE_FAILED, f"llama_decode failed with code {rc} while embedding")
        vector = np.ctypeslib.as_array(L.llama_get_embeddings_seq(self._embed_ctx, 0), shape=(self.model.n_embd,))
        norm = math.sqrt(float(np.dot(vector, vector))) or 1.0
        return [float(x) / norm for x in vector], len(tokens)


def resume_tokens(model: LoadedModel, spec: GenerateSpec) -> list[int]:
    """The tokens another node already generated: their exact ids when the head sends them, else the resume text
    tokenized."""
    if spec.resume_ids:
        if not all(isinstance(t, int) and 0 <= t < model.n_vocab for t in spec.resume_ids):
            raise EngineError(ErrorCode.INVALID_REQUEST, "resume_ids holds a token id outside the vocabulary")
        return list(spec.resume_ids)
    return model.tokenize(spec.resume_text, False, False) if spec.resume_text else []
