"""OpenAPI descriptions drf-spectacular cannot derive itself: the API-key scheme and the error responses."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "api.auth.ApiKeyAuthentication"
    name = "apiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "An API key: `Authorization: Bearer fk-...`."}


# What each error status means on /api; every operation documents the ones that can happen to it.
ERRORS = {
    "400": "The request is wrong: `{field: [messages]}` for the body's fields, or `{\"detail\": message}`.",
    "401": "No API key, or a wrong or revoked one (or no signed-in session).",
    "403": "Not allowed: staff only, or a session request without its CSRF token.",
    "404": "No such object, or not yours: another owner's objects are reported as missing.",
    "413": "The body is over FLEET_MAX_BODY_BYTES.",
    "415": "The body is not JSON (or form data).",
    "429": "Over the key's quota; `Retry-After` says when to retry.",
}
DETAIL = {"type": "object", "required": ["detail"], "properties": {"detail": {"type": "string"}},
          "description": "DRF's error shape."}
FIELD_ERRORS = {"type": "object", "minProperties": 1, "additionalProperties": True,
                "description": "DRF's validation errors: each field with a list of messages (nested as the body "
                               "is), `non_field_errors`, or `detail`."}


def document_errors(result, generator, request, public):
    """drf-spectacular postprocessing hook: the error statuses of every /api operation, in DRF's shape.

    Every operation needs a key (401), may be refused (403) or over quota (429); one on an object (`{id}`) may
    find none (404); one with a body or query parameters may be wrong (400); a body may be too large (413) or
    not JSON (415).
    """
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorDetail"], schemas["FieldErrors"] = DETAIL, FIELD_ERRORS
    for path, item in result.get("paths", {}).items():
        for operation in item.values():
            statuses = ["401", "403", "429"] + (["404"] if "{" in path else [])
            if operation.get("requestBody"):
                statuses += ["400", "413", "415"]
            elif any(p.get("in") == "query" for p in operation.get("parameters", [])):
                statuses.append("400")
            for status in statuses:
                shape = "FieldErrors" if status == "400" else "ErrorDetail"
                operation["responses"].setdefault(status, {
                    "description": ERRORS[status],
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}})
    return result
