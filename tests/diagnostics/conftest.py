"""Reuse the controlplane factories (user, math_dataset, sim_endpoint)."""
from tests.controlplane.conftest import math_dataset, math_rows, sim_endpoint, user  # noqa: F401
