"""Domain errors the API maps to its error shape (controlplane.rest.exceptions), importable without DRF: the
models raise them, and a process that serves no API (the drop-in CLI, a worker) need not import DRF for them."""


class InvalidTransition(Exception):
    """An action that does not fit an object's current state (the API answers 409)."""
