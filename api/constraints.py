"""What constrains a generation's output: a JSON response format, a grammar (inline or a handle), a forced tool
call; and which logit biases it carries. Handles are loaded from the database: call from sync code."""

from __future__ import annotations

import json
from typing import Any

from api.errors import invalid
from api.grammars import JSON_GBNF
from api.tools import ToolPlan
from nodes.link.spec import GenerateSpec
from sessions import selectors
from sessions.services import gbnf_problem, handle_used, json_schema_problem


def apply_constraints(spec: GenerateSpec, body: dict[str, Any], plan: ToolPlan | None, user) -> None:
    """At most one of: response_format json, grammar, a forced tool call. Then the logit-bias handle."""
    constraints = []
    fmt = _response_format(body.get("response_format"))
    if fmt is not None:
        constraints.append(("response_format", fmt))
    if body.get("grammar") is not None:
        constraints.append(("grammar", _grammar(body["grammar"], user)))
    tool_schema = plan.schema() if plan else None
    if tool_schema is not None:
        constraints.append(("tool_choice", ("json_schema", json.dumps(tool_schema))))
    if len(constraints) > 1:
        names = " and ".join(name for name, _ in constraints)
        raise invalid(f"Use one of {names}: a generation follows one grammar.", param=constraints[1][0])
    if constraints:
        kind, source = constraints[0][1]
        if kind == "gbnf":
            spec.grammar = source
        else:
            spec.json_schema = source
    if body.get("logit_bias_handle") is not None:
        try:
            handle = selectors.logit_bias_handle_get_active(user=user, handle_id=body["logit_bias_handle"])
        except selectors.HandleUnavailable as exc:
            raise invalid(str(exc), param="logit_bias_handle", code="handle_unavailable") from None
        handle_used(handle=handle)
        spec.logit_bias = {**{int(k): float(v) for k, v in handle.bias.items()}, **spec.logit_bias}


def _response_format(fmt: Any) -> tuple[str, str] | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ("gbnf", JSON_GBNF)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise invalid('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}.',
                          param="response_format", code="invalid_json_schema")
        problem = json_schema_problem(schema)
        if problem:
            raise invalid(f"response_format: {problem}", param="response_format", code="invalid_json_schema")
        return ("json_schema", json.dumps(schema))
    raise invalid('response_format.type must be "text", "json_object" or "json_schema".', param="response_format")


def _grammar(grammar: Any, user) -> tuple[str, str]:
    """`grammar`: a grammar handle id, or GBNF text."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise invalid("grammar must be a grammar handle id or GBNF text.", param="grammar")
    if selectors.as_uuid(grammar.strip()) is not None:
        try:
            handle = selectors.grammar_handle_get_active(user=user, handle_id=grammar.strip())
        except selectors.HandleUnavailable as exc:
            raise invalid(str(exc), param="grammar", code="handle_unavailable") from None
        handle_used(handle=handle)
        if handle.kind != "gbnf":
            return ("json_schema", handle.source)
        grammar = handle.source  # checked again: a handle kept before today's bounds may exceed them
    problem = gbnf_problem(grammar)
    if problem:
        raise invalid(f"grammar: {problem}", param="grammar", code="invalid_grammar")
    return ("gbnf", grammar)
