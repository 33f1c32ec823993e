"""One placement's life, owned in one place: choose, accepted, done, ended or lost.

The head (placing generations on nodes: fleet/dispatch.py and the link consumer), a node with replicas (placing on
its engine workers: nodes/agent/replicas.py) and the routing benchmark all drive placement through this object,
so none of them spells the steps out again (three copies had drifted: replicas recorded only the prompt's keys).
It works over either placement state, in process (nodes.link.placement.PlacementState) or in Redis
(fleet.placement_redis.RedisPlacementState). Django-free.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from nodes.link.placement import AsyncView, Choice
from nodes.link.prefix import PrefixKey, named_key, prefix_keys
from nodes.link.spec import GenerateSpec

_Call = tuple[str, tuple[Any, ...], dict[str, Any]]  # a state method's name and its arguments


def cache_space(spec: GenerateSpec) -> str:
    """What a node's cached prompts are keyed by: the model, and the LoRA adapters their KV was computed under."""
    return spec.model + "".join(f"\x1d{name}={scale:g}" for name, scale in sorted(spec.lora))


class Tokenizer(Protocol):
    """A model's tokenizer (nodes.agent.vocab): its fingerprint, and whether tokenizing is cheap enough to run on an
    event loop (`inline`) or belongs in a thread."""

    fingerprint: str
    inline: bool

    def tokenize(self, text: str) -> list[int]: ...


def placement_keys(spec: GenerateSpec, tokenizer: Tokenizer) -> list[PrefixKey]:
    """The prompt's prefix keys: what placement matches against what nodes hold."""
    return prefix_keys(space=_space(spec, tokenizer), tokenize=tokenizer.tokenize, prompt=spec.prompt,
                       messages=spec.messages)


def named_placement_key(spec: GenerateSpec, tokenizer: Tokenizer, name: str) -> PrefixKey:
    """The key of the prefix name a generation carried (its client's `prompt_cache_key`, scoped to its API key), in
    the space of the prompt's keys: recorded with them where it ran, looked up by the next generation with the name."""
    return named_key(space=_space(spec, tokenizer), name=name)


def held_keys(spec: GenerateSpec, keys: list[PrefixKey], answer: str, tokenizer: Tokenizer) -> list[PrefixKey]:
    """What a node holds once `spec` is done there: the prompt's keys and, for a chat, the conversation with the
    answer appended (its next turn starts with it)."""
    if spec.messages is None:
        return list(keys)
    answered = [*spec.messages, {"role": "assistant", "content": answer}]
    return keys + prefix_keys(space=_space(spec, tokenizer), tokenize=tokenizer.tokenize, messages=answered)


def _space(spec: GenerateSpec, tokenizer: Tokenizer) -> str:
    return f"{cache_space(spec)}\x1c{tokenizer.fingerprint}"


async def aplacement_keys(spec: GenerateSpec, tokenizer: Tokenizer) -> list[PrefixKey]:
    """As placement_keys, in a thread unless the tokenizer is cheap (a long prompt takes milliseconds, and the first
    use of a vocabulary loads it)."""
    if tokenizer.inline:
        return placement_keys(spec, tokenizer)
    return await asyncio.to_thread(placement_keys, spec, tokenizer)


class PlacementLifecycle:
    """The steps of one generation's placement, over a placement state.

    - `choose`: reserve a lane on the cheapest node (None: no lane free);
    - `accepted`: the node admitted it; forget what its lane choice evicted, now rather than at done;
    - `done`: record the prompt's and the answer's keys, forget what the node evicted, free the lane (one call);
    - `ended`: it ended without a done to record (an error, a cancel, the link's own report); free the lane;
    - `preempted`: a batch line gives its lane to an interactive generation; free the lane before its end;
    - `lost`: the node (or its engine) was lost with it; free the lane, and forget the node's cache when it is gone.

    Freeing a lane is once per generation and node, so the link and the dispatcher may both report an end.
    `measured` takes what a node's engine measured (its heartbeat), which its learned load cost comes from.
    Each step is spelled once, as the state calls it makes; `done` runs them on the state, `adone` (and each other
    `a` step) awaits them on its `aio` operations, so the head's event loop never waits on Redis.
    """

    def __init__(self, state: Any) -> None:
        self.state = state

    def choose(self, spec: GenerateSpec, keys: list[PrefixKey], *, exclude: set[str] = frozenset(),
               model: str | None = None) -> Choice | None:
        """`model`: the name the slots serve it under, when not the spec's own (a node's replicas)."""
        return self.state.choose(model or spec.model, keys, exclude=exclude, gen_id=spec.gen_id)

    def accepted(self, node_id: str, evicted: Sequence[str]) -> None:
        self._apply(self._accepted(node_id, evicted))

    def done(self, node_id: str, spec: GenerateSpec, keys: list[PrefixKey], *, answer: str, usage: dict[str, Any],
             tokenizer: Tokenizer, evicted: Sequence[str] = ()) -> None:
        held = held_keys(spec, keys, answer, tokenizer)
        self._apply(self._done(node_id, spec, held, usage=usage, evicted=evicted))

    def ended(self, node_id: str, gen_id: str) -> None:
        self._apply(self._ended(node_id, gen_id))

    def preempted(self, node_id: str, gen_id: str) -> None:
        """A generation that outranks `gen_id` takes its lane: freed now, as the cancel goes to the node, so the
        newcomer is sent right behind it (the node reads both before its next step); its later end frees nothing."""
        self._apply(self._ended(node_id, gen_id))

    def lost(self, node_id: str, gen_id: str, *, cache_gone: bool = False) -> None:
        self._apply(self._lost(node_id, gen_id, cache_gone=cache_gone))

    def measured(self, node_id: str, figures: dict[str, Any]) -> None:
        """`figures`: a heartbeat's or an engine's stats (prefill_tps, decode_slowdown_ms; absent: not measured)."""
        self._apply(self._measured(node_id, figures))

    # --- the same steps as coroutines, over the state's `aio` operations (the head's event loop) ---
    async def achoose(self, spec: GenerateSpec, keys: list[PrefixKey], *, exclude: set[str] = frozenset(),
                      only: set[str] | None = None, head: str = "") -> Choice | None:
        """`only`: the nodes head process `head` holds links to (it places only there)."""
        return await aio(self.state).choose(spec.model, keys, exclude=exclude, gen_id=spec.gen_id, only=only,
                                            head=head)

    async def aaccepted(self, node_id: str, evicted: Sequence[str]) -> None:
        await self._aapply(self._accepted(node_id, evicted))

    async def adone(self, node_id: str, spec: GenerateSpec, keys: list[PrefixKey], *, answer: str,
                    usage: dict[str, Any], tokenizer: Tokenizer, evicted: Sequence[str] = ()) -> None:
        if tokenizer.inline:
            held = held_keys(spec, keys, answer, tokenizer)
        else:  # the answer's tokens, off the event loop
            held = await asyncio.to_thread(held_keys, spec, keys, answer, tokenizer)
        await self._aapply(self._done(node_id, spec, held, usage=usage, evicted=evicted))

    async def aended(self, node_id: str, gen_id: str) -> None:
        await self._aapply(self._ended(node_id, gen_id))

    apreempted = aended

    async def alost(self, node_id: str, gen_id: str, *, cache_gone: bool = False) -> None:
        await self._aapply(self._lost(node_id, gen_id, cache_gone=cache_gone))

    async def ameasured(self, node_id: str, figures: dict[str, Any]) -> None:
        await self._aapply(self._measured(node_id, figures))

    # --- each step, spelled once: the state calls it makes, in order ---
    def _accepted(self, node_id: str, evicted: Sequence[str]) -> list[_Call]:
        return [("evict", (node_id, list(evicted)), {})] if evicted else []

    def _done(self, node_id: str, spec: GenerateSpec, held: list[PrefixKey], *, usage: dict[str, Any],
              evicted: Sequence[str]) -> list[_Call]:
        # record, evict (again, in case a done recorded them after the accepted that reported them; harmless
        # otherwise) and release: one call, so one round trip over Redis
        return [("finish", (node_id, spec.gen_id, held),
                 {"completion_tokens": int(usage.get("completion_tokens") or 0), "evicted": list(evicted)})]

    def _ended(self, node_id: str, gen_id: str) -> list[_Call]:
        return [("release", (node_id, gen_id), {})]

    def _lost(self, node_id: str, gen_id: str, *, cache_gone: bool) -> list[_Call]:
        return [*self._ended(node_id, gen_id), *([("forget_node", (node_id,), {})] if cache_gone else [])]

    def _measured(self, node_id: str, figures: dict[str, Any]) -> list[_Call]:
        return [("measured", (node_id,), {"prefill_tps": float(figures.get("prefill_tps") or 0.0),
                                         "decode_slowdown_ms": float(figures.get("decode_slowdown_ms") or 0.0)})]

    def _apply(self, calls: list[_Call]) -> None:
        for name, args, kwargs in calls:
            getattr(self.state, name)(*args, **kwargs)

    async def _aapply(self, calls: list[_Call]) -> None:
        for name, args, kwargs in calls:
            await getattr(aio(self.state), name)(*args, **kwargs)


def aio(state: Any) -> Any:
    """A placement state's coroutine operations (its own `aio`, or an AsyncView over one that has none)."""
    return getattr(state, "aio", None) or AsyncView(state)
