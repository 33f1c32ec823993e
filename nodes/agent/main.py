"""Running a node: load the model in engine worker(s), then keep a link to the head. Used by `node_join`."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nodes.agent import gpu, keys, pull
from nodes.agent.deploy import Deployer, footprint
from nodes.agent.dialer import BACKOFF_MAX_S, BACKOFF_START_S, AgentConfig, NodeAgent, Refused
from nodes.agent.engine.base import EngineConfig
from nodes.agent.gguf_info import GgufError, read_gguf
from nodes.agent.model_set import ModelSet
from nodes.agent.models import ModelNotFound, is_registry_name, resolve_model, resolve_speech_model
from nodes.agent.preparing import PreparingReports
from nodes.agent.replicas import ReplicaConfigError, ReplicaSet, cpu_groups, gpu_groups
from nodes.agent.window import Window, WindowError, device_memory, mem_available, size_window
from nodes.link import logs, trace
from nodes.link.handshake import BadToken, parse_token
from nodes.link.messages import PullGrant

log = logging.getLogger("nodes.agent")

GRANT_RENEWALS = 20  # grants a pull may outlive before the node gives up (a lapsed grant costs one range again)


@dataclass
class NodeOptions:
    head: str | None
    model: str
    token: str | None = None
    token_source: str = "--token"  # where `token` came from (--token, --token-file PATH, FLEET_TOKEN), for errors
    max_context: int | None = None
    max_batch: int = 8
    identity: str | None = None
    model_name: str | None = None
    offline: bool = False
    park: bool = False
    replicas: int = 1
    gpus: str | None = None
    accept_new_head: bool = False
    batch_invariant: bool = False
    home: Path = field(default_factory=lambda: Path(os.environ.get("FLEET_HOME") or Path.home() / ".fleet"))
    mock: dict | None = None
    labels: dict[str, str] = field(default_factory=dict)
    adapters: dict[str, str] = field(default_factory=dict)  # --lora: adapter name -> GGUF LoRA path
    transcribe: str | None = None  # a speech model served beside the text model: a known id or a CTranslate2 folder
    mmproj: str | None = None  # --mmproj: the model's multimodal projector (GGUF); images in chats need it
    memory_budget: int = 0  # --memory-budget: bytes this node's models may hold (0: the device's free memory)
    on_demand: bool = True  # --no-on-demand: False, the head never loads a model here on demand
    cpu: bool = False  # --cpu: run on the CPU although the host has a GPU
    gpu_layers: int | None = None  # --gpu-layers N: offload the first N layers (default: all when a GPU is used)
    split_mode: str = ""  # --split-mode: how one worker splits its model over several GPUs (llama.cpp's)
    tensor_split: tuple[float, ...] = ()  # --tensor-split: each GPU's share of the model


class NodeError(Exception):
    """A problem the host owner must fix; printed as one line, exit status 2."""


def token_path(home: Path) -> Path:
    return home / "fleet" / "token"


# `manage.py up` hands its own node a token made for that run (id LOCAL_TOKEN_ID) in this variable; never kept.
LOCAL_TOKEN_ENV = "FLEET_LOCAL_NODE_TOKEN"
# A fleet token given in the environment instead of on the command line (where `ps` shows it to every user).
TOKEN_ENV = "FLEET_TOKEN"


def remember_token(options: NodeOptions) -> str:
    """The token to join with: --token or --token-file, else $FLEET_TOKEN (each kept for later runs), else `up`'s
    local one, else the kept one.

    Raises NodeError when there is none or it is malformed, before anything is loaded or dialed.
    """
    path = token_path(options.home)
    token = (options.token or "").strip()
    source = options.token_source
    if not token and os.environ.get(TOKEN_ENV, "").strip():
        token, source = os.environ[TOKEN_ENV].strip(), TOKEN_ENV
        options = replace(options, token=token)
    if not token and os.environ.get(LOCAL_TOKEN_ENV):
        token, source = os.environ[LOCAL_TOKEN_ENV].strip(), LOCAL_TOKEN_ENV
    if not token and path.exists():
        try:
            token, source = path.read_text().strip(), str(path)
        except (OSError, UnicodeDecodeError) as exc:  # a damaged file: say which, not a traceback
            raise NodeError(f"the kept fleet token in {path} is unreadable ({exc}); pass a token with --token, "
                            "which replaces it") from None
    if not token:
        raise NodeError("no fleet token: make one on the head with `manage.py fleet_token` and pass it with "
                        "--token-file PATH, $FLEET_TOKEN or --token")
    try:
        parse_token(token)
    except BadToken as exc:
        raise NodeError(f"the fleet token from {source} is malformed: {exc}") from None
    if options.token:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token + "\n")
        path.chmod(0o600)
    return token


def offload(options: NodeOptions, host: list[gpu.HostGpu] | None = None,
            build: list[gpu.BuildGpu] | None = None) -> gpu.OffloadPlan:
    """How this node's engines load (nodes.agent.gpu): the host's GPUs against the build's, unless given. A mock
    engine runs no llama.cpp: the CPU, with whatever GPUs the host has named in its report. Raises NodeError for a
    host GPU the build cannot use (the line says which `make node GPU=` fixes it)."""
    host = gpu.host_gpus() if host is None else host
    if options.mock is not None:
        return gpu.OffloadPlan("cpu", 0, tuple(g.name for g in host))
    try:
        return gpu.offload_plan(host=host, build=gpu.build_gpus() if build is None else build, cpu=options.cpu,
                                gpu_layers=options.gpu_layers, split_mode=options.split_mode,
                                tensor_split=options.tensor_split)
    except gpu.GpuMismatch as exc:
        raise NodeError(str(exc)) from None


def engine_configs(options: NodeOptions, pulled: Path | None = None,
                   plan: gpu.OffloadPlan | None = None) -> tuple[list[EngineConfig], str, str]:
    """The engine workers' configs, the model's name on the fleet, and why each lane has the window it has."""
    plan = plan or gpu.OffloadPlan("cpu", 0)
    if options.mock is not None:
        path, own_name = None, options.model_name or options.model
    elif pulled is not None:
        path, own_name = pulled, options.model
    elif not options.model:  # a speech model alone (`--transcribe` without `--model`)
        path, own_name = None, resolve_speech_model(options.transcribe or "")[1]
    else:
        path, own_name = resolve_model(options.model)
    name = options.model_name or own_name
    max_context, why = options.max_context, "--max-context"
    if max_context is None and path is not None:
        window = device_window(path, options, plan)
        max_context, why = window.tokens, window.why
    gpus, cpus = gpu_groups(options.replicas, options.gpus), cpu_groups(options.replicas)
    park = str(options.home / "park" / name) if options.park else None
    speech_path, speech_name = resolve_speech_model(options.transcribe) if options.transcribe else (None, "")
    configs = []
    for index in range(options.replicas):
        env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus[index])} if gpus[index] else {}
        configs.append(EngineConfig(
            model_path=str(path) if path else None, model_name=name, lanes=options.max_batch,
            max_context=max_context, park_dir=f"{park}/r{index}" if park else None, mock=options.mock,
            cpu_affinity=cpus[index] if options.replicas > 1 else None, env=env, threads=len(cpus[index]),
            batch_invariant=options.batch_invariant,
            speech_model_path=str(speech_path) if speech_path else None, speech_model_name=speech_name,
            adapters=options.adapters, mmproj_path=options.mmproj, gpu_layers=plan.gpu_layers,
            host_gpus=list(plan.host_gpus), split_mode=plan.split_mode, tensor_split=list(plan.tensor_split),
        ))
    return configs, name, why


def device_window(path: Path, options: NodeOptions, plan: gpu.OffloadPlan) -> Window:
    """Each lane's window from the model's KV bytes a token and the memory free on this device (nodes.agent.window):
    with part of the model on the GPU (`--gpu-layers`), that part against VRAM and the rest against RAM."""
    try:
        info = read_gguf(path)
    except (GgufError, OSError) as exc:
        raise NodeError(f"the model file {str(path)!r} is refused: {exc}") from None
    total = info.blocks + 1
    on_gpu = 0 if plan.gpu_layers == 0 else total if plan.gpu_layers < 0 else min(plan.gpu_layers, total)
    try:
        available, memory = device_memory(offload=on_gpu > 0)
        if memory == "RAM" or on_gpu == total:
            return size_window(kv_bytes_per_token=info.kv_bytes_per_token, trained=info.context_length,
                               lanes=options.max_batch, model_bytes=info.size, available=available,
                               workers=options.replicas, memory=memory)
        return min((size_window(kv_bytes_per_token=max(int(info.kv_bytes_per_token * share), 1),
                                trained=info.context_length, lanes=options.max_batch,
                                model_bytes=int(info.size * share), available=free, workers=options.replicas,
                                memory=f"{kind} ({layers} of {total} layers)")
                    for share, free, kind, layers in ((on_gpu / total, available, "VRAM", on_gpu),
                                                      (1 - on_gpu / total, mem_available(), "RAM", total - on_gpu))),
                   key=lambda w: w.tokens)
    except WindowError as exc:
        raise NodeError(f"{exc}, or pin the window with --max-context") from None


async def pulled_model(options: NodeOptions, asker: NodeAgent,
                       on_progress: Callable[[float], None] | None = None) -> Path:
    """The node's verified copy of registry model `options.model`, pulled from the head when it lacks it
    (`on_progress(fraction)` as it goes, besides the bar)."""
    local = await asyncio.to_thread(pull.local_copy, options.home, options.model)
    if options.offline:
        if local is None:
            folder = pull.model_dir(options.home, options.model)
            raise NodeError(f"model {options.model!r} is not on this node ({folder}) and --offline pulls nothing; "
                            "run node_join once without --offline")
        return local[0]
    answer = await _ask_for_grant(options, asker, keep_trying=local is None)
    if answer is None:
        log.warning("fleet node: no head answered; serving this node's copy of %s", options.model)
        return local[0]
    if local is not None and local[1] == answer[1].sha256:
        return local[0]
    bar = pull.Progress(f"pulling {options.model}", answer[1].size)

    def progress(done: int) -> None:
        bar(done)
        if on_progress is not None:
            on_progress(done / max(answer[1].size, 1))
    for _ in range(GRANT_RENEWALS):
        try:
            return await asyncio.to_thread(pull.pull, pull.http_base(answer[0]), answer[1], options.home, progress)
        except pull.GrantExpired:
            log.info("fleet node: the grant to pull %s expired; asking the head for a new one", options.model)
            answer = await _ask_for_grant(options, asker, keep_trying=True)
        except (pull.PullError, OSError) as exc:
            raise NodeError(f"could not pull {options.model}: {exc}") from None
    raise NodeError(f"could not pull {options.model}: its grant expired {GRANT_RENEWALS} times; raise "
                    "FLEET_PULL_GRANT_S on the head")


async def _ask_for_grant(options: NodeOptions, asker: NodeAgent, *, keep_trying: bool) -> tuple[str, PullGrant] | None:
    """(head, grant) for the model; None when no head answers and `keep_trying` is False. Raises NodeError when the
    head has no such model."""
    delay = BACKOFF_START_S
    while (answer := await asker.request_pull(options.model)) is None and keep_trying:
        log.warning("fleet node: no head answered to pull %s from; retrying in %.0f s", options.model, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, BACKOFF_MAX_S)
    if answer is not None and answer[1].error:
        raise NodeError(answer[1].error)
    return answer


async def _run(options: NodeOptions, resolve_head) -> None:
    from nodes.agent.engine.worker import EngineWorker

    token = remember_token(options)
    plan = await asyncio.to_thread(offload, options)  # a wrong build is refused before anything is pulled or loaded
    log.info("fleet node: runs on %s%s", plan.backend, f" ({plan.gpu_layers} layers offloaded)"
             if plan.gpu_layers > 0 else " (every layer offloaded)" if plan.gpu_layers < 0 else "")
    if options.accept_new_head:
        keys.forget_head(options.home)
    identity = options.identity or AgentConfig.identity_default()
    agent_config = AgentConfig(head=options.head, token=token, home=options.home, identity=identity,
                               labels=options.labels)
    agent: NodeAgent | None = None
    asker = NodeAgent(agent_config, None, resolve_head=resolve_head)
    reports = PreparingReports(asker)  # the live page shows the node on its way in, until it registers
    reports.start()
    try:
        pulled = await pulled_model(options, asker, lambda fraction: reports.set(options.model, "pulling", fraction)
                                    ) if options.mock is None and is_registry_name(options.model) else None
        if options.mmproj and is_registry_name(options.mmproj):  # the head's registry entry for the projector
            options = replace(options, mmproj=str(await pulled_model(replace(options, model=options.mmproj), asker)))
        configs, name, why = engine_configs(options, pulled, plan)

        def forward(index: int):
            def on_event(event):
                if agent is not None:
                    agent.on_engine_event(engine.on_event(index, event) if isinstance(engine, ReplicaSet) else event)
            return on_event

        if pulled is None:
            await asker.check_join()  # a pull asked already
        workers = [EngineWorker(cfg, on_event=forward(i)) for i, cfg in enumerate(configs)]
        engine = ReplicaSet(workers, model_name=name) if len(workers) > 1 else workers[0]
        info = await _load(engine, name, reports)
    finally:
        await reports.stop()
    log.info("fleet node: %s loaded, context window %d tokens (%s), %d lanes", name, info["context_window"], why,
             info["lanes"])
    models = ModelSet(engine)
    agent = NodeAgent(agent_config, models, resolve_head=resolve_head)
    models.forward = agent.on_engine_event
    own = configs[0].model_path
    primary_bytes = footprint(Path(own), lanes=configs[0].lanes, window=info["context_window"]) if own else 0
    agent.deployer = deployer_for(options, agent, models, primary_bytes=primary_bytes * len(configs), plan=plan)
    try:
        await agent.run()
    finally:
        await models.stop()


async def _load(engine, name: str, reports: PreparingReports) -> dict[str, Any]:
    """Start the engine: its load's progress on the terminal's bar and in the reports to the heads."""
    bar = pull.Progress(f"loading {name}", 100, figures=False)
    reports.set(name, "loading")

    def progress(fraction: float) -> None:
        bar(int(fraction * 100))
        reports.set(name, "loading", fraction)
    try:
        info = await engine.start(on_progress=progress)
    except Exception as exc:
        bar.abandon()
        raise NodeError(f"the model could not be loaded: {exc}") from exc
    bar(100)
    return info


def deployer_for(options: NodeOptions, agent: NodeAgent, models: ModelSet, *, primary_bytes: int = 0,
                 plan: gpu.OffloadPlan | None = None) -> Deployer:
    """What applies the head's deployments on this node: pulls as `--model NAME` does, one engine worker a model."""
    from nodes.agent.engine.worker import EngineWorker

    async def fetch(name: str, on_progress: Callable[[float], None]) -> Path:
        return await pulled_model(replace(options, model=name), agent, on_progress)

    return Deployer(models, fetch=fetch, send=agent.send,
                    make_worker=lambda config: EngineWorker(config, on_event=models.on_event),
                    batch_invariant=options.batch_invariant, memory_budget=options.memory_budget,
                    on_demand=options.on_demand, mock=options.mock, primary_bytes=primary_bytes, plan=plan)


def run_node(options: NodeOptions) -> int:
    """Run until stopped. Returns the exit status: 0 when stopped, 2 when the head refused the node."""
    try:
        logs.configure(logs.log_format(os.environ.get("FLEET_LOG_FORMAT")))
    except ValueError as exc:
        sys.stderr.write(f"node_join: {exc}\n")
        return 2
    trace.setup("fleet-node")

    def resolve_head() -> str | list[str] | None:
        if options.head:
            return options.head
        if options.offline:
            return None
        from nodes.agent.discovery import find_heads

        return find_heads()  # all of them: the dialer tries each until one proves the token

    loop = asyncio.new_event_loop()
    main = loop.create_task(_run(options, resolve_head))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main.cancel)
    try:
        loop.run_until_complete(main)
    except asyncio.CancelledError:
        return 0
    except (Refused, NodeError, ModelNotFound, ReplicaConfigError, keys.KeyFileError) as exc:
        sys.stderr.write(f"node_join: {exc}\n")
        return 2
    finally:
        loop.close()
        trace.shutdown()  # the last spans out before the process goes
    return 0
