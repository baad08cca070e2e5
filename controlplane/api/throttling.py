"""Per-user (per-token) throttling. Rates come from REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"] and are read
at request time (DRF's stock classes bind the rates at import, which defeats override_settings)."""
from rest_framework import throttling
from rest_framework.settings import api_settings


class _LiveRates:
    def get_rate(self):
        try:
            return api_settings.DEFAULT_THROTTLE_RATES[self.scope]
        except KeyError:
            return None  # no rate configured for this scope: not throttled


class UserRateThrottle(_LiveRates, throttling.UserRateThrottle):
    """Authenticated requests are counted per user (a token belongs to one user); anonymous per IP."""


class AnonRateThrottle(_LiveRates, throttling.AnonRateThrottle):
    pass
