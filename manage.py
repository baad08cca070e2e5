#!/usr/bin/env python
"""Django's command-line utility for the control plane."""
import os
import sys


def main():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    collect = len(sys.argv) > 1 and sys.argv[1] == "collect_rollouts"
    if collect:  # its verifier pool warms while Django sets up; no interpreter teardown after the summary
        os.environ.setdefault("CONTROLPLANE_LEAN_CLI", "1")  # settings: no daphne (it only serves runserver)
        from workers.cli_start import prewarm_from_argv, quick_exit

        prewarm_from_argv(sys.argv)
    from django.core.management import execute_from_command_line

    if not collect:
        execute_from_command_line(sys.argv)
        return
    code = 0
    try:
        execute_from_command_line(sys.argv)
    except SystemExit as exc:
        code = exc.code
    from django.db import connections

    connections.close_all()  # quick_exit skips the interpreter's teardown, so close them here
    quick_exit(code)


if __name__ == "__main__":
    main()
