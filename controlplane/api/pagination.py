"""Keyset (cursor) pagination on the primary key: a page costs the same at row 10 and at row 10^6."""
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.pagination import CursorPagination

BAD_CURSOR = {"cursor": ["not a cursor this API gave out: follow the `next` / `previous` links"]}


def _is_bigint(text) -> bool:
    return (isinstance(text, str) and text.isascii() and 0 < len(text.lstrip("-")) <= 19
            and text.lstrip("-").isdigit() and -(2**63) <= int(text) < 2**63)


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

    def decode_cursor(self, request):
        """DRF's cursor, or a 400 naming it: a forged position (DRF puts it in the query as is: a 500) or
        anything unreadable (DRF's 404)."""
        try:
            cursor = super().decode_cursor(request)
        except NotFound:
            raise ValidationError(BAD_CURSOR) from None
        if cursor is not None and cursor.position is not None and not _is_bigint(cursor.position):
            raise ValidationError(BAD_CURSOR)
        return cursor

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


class ListCursorPagination(IdCursorPagination):
    """Datasets and endpoints: newest first, in pages (a list is never returned whole)."""
    ordering = "-id"
    page_size = 100
    max_page_size = 500
