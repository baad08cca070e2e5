"""Keyset (cursor) pagination on the primary key: a page costs the same at row 10 and at row 10^6."""
from rest_framework.pagination import CursorPagination


class IdCursorPagination(CursorPagination):
    ordering = "id"
    page_size = 100
    page_size_query_param = "page_size"
    max_page_size = 1000


class MetricCursorPagination(IdCursorPagination):
    page_size = 500
    max_page_size = 5000


class JobCursorPagination(IdCursorPagination):
    ordering = "-id"  # newest first
    page_size = 50
    max_page_size = 500
