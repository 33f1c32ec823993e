"""Writes for conversations, generation records and handles.

A generation's durable trace is written once, when it ends: one Generation row and the session's new messages,
in one transaction (`generation_record`). Nothing here runs per token.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Max
from django.utils import timezone

from nodes.link.gbnf import repetition_problem
from nodes.models import Node
from sessions.models import Generation, GrammarHandle, InferenceSession, LogitBiasHandle, Message, StoredResponse
from sessions.writer import writers

MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
LOGIT_BIAS_LIMIT = 100.0
MAX_TOKEN_ID = 10**9 - 1  # beyond any vocabulary; and a bigger number may not fit the link's integers


# --- sessions -------------------------------------------------------------------------------------------------


def session_create(*, model: str, owner=None, api_key=None, title: str = "", system_prompt: str = "",
                   metadata: dict | None = None, messages: list[dict] | None = None) -> InferenceSession:
    """A new conversation, optionally seeded with messages (for example an example exchange)."""
    model = model.strip()
    if not model:
        raise ValueError("a session needs a model")
    with transaction.atomic():
        session = InferenceSession.objects.create(
            model=model, owner=owner, api_key=api_key, title=title.strip(), system_prompt=system_prompt,
            metadata=metadata or {},
        )
        if messages:
            session_append(session=session, messages=messages)
    return session


def session_append(*, session: InferenceSession, messages: list[dict], generation: Generation | None = None,
                   token_counts: dict[int, int] | None = None) -> list[Message]:
    """Append messages (OpenAI-style dicts) after the session's last one.

    The session row is locked first, so two generations ending together on one session get consecutive indexes.
    """
    for message in messages:
        if message.get("role") not in Message.Role.values:
            raise ValueError(f"unknown message role {message.get('role')!r}; use one of {', '.join(Message.Role)}")
    with transaction.atomic():
        InferenceSession.objects.select_for_update().filter(pk=session.pk).first()
        last = Message.objects.filter(session=session).aggregate(m=Max("index"))["m"]
        start = 0 if last is None else last + 1
        rows = [
            Message(
                session=session, index=start + i, role=m["role"], content=_text(m.get("content")),
                name=m.get("name") or "", tool_calls=m.get("tool_calls") or None,
                tool_call_id=m.get("tool_call_id") or "", generation=generation,
                token_count=(token_counts or {}).get(i),
            )
            for i, m in enumerate(messages)
        ]
        created = Message.objects.bulk_create(rows)
        InferenceSession.objects.filter(pk=session.pk).update(updated_at=timezone.now())
    return created


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def session_delete(*, session: InferenceSession) -> None:
    """Delete a conversation and its messages; its generation records stay (their session becomes empty)."""
    session.delete()


# --- generation records ---------------------------------------------------------------------------------------


@dataclass
class GenerationTrace:
    """What the interface knows when a generation ends; `outcome` is fleet.dispatch.Outcome (or alike)."""

    gen_id: str
    kind: str
    model: str
    status: str
    outcome: Any
    parameters: dict = field(default_factory=dict)
    error: str = ""
    api_key_id: Any = None
    session_id: Any = None
    new_messages: list[dict] = field(default_factory=list)  # the request's messages, then the answer
    finished_at: float | None = None


async def generation_record_async(trace: GenerationTrace) -> Generation:
    """generation_record on a writer thread (sessions.writer), whose database connection stays open between writes;
    with FLEET_RECORD_WRITERS 0, on the caller's own thread and connection (what a test's rolled-back transaction
    sees: tests/conftest.py)."""
    if settings.FLEET_RECORD_WRITERS <= 0:
        return await sync_to_async(generation_record)(trace)
    return await writers().run(generation_record, trace)


def generation_record(trace: GenerationTrace) -> Generation:
    """Write one Generation row and, when it answered in a session, that session's new messages: once, together.

    The row names the node that ran it. A node deleted since (from the admin) fails the write's
    foreign key when it commits; the record is then written once more, without the node."""
    node_id = trace.outcome.node_id or None
    try:
        return _generation_write(trace, node_id)
    except IntegrityError:
        if node_id is None or Node.objects.filter(pk=node_id).exists():
            raise
        return _generation_write(trace, None)


def _generation_write(trace: GenerationTrace, node_id: str | None) -> Generation:
    out = trace.outcome
    finished = trace.finished_at or datetime.now(UTC).timestamp()
    started = out.started_at
    first = out.first_token_at
    decode_s = finished - first if first else 0.0
    with transaction.atomic():
        generation = Generation.objects.create(
            id=uuid.UUID(trace.gen_id), kind=trace.kind, model=trace.model, status=trace.status,
            session_id=trace.session_id, api_key_id=trace.api_key_id, node_id=node_id,
            nodes_used=list(out.nodes_used), finish_reason=out.finish_reason or "",
            prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens, completion_tokens=out.completion_tokens,
            ttft_ms=(first - started) * 1000 if first else None, duration_ms=(finished - started) * 1000,
            decode_tps=(out.completion_tokens / decode_s) if decode_s > 0 and out.completion_tokens else None,
            parameters=_jsonable(trace.parameters), placement=_jsonable(out.placement), error=trace.error,
            trace_id=getattr(out, "trace_id", ""),
            created_at=datetime.fromtimestamp(started, UTC), finished_at=datetime.fromtimestamp(finished, UTC),
        )
        if trace.session_id and trace.new_messages and trace.status == Generation.Status.DONE:
            session = InferenceSession.objects.get(pk=trace.session_id)
            last = len(trace.new_messages) - 1
            session_append(session=session, messages=trace.new_messages, generation=generation,
                           token_counts={last: out.completion_tokens})
    return generation


def _jsonable(value: Any) -> Any:
    """`value` as stored JSON. A NUL character becomes U+FFFD: PostgreSQL's jsonb cannot hold one, and a record
    is never lost over a parameter's odd character."""
    text = json.dumps(value, default=str)
    stored = json.loads(text)
    # json.dumps writes every NUL as the escape \u0000: with none in the text, no string or key holds one, and the
    # record skips the walk
    return _without_nul(stored) if "\\u0000" in text else stored


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_without_nul(key): _without_nul(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_without_nul(item) for item in value]
    return value


def nul_problem(value: Any, where: str) -> str | None:
    """Why a JSON value cannot be stored as given: a NUL character in one of its strings or keys (PostgreSQL
    refuses them); None when it can."""
    if isinstance(value, str):
        return f"{where} holds a NUL character (\\u0000), which cannot be stored" if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            problem = nul_problem(key, where) or nul_problem(item, where)
            if problem:
                return problem
    if isinstance(value, list):
        for item in value:
            problem = nul_problem(item, where)
            if problem:
                return problem
    return None


# --- handles --------------------------------------------------------------------------------------------------


def json_schema_problem(schema: Any) -> str | None:
    """Why `schema` is not a usable JSON schema, or None when it is."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    if not isinstance(schema, dict):
        return "a JSON schema must be a JSON object"
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        return f"invalid JSON schema at {where}: {exc.message}"
    return None


def gbnf_problem(source: str) -> str | None:
    """A cheap check of a GBNF grammar before it travels to a node (which compiles it for real)."""
    if not source.strip():
        return "the grammar is empty"
    if not any(line.strip().startswith("root") and "::=" in line for line in source.splitlines()):
        return "a GBNF grammar needs a `root ::= ...` rule"
    return repetition_problem(source)


def grammar_handle_create(*, kind: str, source: str | dict, name: str = "", owner=None, api_key=None) -> GrammarHandle:
    """Keep a grammar on the head; generations name it by id. A JSON schema may be given as an object or text."""
    if kind == GrammarHandle.Kind.JSON_SCHEMA:
        schema = source
        if isinstance(source, str):
            try:
                schema = json.loads(source)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        problem = json_schema_problem(schema)
        source = json.dumps(schema)
    elif kind == GrammarHandle.Kind.GBNF:
        if not isinstance(source, str):
            raise ValueError("a GBNF grammar is text")
        problem = gbnf_problem(source)
    else:
        raise ValueError(f"unknown grammar kind {kind!r}; use gbnf or json_schema")
    if problem:
        raise ValueError(problem)
    return GrammarHandle.objects.create(kind=kind, source=source, name=name.strip(), owner=owner, api_key=api_key)


def grammar_handle_free(*, handle: GrammarHandle) -> bool:
    """Free a handle: generations naming it get a 400 from now on. False when it already was freed."""
    return bool(GrammarHandle.objects.filter(pk=handle.pk, freed_at__isnull=True).update(freed_at=timezone.now()))


def logit_bias_clean(bias: Any) -> dict[str, float]:
    """OpenAI's `{"<token id>": bias}` map, checked: integer ids, biases in [-100, 100]."""
    if not isinstance(bias, dict):
        raise ValueError('logit_bias must be an object like {"1234": -100}')
    clean: dict[str, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias key {key!r} is not a token id") from None
        if not 0 <= token <= MAX_TOKEN_ID:
            raise ValueError(f"logit_bias key {key!r} is not a token id (0 to {MAX_TOKEN_ID})")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"logit_bias value for {key!r} must be a number")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias value for {key!r} must be between -100 and 100")
        clean[str(token)] = float(value)
    return clean


def logit_bias_handle_create(*, bias: Any, name: str = "", owner=None, api_key=None) -> LogitBiasHandle:
    return LogitBiasHandle.objects.create(bias=logit_bias_clean(bias), name=name.strip(), owner=owner, api_key=api_key)


def logit_bias_handle_free(*, handle: LogitBiasHandle) -> bool:
    return bool(LogitBiasHandle.objects.filter(pk=handle.pk, freed_at__isnull=True).update(freed_at=timezone.now()))


def handle_used(*, handle: GrammarHandle | LogitBiasHandle) -> None:
    """A generation named the handle: its time-to-live starts over (written at most once a minute per handle)."""
    now = timezone.now()
    if handle.updated_at < now - timedelta(minutes=1):
        type(handle).objects.filter(pk=handle.pk).update(updated_at=now)


# --- maintenance (Celery beat; each run does what is due and nothing twice) ------------------------------------


def _cutoff(days: int) -> datetime | None:
    return timezone.now() - timedelta(days=days) if days > 0 else None


def session_expire(*, ttl_days: int) -> int:
    """Delete the conversations untouched for `ttl_days` (0: keep them), with their messages; their generation
    records stay. Returns how many went."""
    cutoff = _cutoff(ttl_days)
    if cutoff is None:
        return 0
    return InferenceSession.objects.filter(updated_at__lt=cutoff).delete()[1].get(InferenceSession._meta.label, 0)


def stored_response_expire(*, ttl_days: int) -> int:
    """Delete the stored /v1/responses answers older than `ttl_days` (0: keep them): they live as long as an
    untouched conversation does. Returns how many went."""
    cutoff = _cutoff(ttl_days)
    if cutoff is None:
        return 0
    return StoredResponse.objects.filter(created_at__lt=cutoff).delete()[1].get(StoredResponse._meta.label, 0)


def stored_response_create(*, response_id: str, model: str, api_key=None, previous: StoredResponse | None = None,
                           messages: list[dict], input_items: list[dict], body: dict) -> StoredResponse:
    """The client's input is refused with a NUL in it (api.responses_api); a NUL the model wrote is kept as U+FFFD, as
    in a generation's record."""
    return StoredResponse.objects.create(
        id=response_id, model=model, api_key=api_key, owner=api_key.owner if api_key is not None else None,
        previous=previous, messages=_jsonable(messages), input_items=_jsonable(input_items), body=_jsonable(body))


def stored_response_delete(*, stored: StoredResponse) -> None:
    stored.delete()


def handle_expire(*, ttl_days: int) -> int:
    """Free the grammar and logit-bias handles no generation named for `ttl_days` (0: never). Returns how many."""
    cutoff = _cutoff(ttl_days)
    if cutoff is None:
        return 0
    now = timezone.now()
    return sum(model.objects.filter(freed_at__isnull=True, updated_at__lt=cutoff).update(freed_at=now)
               for model in (GrammarHandle, LogitBiasHandle))


def generation_purge(*, retention_days: int, chunk: int = 2000) -> int:
    """Delete generation records older than `retention_days` (0: keep them), `chunk` rows a statement so no
    transaction holds the table long. Returns how many went."""
    cutoff = _cutoff(retention_days)
    purged = 0
    while cutoff is not None:
        ids = list(Generation.objects.filter(created_at__lt=cutoff).values_list("pk", flat=True)[:chunk])
        if not ids:
            break
        purged += Generation.objects.filter(pk__in=ids).delete()[1].get(Generation._meta.label, 0)
    return purged
