"""Per-user (per-token) throttling. Rates come from REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"] and are read
at request time (DRF's stock classes bind the rates at import, which defeats override_settings)."""
from rest_framework import exceptions, throttling
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


class InFlightThrottle(throttling.BaseThrottle):
    """At most API_USER_MAX_IN_FLIGHT requests of one user (anonymous: one address) open at once in this web
    process, counted until the answer's last part is sent (controlplane.inflight): one user's slow requests
    cannot hold every pooled database connection."""

    def allow_request(self, request, view):
        from django.conf import settings

        from controlplane import inflight

        cap = int(settings.API_USER_MAX_IN_FLIGHT)
        if cap <= 0:
            return True
        user = getattr(request, "user", None)
        key = f"user:{user.pk}" if user is not None and user.is_authenticated else f"addr:{self.get_ident(request)}"
        release = inflight.acquire(key, cap)
        if release is None:
            raise exceptions.Throttled(wait=1, detail=(
                f"{cap} of your requests are open on this server already (API_USER_MAX_IN_FLIGHT): "
                "wait for one to finish (a long-poll take or a streamed answer holds its place until sent)"))
        inflight.release_when_done(request._request, release)
        return True
