"""Reads for conversations, generation records and handles.

Visibility: a user sees what they own (sessions and handles they or their API keys made, generations of their
keys and sessions); staff see everything.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Q, QuerySet

from sessions.models import Generation, GrammarHandle, InferenceSession, LogitBiasHandle, Message, StoredResponse


class HandleUnavailable(LookupError):
    """A generation named a handle (or session) that does not exist, is not the caller's, or was freed."""


def as_uuid(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except (TypeError, ValueError, AttributeError):
        return None


def _owned(queryset: QuerySet, user) -> QuerySet:
    if user is None:
        return queryset.none()
    if user.is_staff:
        return queryset
    return queryset.filter(Q(owner=user) | Q(api_key__owner=user))


# --- sessions -------------------------------------------------------------------------------------------------


def session_list(*, user) -> QuerySet[InferenceSession]:
    return _owned(InferenceSession.objects.all(), user)


def session_get(*, user, session_id: Any) -> InferenceSession | None:
    pk = as_uuid(session_id)
    return session_list(user=user).filter(pk=pk).first() if pk else None


def message_list(*, session: InferenceSession) -> QuerySet[Message]:
    return Message.objects.filter(session=session).order_by("index")


def session_history(*, session: InferenceSession) -> list[dict[str, Any]]:
    """The conversation so far as OpenAI-style messages: the system prompt, then every stored message."""
    history: list[dict[str, Any]] = []
    if session.system_prompt:
        history.append({"role": "system", "content": session.system_prompt})
    for m in message_list(session=session):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        history.append(message)
    return history


# --- generations ----------------------------------------------------------------------------------------------


def generation_list(*, user, model: str | None = None, node: str | None = None, status: str | None = None,
                    session: str | None = None, kind: str | None = None) -> QuerySet[Generation]:
    """Generation records the user may see, newest first; `node` matches a node id or identity."""
    queryset = Generation.objects.select_related("node")
    if user is None:
        return queryset.none()
    if not user.is_staff:
        queryset = queryset.filter(Q(api_key__owner=user) | Q(session__owner=user))
    if model:
        queryset = queryset.filter(model=model)
    if status:
        queryset = queryset.filter(status=status)
    if kind:
        queryset = queryset.filter(kind=kind)
    if session:
        pk = as_uuid(session)
        queryset = queryset.filter(session_id=pk) if pk else queryset.none()
    if node:
        pk = as_uuid(node)
        queryset = queryset.filter(node_id=pk) if pk else queryset.filter(node__identity=node)
    return queryset.order_by("-created_at")


def expires_at(since: datetime | None, days: int) -> datetime | None:
    """When maintenance removes (or frees) a row last touched at `since`, under a time-to-live of `days`; None for
    0 (kept) or no time. The admin shows it."""
    return since + timedelta(days=days) if since is not None and days > 0 else None


# --- handles --------------------------------------------------------------------------------------------------


def grammar_handle_list(*, user) -> QuerySet[GrammarHandle]:
    return _owned(GrammarHandle.objects.all(), user)


def logit_bias_handle_list(*, user) -> QuerySet[LogitBiasHandle]:
    return _owned(LogitBiasHandle.objects.all(), user)


def grammar_handle_get_active(*, user, handle_id: Any) -> GrammarHandle:
    """The live grammar handle a generation names; HandleUnavailable says why not."""
    return _active(grammar_handle_list(user=user), handle_id, "grammar handle", "/api/grammars/")


def logit_bias_handle_get_active(*, user, handle_id: Any) -> LogitBiasHandle:
    return _active(logit_bias_handle_list(user=user), handle_id, "logit-bias handle", "/api/logit-biases/")


def _active(queryset: QuerySet, handle_id: Any, what: str, where: str):
    pk = as_uuid(handle_id)
    handle = queryset.filter(pk=pk).first() if pk else None
    if handle is None:
        raise HandleUnavailable(f"There is no {what} {handle_id!r} for this API key; create one under {where}.")
    if handle.freed_at is not None:
        ttl = settings.FLEET_HANDLE_TTL_DAYS
        why = f" (by its owner, or after {ttl} days unused)" if ttl else ""
        raise HandleUnavailable(f"The {what} {handle_id!r} was freed at {handle.freed_at:%Y-%m-%d %H:%M:%S} UTC{why}; "
                                f"create a new one under {where}.")
    return handle


# --- a generation's page in the admin -----------------------------------------------------------------------


def generation_list_recent(*, node_id: Any, limit: int = 20) -> list[Generation]:
    """The newest generations a node served (the node's admin page)."""
    return list(Generation.objects.filter(node_id=node_id).order_by("-created_at")[:limit])


def generation_attempts(*, generation: Generation) -> list[dict[str, Any]]:
    """Each placement of the generation (the first, then one per failover) with its evidence: every candidate node
    with its cost split into prompt tokens to read again and load, the chosen one marked. Records from before the
    full ranking was kept show the chosen node and the runner-up."""
    first = generation.placement or {}
    attempts = [first, *first.get("failover", [])] if first else []
    shaped = []
    for number, attempt in enumerate(attempts, 1):
        rows = attempt.get("ranking") or [r for r in (attempt, attempt.get("runner_up")) if r]
        shaped.append({
            "number": number, "node": attempt.get("node"), "after": attempt.get("after"),
            "placed_at": _at(attempt.get("placed_at")), "cost": attempt.get("cost"),
            "prompt_tokens_estimate": attempt.get("prompt_tokens_estimate"),
            "candidates": attempt.get("candidates", len(rows)),
            "rows": [{**r, "chosen": r.get("node") == attempt.get("node")} for r in rows],
        })
    return shaped


def generation_timeline(*, generation: Generation) -> list[dict[str, Any]]:
    """What happened to the generation, in order, each with its time and milliseconds since it was queued:
    queued (with its priority class, how many waited ahead of it and how long it waited), loading (when it waited for
    an on-demand load), placed, every failover, first token, and its end."""
    start = generation.created_at
    queue = (generation.placement or {}).get("queue") or {}
    queued = f"{generation.kind} on {generation.model}"
    if queue:  # its place in the waiting room (fleet.waiting) as it joined, and how long it waited for a lane
        queued += (f"; priority {queue.get('priority')}, {queue.get('position')} ahead of it, waited "
                   f"{queue.get('waited_ms')} ms for a lane")
    events = [("queued", start, queued)]
    if isinstance(loading := queue.get("loading"), dict):  # it waited for a node to load its model on demand
        events.append(("loading", _at(loading.get("since")), f"{generation.model} loading on demand on "
                                                              f"{loading.get('node')}: {loading.get('ms')} ms"))
    for attempt in generation_attempts(generation=generation):
        if attempt["after"]:
            after = attempt["after"]
            events.append(("failed over", _at(after.get("at")), f"{after.get('code')}: {after.get('message')}"))
        if attempt["placed_at"]:
            events.append(("placed", attempt["placed_at"], f"on {attempt['node']} (cost {attempt['cost']} of "
                                                          f"{attempt['candidates']} candidate(s))"))
    if generation.ttft_ms is not None:
        events.append(("first token", start + timedelta(milliseconds=generation.ttft_ms),
                       f"{generation.prompt_tokens} prompt tokens, {generation.cached_tokens} cached"))
    if generation.finished_at:
        end = generation.finish_reason or generation.error or ""
        events.append((generation.status, generation.finished_at, f"{generation.completion_tokens} tokens; {end}"))
    events.sort(key=lambda e: e[1])
    return [{"what": what, "at": at, "ms": (at - start).total_seconds() * 1000, "detail": detail}
            for what, at, detail in events if at is not None]


def _at(seconds: Any) -> datetime | None:
    return datetime.fromtimestamp(seconds, UTC) if isinstance(seconds, int | float) else None


# --- stored responses (/v1/responses) --------------------------------------------------------------------------


def stored_response_get(*, user, response_id: Any) -> StoredResponse | None:
    """The caller's stored response (staff: anyone's); None for another owner's, as for one that never was."""
    if not isinstance(response_id, str) or not response_id:
        return None
    return _owned(StoredResponse.objects.all(), user).filter(pk=response_id).first()
