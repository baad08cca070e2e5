"""Keyset (cursor) pagination on the primary key: a page costs the same at row 10 and at row 10^6."""
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import CursorPagination


class IdCursorPagination(CursorPagination):
    ordering = "id"
    page_size = 100
    page_size_query_param = "page_size"
    max_page_size = 1000

    def get_page_size(self, request):
        raw = request.query_params.get(self.page_size_query_param)
        if raw is None:
            return self.page_size
        if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= self.max_page_size:
            # DRF would silently fall back to the default; a client asking for the impossible should know.
            raise ValidationError({self.page_size_query_param: [f"an integer from 1 to {self.max_page_size}"]})
        return int(raw)

    def get_schema_operation_parameters(self, view):
        params = super().get_schema_operation_parameters(view)
        for p in params:
            if p["name"] == self.page_size_query_param:
                p["schema"] = {"type": "integer", "minimum": 1, "maximum": self.max_page_size}
        return params


class MetricCursorPagination(IdCursorPagination):
    page_size = 500
    max_page_size = 5000


class JobCursorPagination(IdCursorPagination):
    ordering = "-id"  # newest first
    page_size = 50
    max_page_size = 500
