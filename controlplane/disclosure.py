"""What a user may read of errors about calls out: staff everything stored, everyone else the product's own
words (status code, error class, a reason) and never a server's body or banner (workers.disclosure).

Applied wherever such text reaches a user: the API's serializers, the dashboard's pages (the `shown_to` filter)
and sockets, exports. Operators find the full text in the same places (as staff) and in the logs.
"""
from __future__ import annotations

from workers.disclosure import public, public_tree


def sees_everything(user) -> bool:
    return bool(getattr(user, "is_staff", False))


def error_for(user, text):
    """An error message as `user` may read it."""
    return text if sees_everything(user) else public(text)


def shown_for(user, value):
    """A report (health, pre-warm, ops result, aggregates: any JSON-like value) as `user` may read it."""
    return value if sees_everything(user) else public_tree(value)
