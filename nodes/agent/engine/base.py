"""The engine interface shared by the llama.cpp engine, the mock engine and the worker process.

An engine owns `lanes` decode slots over one model. The worker drives it: `submit` admits a generation,
`step` runs one decode step over every busy lane, and both return events, which are the node-link's own typed
messages (nodes.link.messages): `Accepted`, `TokenBatch`, `Done` and `Error`. The worker pipes them to the agent
and the agent puts them on the link as they are; there is no second vocabulary of event dicts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from nodes.link.codes import FinishReason
from nodes.link.messages import Accepted, Done, Error, TokenBatch
from nodes.link.spec import GenerateSpec

Event = Accepted | TokenBatch | Done | Error
ENDS = (Done, Error)  # the events that end a generation

# Finish reasons a `done` event carries.
FINISH_STOP = FinishReason.STOP.value
FINISH_LENGTH = FinishReason.LENGTH.value
FINISH_CANCELLED = FinishReason.CANCELLED.value
FINISH_DEADLINE = FinishReason.DEADLINE.value

# Error codes an `error` event carries: nodes.link.codes.ErrorCode, which the head imports too.


@dataclass
class EngineConfig:
    """How to build one engine. Plain values only: it crosses into the worker process as a dict."""

    model_path: str | None = None
    model_name: str = ""
    lanes: int = 8
    max_context: int | None = None  # per-lane context window; default min(n_ctx_train, 2048)
    n_batch: int = 512
    threads: int | None = None
    park_dir: str | None = None
    mock: dict[str, Any] | None = None  # when set, a MockEngine with these parameters
    cpu_affinity: list[int] | None = None
    env: dict[str, str] = field(default_factory=dict)  # applied in the worker before loading
    flush_tokens: int = 4
    flush_ms: float = 30.0
    # Today's slower settings that make a greedy generation's tokens independent of what shares its batch
    # (no flash attention); off by default, when llama.cpp's fastest settings are used (`node_join --batch-invariant`).
    batch_invariant: bool = False
    # A speech model served beside the text model (`node_join --transcribe`): a CTranslate2 Whisper folder, run by
    # faster-whisper in this same worker process (nodes.agent.engine.speech).
    speech_model_path: str | None = None
    speech_model_name: str = ""
    # LoRA adapters loaded with the model at start (`node_join --lora NAME=PATH`): name -> GGUF LoRA path.
    adapters: dict[str, str] = field(default_factory=dict)
    # The model's multimodal projector (`node_join --mmproj`): a GGUF mmproj file read by llama.cpp's mtmd, so chats
    # may hold images (nodes.agent.engine.vision).
    mmproj_path: str | None = None
    # llama.cpp's n_gpu_layers: -1 all the model's layers on the GPUs the build sees, 0 none (`node_join --cpu`, or a
    # host without a GPU), N the first N (`--gpu-layers`). The agent sets it from nodes.agent.gpu.offload_plan.
    gpu_layers: int = -1
    # Over several GPUs (`--split-mode`, `--tensor-split`; nodes.agent.gpu.OffloadPlan): "" llama.cpp's default
    # (layer), and each GPU's share of the model (empty: llama.cpp splits by free memory).
    split_mode: str = ""
    tensor_split: list[float] = field(default_factory=list)
    # The host's GPU names (nvidia-smi, ...), for the engine's device report: a CPU engine beside them is flagged.
    host_gpus: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        return cls(**data)


class EngineError(Exception):
    """A generation the engine refuses; becomes an `error` event with `code`."""

    def __init__(self, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable


class StateOpError(Exception):
    """A state operation (embed, tokenize, ...) that failed; carries a code for the head."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class EngineLoadError(RuntimeError):
    """The engine could not load its model (bad path, bad file, out of memory, worker died)."""


class Engine(Protocol):
    """What the worker needs from an engine. All methods run on the worker's one thread."""

    def info(self) -> dict[str, Any]: ...

    def submit(self, spec: GenerateSpec) -> list[Event]: ...

    def cancel(self, gen_id: str) -> list[Event]: ...

    def step(self) -> list[Event]: ...

    def busy(self) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    def state_op(self, op: str, args: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


def accepted_event(
    gen_id: str, prompt_tokens: int, cached_tokens: int, lane: int, evicted: list[str] | None = None
) -> Accepted:
    """`evicted`: the generations whose cached prompts this one's lane choice discarded (`done` repeats them)."""
    return Accepted(gen_id=gen_id, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, lane=lane,
                    evicted=list(evicted or []))


def tokens_event(gen_id: str, seq: int, text: list[str], ids: list[int], logprobs: list[dict] | None) -> TokenBatch:
    return TokenBatch(gen_id=gen_id, seq=seq, text=text, ids=ids, logprobs=logprobs)


def error_event(gen_id: str, code: str, message: str, retryable: bool = False) -> Error:
    return Error(gen_id=gen_id, code=code, message=message, retryable=retryable)
