from tests.controlplane.conftest import math_dataset, sim_endpoint, user  # noqa: F401 - the same fixtures
