"""A self-contained docs page for the management API, rendered on the server from the OpenAPI schema.

Swagger UI and Redoc load their scripts from a CDN, which an offline head cannot reach (and drf-spectacular's
sidecar is not installed), so this page is plain HTML: every path, method, summary, parameter and body field.
"""

from __future__ import annotations

from django.shortcuts import render
from django.views.decorators.http import require_GET
from drf_spectacular.generators import SchemaGenerator

METHODS = ("get", "post", "put", "patch", "delete")


@require_GET
def api_docs(request):
    schema = SchemaGenerator().get_schema(request=None, public=True)
    components = schema.get("components", {}).get("schemas", {})
    operations = []
    for path, item in sorted(schema.get("paths", {}).items()):
        for method in METHODS:
            op = item.get(method)
            if op is None:
                continue
            operations.append({
                "path": path, "method": method.upper(), "summary": op.get("summary") or "",
                "description": op.get("description") or "", "tag": (op.get("tags") or [""])[0],
                "parameters": [p for p in op.get("parameters", []) if p.get("in") in ("query", "path")],
                "body": _fields(_body_ref(op), components),
            })
    return render(request, "api/docs.html", {"info": schema.get("info", {}), "operations": operations})


def _body_ref(op: dict) -> str | None:
    content = (op.get("requestBody") or {}).get("content", {})
    schema = (content.get("application/json") or {}).get("schema", {})
    ref = schema.get("$ref", "")
    return ref.rsplit("/", 1)[-1] if ref else None


def _fields(name: str | None, components: dict) -> list[dict]:
    if not name or name not in components:
        return []
    component = components[name]
    required = set(component.get("required", []))
    return [
        {"name": field, "type": spec.get("type") or ("object" if "$ref" in spec else ""),
         "required": field in required, "read_only": spec.get("readOnly", False),
         "description": spec.get("description", "")}
        for field, spec in component.get("properties", {}).items()
        if not spec.get("readOnly")
    ]
