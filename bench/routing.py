"""Placement policies side by side on four simulated nodes under a multi-turn chat workload, on two node profiles.

Each node is a real MockEngine (nodes/agent/engine/mock.py) stepped by a thread of its own, so its costs are
really spent: every step sleeps one decode step (longer by `decode_slowdown_ms` for each further decoding lane)
plus `prefill_ms_per_token` for each prompt token it reads, and a lane's prefix cache saves exactly the tokens it
already holds (or another lane holds: the engine copies a cached prefix between lanes, free in the mock, as the
llama engine does with seq_cp). The head side is one asyncio loop: conversations send each turn with the whole
history, a generation waits in one FIFO queue until some lane is free, and the policy picks the node:

- cache_aware:  nodes.link.lifecycle.PlacementLifecycle, the same object fleet/dispatch.py and replicas place
                through (choose with the prompt's prefix keys; accepted; done: record the prompt's and the answer's
                keys, evict, release), with each node's learned load cost: its engine's measured prefill rate and
                decode slowdown (fed to placement as a heartbeat would, at each done) and its mean answer length;
- round_robin:  the next node in turn that has a free lane;
- least_loaded: the node running the fewest generations, ties to the least routed;
- cache_aware@N: cache_aware with a fixed load cost of N tokens (FLEET_LOAD_TOKENS=N), for comparison.

Profiles: `cpu`, a 1-3B Q4 model on a few CPU cores (~500 prompt tokens/s, 25 decode steps/s, each further
decoding lane +8 ms a step, as on this project's VM); `gpu`, prefill 20x faster (10,000 tokens/s), decode steps of
10 ms (100/s, a 1-3B model on a GPU) barely slowed by batching (+0.1 ms a lane). With the CPU's 40 ms steps a GPU's
first token cannot come 2x sooner from its cache: one decode step to wait for on a busy node costs as much as reading
the whole prompt on an idle one (docs/benchmarks.md). All policies see the same workload (same seeds). Every
simulated duration is multiplied by --time-scale to keep the run short; reported times are divided by it again, so
they read as on the simulated node.
Run from the repository root:  .venv/bin/python bench/routing.py    Writes bench/results/routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import queue
import random
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nodes.agent.engine.base import (
    EngineConfig,  # noqa: E402
    Event,  # noqa: E402
)
from nodes.agent.engine.mock import MockEngine  # noqa: E402
from nodes.agent.vocab import BUILTINS, MOCK  # noqa: E402
from nodes.link.lifecycle import PlacementLifecycle, placement_keys  # noqa: E402
from nodes.link.messages import Accepted, Done, TokenBatch  # noqa: E402
from nodes.link.placement import NodeSlot, PlacementState  # noqa: E402
from nodes.link.prefix import PrefixKey  # noqa: E402

MOCK_TOKENIZER = BUILTINS[MOCK]  # the mock engine's tokenizer: its nodes report it, and the head keys prompts with it
from nodes.link.spec import GenerateSpec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "routing.json"
MODEL = "mock-1b"
POLICIES = ["cache_aware", "round_robin", "least_loaded", "cache_aware@3000"]
HEADS_POLICIES = ["cache_aware_heads@1", "cache_aware_heads@2", "cache_aware_heads@4"]
PROFILES = {  # what differs between the simulated nodes of each profile
    "cpu": {"prefill_ms_per_token": 2.0, "decode_slowdown_ms": 8.0},
    "gpu": {"prefill_ms_per_token": 0.1, "decode_tps": 100.0, "decode_slowdown_ms": 0.1},
}
_VOCABULARY_TEXT = """
fleet node lane head model token prompt cache answer question user system policy rule always never careful brief
polite support billing refund account order shipping invoice customer product warranty return exchange password
login security privacy data report summary detail example step first then finally please check confirm explain
describe list table format markdown code python error log
"""
VOCABULARY = _VOCABULARY_TEXT.split()


@dataclass
class Params:
    """The simulated fleet and workload (durations in simulated seconds, before --time-scale)."""

    nodes: int = 4
    lanes: int = 4
    prefill_ms_per_token: float = 2.0  # ~500 prompt tokens/s: a 1-3B Q4 model on a few CPU cores
    decode_tps: float = 25.0  # decode steps per second with one lane; each step gives every busy lane one token
    decode_slowdown_ms: float = 8.0  # what each further decoding lane adds to a step
    context_window: int = 4096
    conversations: int = 28
    turns: tuple[int, int] = (4, 6)
    system_prompts: int = 4
    system_words: tuple[int, int] = (400, 800)  # the mock's tokens are whitespace words
    user_words: tuple[int, int] = (8, 30)
    answer_tokens: tuple[int, int] = (60, 180)
    think_s: tuple[float, float] = (1.0, 4.0)  # between an answer and the user's next turn
    arrival_gap_s: float = 3.2  # mean gap between conversation starts (exponential)
    time_scale: float = 0.25
    seed: int = 7


# --- the workload --------------------------------------------------------------------------------------


@dataclass
class Conversation:
    start_s: float
    system: str
    users: list[str]
    answer_tokens: list[int]
    think_s: list[float]


def workload(p: Params) -> list[Conversation]:
    rng = random.Random(p.seed)
    systems = [_words(rng, rng.randint(*p.system_words)) for _ in range(p.system_prompts)]
    convs, start = [], 0.0
    for _ in range(p.conversations):
        start += rng.expovariate(1 / p.arrival_gap_s)
        turns = rng.randint(*p.turns)
        convs.append(
            Conversation(
                start_s=start,
                system=rng.choice(systems),
                users=[_words(rng, rng.randint(*p.user_words)) + "?" for _ in range(turns)],
                answer_tokens=[rng.randint(*p.answer_tokens) for _ in range(turns)],
                think_s=[rng.uniform(*p.think_s) for _ in range(turns)],
            )
        )
    return convs


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(n))


# --- the nodes ------------------------------------------------------------------------------------------


class SimNode:
    """One node: a MockEngine driven by its own thread (the mock's sleeps release the GIL, so nodes overlap)."""

    def __init__(self, index: int, p: Params, deliver) -> None:
        self.index = index
        self.engine = MockEngine(
            EngineConfig(
                model_name=MODEL,
                lanes=p.lanes,
                max_context=p.context_window,
                flush_tokens=1,
                flush_ms=0.0,
                mock={
                    "decode_tps": p.decode_tps / p.time_scale,
                    "decode_slowdown_ms": p.decode_slowdown_ms * p.time_scale,
                    "prefill_ms_per_token": p.prefill_ms_per_token * p.time_scale,
                    "context_window": p.context_window,
                },
            )
        )
        self.inbox: queue.SimpleQueue[GenerateSpec | None] = queue.SimpleQueue()
        self.busy_s = 0.0
        self._stopping = False
        self._deliver = deliver
        self._thread = threading.Thread(target=self._run, name=f"node-{index}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        engine = self.engine
        while True:
            try:
                spec = self.inbox.get(block=not engine.busy())
            except queue.Empty:
                spec = None
            events = []
            while spec is not None:
                events += engine.submit(spec)
                spec = self.inbox.get_nowait() if not self.inbox.empty() else None
            if engine.busy():
                started = time.perf_counter()
                events += engine.step()
                self.busy_s += time.perf_counter() - started
            if events:
                # what the node's heartbeat would carry, read on its own thread when a generation ends
                figures = engine.stats() if any(isinstance(e, Done) for e in events) else None
                self._deliver(self.index, events, time.perf_counter(), figures)
            if self._stopping and not engine.busy():
                return

    def stop(self) -> None:
        self._stopping = True
        self.inbox.put(None)
        self._thread.join(timeout=10)


# --- the policies ---------------------------------------------------------------------------------------


class Policy:
    """Lane accounting shared by the baselines; `place` reserves a lane or returns None when none is free."""

    def __init__(self, p: Params) -> None:
        self.lanes = p.lanes
        self.running = [0] * p.nodes
        self.routed = [0] * p.nodes

    def place(self, gen: Generation) -> int | None:
        free = [i for i, n in enumerate(self.running) if n < self.lanes]
        if not free:
            return None
        node = self.pick(free)
        self.running[node] += 1
        self.routed[node] += 1
        return node

    def pick(self, free: list[int]) -> int:
        raise NotImplementedError

    def accepted(self, node: int, event: dict[str, Any]) -> None:
        """The node admitted a generation (the baselines keep no index)."""

    def measured(self, node: int, figures: dict[str, Any]) -> None:
        """What the node's engine measured of its speed (the baselines ignore it)."""

    def report(self) -> dict[str, Any]:
        return {}

    def finished(self, node: int, gen: Generation, done: Done) -> None:
        self.running[node] -= 1


class RoundRobin(Policy):
    def __init__(self, p: Params) -> None:
        super().__init__(p)
        self.turn = 0

    def pick(self, free: list[int]) -> int:
        n = len(self.running)
        node = next(i % n for i in range(self.turn, self.turn + n) if i % n in free)
        self.turn = node + 1
        return node


class LeastLoaded(Policy):
    def pick(self, free: list[int]) -> int:
        return min(free, key=lambda i: (self.running[i], self.routed[i], i))


class CacheAware(Policy):
    """The placement lifecycle the head and replicas use, over an in-process placement state."""

    def __init__(self, p: Params, load_tokens: int | None = None) -> None:
        super().__init__(p)
        self.state = PlacementState(load_tokens=load_tokens)
        self.lifecycle = PlacementLifecycle(self.state)
        for i in range(p.nodes):
            self.state.node_up(NodeSlot(f"n{i}", f"node-{i}", [MODEL], p.lanes, p.context_window))

    def place(self, gen: Generation) -> int | None:
        choice = self.lifecycle.choose(gen.spec, gen.keys)
        if choice is None:
            return None
        node = int(choice.node_id[1:])
        self.running[node] += 1
        self.routed[node] += 1
        return node

    def accepted(self, node: int, event: Accepted) -> None:
        self.lifecycle.accepted(f"n{node}", event.evicted)

    def measured(self, node: int, figures: dict[str, Any]) -> None:
        self.lifecycle.measured(f"n{node}", figures)

    def finished(self, node: int, gen: Generation, done: Done) -> None:
        self.lifecycle.done(f"n{node}", gen.spec, gen.keys, answer=gen.text, usage=done.usage,
                            tokenizer=MOCK_TOKENIZER, evicted=done.evicted)
        super().finished(node, gen, done)

    def report(self) -> dict[str, Any]:
        """Each node's load cost at the end and the figures it came from."""
        return {"load_tokens_per_node": [self.state.load_of(s) for s in self.state.nodes()],
                "measured": [{"prefill_tps": s.prefill_tps, "decode_slowdown_ms": s.decode_slowdown_ms,
                              "answer_tokens": round(s.answer_tokens, 1)} for s in self.state.nodes()]}


class CacheAwareHeads(CacheAware):
    """cache_aware as H head processes place it: the placement state in Redis (fleet/placement_redis.py, one prefix
    index and one count of lanes fleet-wide), each head with its own client, snapshot and placement lifecycle, and
    the conversations spread evenly over the heads (conversation i on head i mod H). One FIFO of waiting generations
    stays (the real heads wake each other's waiters when a lane frees). Needs REDIS_URL; uses keys of its own."""

    def __init__(self, p: Params, heads: int) -> None:
        from fleet.placement_redis import RedisPlacementState

        Policy.__init__(self, p)
        url = os.environ.get("REDIS_URL")
        if not url:
            raise SystemExit(f"cache_aware_heads@{heads} needs REDIS_URL (the fleet-wide placement state)")
        prefix = f"bench-routing-{os.getpid()}-{time.monotonic_ns()}:"
        self.heads = [RedisPlacementState(url, prefix=prefix) for _ in range(heads)]
        self.lifecycles = [PlacementLifecycle(state) for state in self.heads]
        self.state, self.lifecycle = self.heads[0], self.lifecycles[0]
        for i in range(p.nodes):
            self.state.node_up(NodeSlot(f"n{i}", f"node-{i}", [MODEL], p.lanes, p.context_window))
        self.head_of: dict[str, int] = {}

    def _lifecycle(self, gen_id: str) -> PlacementLifecycle:
        return self.lifecycles[self.head_of[gen_id]]

    def place(self, gen: Generation) -> int | None:
        gen_id = gen.spec.gen_id
        self.head_of.setdefault(gen_id, int(gen_id[1:].split("t", 1)[0]) % len(self.heads))
        choice = self._lifecycle(gen_id).choose(gen.spec, gen.keys)
        if choice is None:
            return None
        node = int(choice.node_id[1:])
        self.running[node] += 1
        self.routed[node] += 1
        return node

    def accepted(self, node: int, event: Accepted) -> None:
        self._lifecycle(event.gen_id).accepted(f"n{node}", event.evicted)

    def measured(self, node: int, figures: dict[str, Any]) -> None:
        for lifecycle in self.lifecycles:  # a node's heartbeat reaches every head it links to
            lifecycle.measured(f"n{node}", figures)

    def finished(self, node: int, gen: Generation, done: Done) -> None:
        self._lifecycle(gen.spec.gen_id).done(f"n{node}", gen.spec, gen.keys, answer=gen.text, usage=done.usage,
                                              tokenizer=MOCK_TOKENIZER, evicted=done.evicted)
        Policy.finished(self, node, gen, done)
        del self.head_of[gen.spec.gen_id]

    def report(self) -> dict[str, Any]:
        keys = self.state.r.keys(f"{self.state.p}*")
        if keys:
            self.state.r.delete(*keys)
        return {"heads": len(self.heads)}


def make_policy(name: str, p: Params) -> Policy:
    """A policy by name; `cache_aware@N` is cache_aware with a fixed load cost of N tokens, `cache_aware_heads@H`
    cache_aware over the Redis placement state from H heads."""
    if name.startswith("cache_aware_heads@"):
        return CacheAwareHeads(p, heads=int(name.split("@", 1)[1]))
    if name.startswith("cache_aware@"):
        return CacheAware(p, load_tokens=int(name.split("@", 1)[1]))
    return {"cache_aware": CacheAware, "round_robin": RoundRobin, "least_loaded": LeastLoaded}[name](p)


# --- the head -------------------------------------------------------------------------------------------


@dataclass
class Generation:
    spec: GenerateSpec
    keys: list[PrefixKey]
    arrived: float
    done: asyncio.Future
    node: int = -1
    first_token: float | None = None
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Tally:
    ttft_s: list[float] = field(default_factory=list)
    prefill_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    per_node: list[int] = field(default_factory=list)
    conversation_s: float = 0.0  # summed over conversations, from first turn to last answer


class Head:
    """Places generations in arrival order (FIFO when every lane is busy) and relays the nodes' events."""

    def __init__(self, policy: Policy, p: Params) -> None:
        self.policy = policy
        self.loop = asyncio.get_running_loop()
        self.nodes = [SimNode(i, p, self._deliver) for i in range(p.nodes)]
        self.waiting: deque[Generation] = deque()
        self.gens: dict[str, Generation] = {}
        self.tally = Tally(per_node=[0] * p.nodes)

    async def generate(self, spec: GenerateSpec) -> Generation:
        gen = Generation(spec, placement_keys(spec, MOCK_TOKENIZER), time.perf_counter(), self.loop.create_future())
        self.gens[spec.gen_id] = gen
        self.waiting.append(gen)
        self._pump()
        return await gen.done

    def _pump(self) -> None:
        while self.waiting:
            node = self.policy.place(self.waiting[0])
            if node is None:
                return
            gen = self.waiting.popleft()
            gen.node = node
            self.tally.per_node[node] += 1
            self.nodes[node].inbox.put(gen.spec)

    def _deliver(self, index: int, events: list[Event], at: float, figures: dict[str, Any] | None) -> None:
        self.loop.call_soon_threadsafe(self._on_events, index, events, at, figures)

    def _on_events(self, index: int, events: list[Event], at: float, figures: dict[str, Any] | None) -> None:
        if figures is not None:
            self.policy.measured(index, figures)
        for event in events:
            gen = self.gens[event.gen_id]
            if isinstance(event, TokenBatch):
                gen.first_token = gen.first_token or at
                gen.text += "".join(event.text)
                gen.completion_tokens += len(event.ids)
            elif isinstance(event, Accepted):
                gen.prompt_tokens, gen.cached_tokens = event.prompt_tokens, event.cached_tokens
                self.policy.accepted(gen.node, event)
            elif isinstance(event, Done):
                self._on_done(gen, event)
            elif not gen.done.done():
                gen.done.set_exception(RuntimeError(f"generation {event.gen_id} failed on node {gen.node}: {event}"))

    def _on_done(self, gen: Generation, event: Done) -> None:
        self.policy.finished(gen.node, gen, event)
        del self.gens[gen.spec.gen_id]
        t = self.tally
        t.ttft_s.append(gen.first_token - gen.arrived)
        t.prefill_tokens += gen.prompt_tokens - gen.cached_tokens
        t.prompt_tokens += gen.prompt_tokens
        t.completion_tokens += gen.completion_tokens
        gen.done.set_result(gen)
        self._pump()

    def close(self) -> list[float]:
        for node in self.nodes:
            node.stop()
        return [node.busy_s for node in self.nodes]


async def converse(head: Head, conv: Conversation, number: int, scale: float) -> None:
    await asyncio.sleep(conv.start_s * scale)
    started = time.perf_counter()
    messages = [{"role": "system", "content": conv.system}]
    for turn, user in enumerate(conv.users):
        if turn:
            await asyncio.sleep(conv.think_s[turn] * scale)
        messages.append({"role": "user", "content": user})
        spec = GenerateSpec(
            gen_id=f"c{number}t{turn}",
            model=MODEL,
            messages=list(messages),
            max_tokens=conv.answer_tokens[turn],
            seed=number * 100 + turn,
            ignore_eos=True,
        )
        gen = await head.generate(spec)
        # Trimmed as chat clients show it. The mock renders "<|assistant|> " + content and its tokens carry their
        # leading space, so an untrimmed answer would never match the tokens the lane holds (llama.cpp's would).
        messages.append({"role": "assistant", "content": gen.text.lstrip()})
    head.tally.conversation_s += time.perf_counter() - started


async def run_policy(name: str, p: Params, convs: list[Conversation]) -> dict[str, Any]:
    head = Head(make_policy(name, p), p)
    started = time.perf_counter()
    try:
        await asyncio.gather(*(converse(head, c, i, p.time_scale) for i, c in enumerate(convs)))
    finally:
        busy = head.close()
    return {**summarize(head.tally, busy, time.perf_counter() - started, p.time_scale), **head.policy.report()}


# --- figures --------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(t: Tally, busy_s: list[float], elapsed: float, scale: float) -> dict[str, Any]:
    ttft_ms = [s / scale * 1000 for s in t.ttft_s]
    wall_s = elapsed / scale
    return {
        "prefill_tokens": t.prefill_tokens,
        "ttft_ms_p50": round(percentile(ttft_ms, 0.50), 1),
        "ttft_ms_p95": round(percentile(ttft_ms, 0.95), 1),
        "throughput_tok_s": round(t.completion_tokens / wall_s, 1),
        "max_over_mean_load": round(max(t.per_node) / (sum(t.per_node) / len(t.per_node)), 3),
        "max_over_mean_busy": round(max(busy_s) / (sum(busy_s) / len(busy_s)), 3),
        "generations_per_node": t.per_node,
        "busy_s_per_node": [round(b / scale, 1) for b in busy_s],
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.completion_tokens,
        "cache_hit_ratio": round(1 - t.prefill_tokens / t.prompt_tokens, 3),
        "generations": len(ttft_ms),
        "wall_s": round(wall_s, 1),
        "mean_active_conversations": round(t.conversation_s / elapsed, 1),
    }


def ratios(policies: dict[str, dict[str, Any]]) -> dict[str, float]:
    ca, rr = policies["cache_aware"], policies["round_robin"]
    r = {
        "prefill_round_robin_over_cache_aware": round(rr["prefill_tokens"] / max(ca["prefill_tokens"], 1), 2),
        "ttft_p50_round_robin_over_cache_aware": round(rr["ttft_ms_p50"] / ca["ttft_ms_p50"], 2),
        "cache_aware_max_over_mean_load": ca["max_over_mean_load"],
    }
    # Spread over H heads against one head on the same Redis state (else the in-process one): the hit ratio's drop.
    one = policies.get("cache_aware_heads@1", ca)
    for name, row in policies.items():
        if name.startswith("cache_aware_heads@") and name != "cache_aware_heads@1":
            r[f"cache_hit_drop_{name.split('@')[1]}_heads"] = round(one["cache_hit_ratio"] - row["cache_hit_ratio"], 3)
    return r


def targets(r: dict[str, float]) -> dict[str, bool]:
    met = {
        "prefill_at_least_3x_fewer": r["prefill_round_robin_over_cache_aware"] >= 3.0,
        "ttft_p50_at_least_2x_better": r["ttft_p50_round_robin_over_cache_aware"] >= 2.0,
        "no_node_above_1_5x_mean_load": r["cache_aware_max_over_mean_load"] <= 1.5,
    }
    for key, drop in r.items():
        if key.startswith("cache_hit_drop_"):
            met[f"{key.removeprefix('cache_hit_drop_')}_hit_ratio_within_0_02_of_one"] = drop <= 0.02
    return met


def print_report(p: Params, policies: dict[str, dict[str, Any]], r: dict[str, float], met: dict[str, bool]) -> None:
    cols = [
        "prefill_tokens",
        "ttft_ms_p50",
        "ttft_ms_p95",
        "throughput_tok_s",
        "max_over_mean_load",
        "max_over_mean_busy",
        "cache_hit_ratio",
    ]
    print(f"{'policy':<22}" + "".join(f"{c:>20}" for c in cols))
    for name, row in policies.items():
        print(f"{name:<22}" + "".join(f"{row[c]:>20}" for c in cols))
    print(
        "max_over_mean_load = the busiest node's share of generations over the mean; "
        "max_over_mean_busy = the same for the time its engine spent stepping"
    )
    for key, value in r.items():
        print(f"{key}: {value}")
    for key, ok in met.items():
        print(f"target {key}: {'met' if ok else 'NOT met'}")


def parse_args() -> tuple[Params, list[str], list[str], Path]:
    p = Params()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--time-scale", type=float, default=p.time_scale, help="multiply every simulated duration")
    parser.add_argument("--conversations", type=int, default=p.conversations)
    parser.add_argument("--arrival-gap", type=float, default=p.arrival_gap_s, help="mean seconds between conversations")
    parser.add_argument("--seed", type=int, default=p.seed)
    parser.add_argument("--profiles", default=",".join(PROFILES), help=f"comma-separated, of {', '.join(PROFILES)}")
    # With REDIS_URL set the default adds the fleet-wide placement state from 1, 2 and 4 heads (#32's hit ratio).
    default = POLICIES + (HEADS_POLICIES if os.environ.get("REDIS_URL") else [])
    parser.add_argument("--policies", default=",".join(default),
                        help="comma-separated; cache_aware@N fixes N; cache_aware_heads@H places from H heads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    p.time_scale, p.conversations, p.arrival_gap_s = args.time_scale, args.conversations, args.arrival_gap
    p.seed = args.seed
    names, profiles = args.policies.split(","), args.profiles.split(",")
    missing = {"cache_aware", "round_robin"} - set(names)
    if missing:
        parser.error(f"--policies must include {' and '.join(sorted(missing))} (the ratios compare them)")
    if unknown := set(profiles) - set(PROFILES):
        parser.error(f"unknown profiles {', '.join(sorted(unknown))}; known: {', '.join(PROFILES)}")
    return p, names, profiles, args.out


def run_profile(p: Params, names: list[str]) -> dict[str, Any]:
    convs = workload(p)
    print(
        f"{p.nodes} nodes x {p.lanes} lanes, prefill {p.prefill_ms_per_token} ms/uncached token, "
        f"decode {p.decode_tps} steps/s (+{p.decode_slowdown_ms} ms a step per further lane); {len(convs)} "
        f"conversations, {sum(len(c.users) for c in convs)} turns, {p.system_prompts} system prompts of "
        f"{p.system_words} words; time scale {p.time_scale}"
    )
    policies = {}
    for name in names:
        policies[name] = asyncio.run(run_policy(name, p, convs))
        print(f"  {name}: done in {policies[name]['wall_s'] * p.time_scale:.1f} s of wall time", flush=True)
    r = ratios(policies)
    met = targets(r)
    print_report(p, policies, r, met)
    return {"policies": policies, "ratios": r, "targets_met": met, "parameters": asdict(p)}


def main() -> None:
    base, names, profiles, out = parse_args()
    results = {}
    for profile in profiles:
        print(f"--- profile {profile}", flush=True)
        results[profile] = run_profile(replace(base, **PROFILES[profile]), names)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "profiles": results,
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {
                    "platform": platform.platform(),
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "load_average_1m": round(os.getloadavg()[0], 2),
                },
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
