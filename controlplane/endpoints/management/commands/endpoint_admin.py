"""manage.py endpoint_admin: the old name of `endpoint_ops` (deprecated; operators' scripts may still call it)."""
from __future__ import annotations


from .endpoint_ops import Command as OpsCommand


class Command(OpsCommand):
    help = "Deprecated: use endpoint_ops. " + OpsCommand.help

    def handle(self, *args, **o):
        self.stderr.write("manage.py: 'endpoint_admin' is deprecated; use 'endpoint_ops'")
        return super().handle(*args, **o)
