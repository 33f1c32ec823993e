"""Tool calling on models without a native tool format: tools rendered into a system prompt, the reply parsed back.

The model is asked to answer a call with only `{"name": ..., "arguments": {...}}`. With `tool_choice` "required"
or a named function, the reply is constrained to that shape with a JSON schema built from the tools' parameters,
so it always parses; with "auto" the model may answer in prose, and only a reply that parses as a call to a
known tool becomes `tool_calls`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from api.errors import invalid
from sessions.services import json_schema_problem

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass
class ToolPlan:
    """The tools a chat request offers and how the model must use them."""

    functions: dict[str, dict[str, Any]]  # name -> {"name", "description", "parameters"}
    mode: str  # "auto" | "required" | "named"
    forced: str | None = None

    def system_prompt(self) -> str:
        listing = json.dumps(list(self.functions.values()), ensure_ascii=False)
        lines = [
            "You can call functions to answer. The functions, as JSON:",
            listing,
            'To call a function, reply with only a JSON object {"name": "<function name>", "arguments": '
            "{<the arguments, as the function's parameters describe>}} and nothing else.",
        ]
        if self.mode == "named":
            lines.append(f"Call the function {self.forced!r} now.")
        elif self.mode == "required":
            lines.append("Call one of these functions now.")
        else:
            lines.append("If no function is needed, answer the user directly in plain text.")
        return "\n".join(lines)

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema that forces a call ("required" or a named function); None for "auto"."""
        if self.mode == "auto":
            return None
        names = [self.forced] if self.mode == "named" else list(self.functions)
        options = [_call_schema(name, self.functions[name]["parameters"]) for name in names]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI `tool_calls` when `text` is a call (or a list of calls) to known tools, else None."""
        body = text.strip()
        fenced = FENCE.match(body)
        if fenced:
            body = fenced.group(1)
        if not body.startswith(("{", "[")):
            return None
        try:
            value = json.loads(body)
        except ValueError:
            return None
        calls = value if isinstance(value, list) else [value]
        parsed = [self._call(c) for c in calls]
        if not parsed or any(c is None for c in parsed):
            return None
        return parsed

    def _call(self, value: Any) -> dict[str, Any] | None:
        if not isinstance(value, dict):
            return None
        name = value.get("name") or value.get("function")
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(name, str) or name not in self.functions or not isinstance(arguments, dict):
            return None
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [name]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_plan(body: dict[str, Any]) -> ToolPlan | None:
    """Validate `tools` and `tool_choice`; None when the request offers no tools (or tool_choice is "none")."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools: list the functions in `tools`.", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise invalid("tools must be a list of {type: function, function: {...}} objects.", param="tools")
    functions = dict(_function(i, tool) for i, tool in enumerate(tools))
    if choice is None or choice == "auto":
        return ToolPlan(functions, "auto")
    if choice == "none":
        return None
    if choice == "required":
        return ToolPlan(functions, "required")
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise invalid('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": ...}}.', param="tool_choice")
    if name not in functions:
        raise invalid(f"tool_choice names {name!r}, which is not in tools ({', '.join(functions)}).",
                      param="tool_choice")
    return ToolPlan(functions, "named", name)


def _function(index: int, tool: Any) -> tuple[str, dict[str, Any]]:
    param = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
            tool.get("function"), dict):
        raise invalid(f"{param} must be {{type: function, function: {{name, description, parameters}}}}.",
                      param=param)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid(f"{param}.function.name must be 1-64 letters, digits, _ or -.", param=f"{param}.function.name")
    parameters = fn.get("parameters") or {"type": "object", "properties": {}}
    problem = json_schema_problem(parameters)
    if problem:
        raise invalid(f"{param}.function.parameters: {problem}", param=f"{param}.function.parameters",
                      code="invalid_json_schema")
    entry = {"name": name, "description": str(fn.get("description") or ""), "parameters": parameters}
    return name, entry
