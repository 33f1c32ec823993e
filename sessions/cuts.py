"""The records of generations whose head process died before their end (SIGKILL, a crash, a lost host).

A head writes a generation's record when it ends (api.generation.Run); a head that dies mid-stream cannot. So each
spec carries what that record needs (`GenerateSpec.record`: signed here, opaque to the node), and a node whose link
closes under a running generation ends it and sends that back, with the tokens it made, on another link (or on the
next one it joins): a `cut` (nodes.link.messages.Cut). The head that receives it writes the record as failed, unless
the head that ran it is alive (a link that dropped and came back: that head fails over or fails the stream, and
records it itself). A head is dead when its beat lapsed (fleet.heads); on the embedded default any other process is
this one's predecessor. A record already written is never written again (the generation's id is its key).
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any

from django.core import signing
from django.db import IntegrityError

from fleet import heads, metrics
from fleet.links import registry
from nodes.link.messages import Cut
from sessions.models import Generation
from sessions.services import GenerationTrace, generation_record_async

log = logging.getLogger("fleet")

SALT = "fleet.cut"
_SETTLING: set[asyncio.Task] = set()


def record_for(*, gen_id: str, kind: str, model: str, api_key: Any, session: Any,
               parameters: dict[str, Any]) -> dict[str, Any]:
    """What a spec carries for the record of its generation, signed with the heads' SECRET_KEY (a node can neither
    forge one nor charge another key)."""
    payload = {"gen": gen_id, "head": heads.PROCESS_ID, "kind": kind, "model": model, "started_at": time.time(),
               "api_key": str(api_key) if api_key is not None else None,
               "session": str(session) if session is not None else None, "parameters": parameters}
    return {"signed": signing.dumps(payload, salt=SALT, compress=True)}


def opened(record: dict[str, Any], gen_id: str) -> dict[str, Any] | None:
    """The payload of `record_for` for generation `gen_id`, or None when it is missing, for another generation, or
    its signature does not hold."""
    try:
        payload = signing.loads(record.get("signed", ""), salt=SALT)
    except (signing.BadSignature, TypeError, ValueError, AttributeError):
        return None
    return payload if isinstance(payload, dict) and payload.get("head") and payload.get("gen") == gen_id else None


def reported(*, node_id: str, node: str, cut: Cut) -> None:
    """A node sent a `cut`: settled in a task of its own (it may wait out the lost head's last beat)."""
    task = asyncio.ensure_future(settle(node_id=node_id, node=node, cut=cut))
    _SETTLING.add(task)
    task.add_done_callback(_SETTLING.discard)


async def settle(*, node_id: str, node: str, cut: Cut) -> Generation | None:
    """Write the record of the cut generation if its head process is dead; the record, or None when none was
    written (a forged or foreign record, a head alive to write its own, one written already)."""
    payload = opened(cut.record, cut.gen_id)
    if payload is None:
        log.warning("fleet node %r reported generation %s cut, with no record this fleet signed: ignored", node,
                    cut.gen_id[:40])
        return None
    origin = payload["head"]
    if origin == heads.PROCESS_ID:
        return None  # this process is alive: its Run records the generation itself
    try:
        until = await _until(origin)
        if until is not None and until > time.time():  # wait its beat out: a dead head's lapses within TTL_S
            await asyncio.sleep(until - time.time() + heads.BEAT_S)
            until = await _until(origin)
    except Exception:  # Redis away: which heads live is unknown, and a record written twice is worse than late
        log.warning("could not learn whether head process %s is alive; generation %s left unrecorded", origin,
                    cut.gen_id, exc_info=True)
        return None
    if until is not None and until > time.time():
        log.info("generation %s was cut from head process %s, which is alive and records it", cut.gen_id, origin)
        return None
    return await _write(node_id, node, cut, payload)


async def _until(head: str) -> float | None:
    return await asyncio.to_thread(registry().heads.alive_until, head)


async def _write(node_id: str, node: str, cut: Cut, payload: dict[str, Any]) -> Generation | None:
    usage = cut.usage or {}
    counted = {name: _count(usage.get(name)) for name in ("prompt_tokens", "cached_tokens", "completion_tokens")}
    started = payload.get("started_at")
    outcome = SimpleNamespace(node_id=node_id, node=node, nodes_used=[node], placement={}, trace_id="",
                              finish_reason=cut.finish_reason[:32] if isinstance(cut.finish_reason, str) else "",
                              started_at=started if isinstance(started, int | float) else time.time(),
                              first_token_at=None, **counted)
    why = f"{cut.code}: {cut.message}" if cut.code else f"the node ended it ({outcome.finish_reason or 'cut'})"
    trace = GenerationTrace(
        gen_id=cut.gen_id, kind=str(payload.get("kind") or "chat")[:32], model=str(payload.get("model") or "")[:200],
        status=Generation.Status.FAILED, outcome=outcome, parameters=payload.get("parameters") or {},
        error=f"head_lost: head process {payload['head']} stopped before the end; node {node} reported it, {why}",
        api_key_id=payload.get("api_key"), session_id=payload.get("session"), finished_at=time.time())
    try:
        generation = await generation_record_async(trace)
    except IntegrityError:  # written already (by another head the node told, or by its own head after all)
        if not await Generation.objects.filter(pk=cut.gen_id).aexists():
            log.exception("could not record generation %s, cut from head process %s", cut.gen_id, payload["head"])
        return None
    except Exception:
        log.exception("could not record generation %s, cut from head process %s", cut.gen_id, payload["head"])
        return None
    label = await metrics.amodel_label(trace.model)
    metrics.generation_ended(model=label, status=trace.status, code="head_lost", outcome=outcome,
                             finished_at=trace.finished_at, api=trace.kind)
    log.warning("generation %s failed: its head process %s stopped before the end (node %s: %d prompt tokens, %d "
                "completion tokens); recorded here", cut.gen_id, payload["head"], node, outcome.prompt_tokens,
                outcome.completion_tokens)
    return generation


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else 0
