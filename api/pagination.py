"""Pagination of the management API: DRF's limit/offset, but a bad `limit` or `offset` is a 400 that names it.

DRF falls back to the defaults when either is not a positive whole number, so `?offset=ten` silently answered
the first page; and an offset past what the database can hold was a 500.
"""

from __future__ import annotations

from rest_framework import pagination
from rest_framework.exceptions import ValidationError

MAX_LIMIT = 1000
MAX_OFFSET = 2**31 - 1


class LimitOffsetPagination(pagination.LimitOffsetPagination):
    max_limit = MAX_LIMIT

    def get_limit(self, request) -> int:
        return self._whole(request, self.limit_query_param, 1, MAX_LIMIT, self.default_limit)

    def get_offset(self, request) -> int:
        return self._whole(request, self.offset_query_param, 0, MAX_OFFSET, 0)

    @staticmethod
    def _whole(request, name: str, lo: int, hi: int, default: int) -> int:
        raw = request.query_params.get(name)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise ValidationError({name: [f"{name} must be a whole number from {lo} to {hi}; got {raw!r}."]})
        return value

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        bounds = {self.limit_query_param: (1, MAX_LIMIT), self.offset_query_param: (0, MAX_OFFSET)}
        for parameter in parameters:
            lo, hi = bounds[parameter["name"]]
            parameter["schema"] = {**parameter["schema"], "minimum": lo, "maximum": hi}
        return parameters
