"""Production settings: the laptop settings plus what a deployment behind TLS needs.

    DJANGO_SETTINGS_MODULE=controlplane.settings_production   (docker/compose.yml sets it)

Refuses to start without a real DJANGO_SECRET_KEY. `manage.py check --deploy` is clean with these.
Expects a TLS-terminating proxy (docker/Caddyfile) that sets X-Forwarded-Proto and X-Forwarded-For.
"""
from .settings import *  # noqa: F401,F403
from .settings import REDIS_URL, REST_FRAMEWORK, env

# Checked when Django starts (controlplane.api.apps): every process on these settings - web server,
# workers, manage.py - refuses to start with the published laptop key or a weak one.
REQUIRE_STRONG_SECRET_KEY = True

DEBUG = False
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=[])  # the site's public name(s); none: every request 400

# Behind the proxy: it terminates TLS and says so.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env.bool("DJANGO_SECURE_SSL_REDIRECT", default=True)
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SESSION_COOKIE_HTTPONLY = True
SECURE_HSTS_SECONDS = env.int("DJANGO_HSTS_SECONDS", default=31536000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("DJANGO_HSTS_INCLUDE_SUBDOMAINS", default=True)
SECURE_HSTS_PRELOAD = env.bool("DJANGO_HSTS_PRELOAD", default=True)
# One cache for every web process: DRF's throttles (they use the default cache) and the dashboard's cached
# figures live in Redis, so N web processes enforce one limit, not N. Short socket timeouts: a Redis
# outage fails a request quickly instead of hanging it.
CACHES = {
    "default": {
        **env.cache("CACHE_URL", default=REDIS_URL),
        "KEY_PREFIX": env("CACHE_KEY_PREFIX", default="cp"),
        "OPTIONS": {"socket_timeout": 2.0, "socket_connect_timeout": 2.0},
    }
}

# Static files: collected into STATIC_ROOT when the image is built (docker/Dockerfile), served by
# whitenoise from there; no finder scans at run time.
WHITENOISE_USE_FINDERS = env.bool("WHITENOISE_USE_FINDERS", default=False)

# One proxy (Caddy) in front by default: throttles and login lockouts key on the address it saw.
WEB_TRUSTED_PROXIES = env.int("WEB_TRUSTED_PROXIES", default=1)
REST_FRAMEWORK = {**REST_FRAMEWORK, "NUM_PROXIES": WEB_TRUSTED_PROXIES}
AXES_IPWARE_PROXY_COUNT = WEB_TRUSTED_PROXIES or None
AXES_IPWARE_META_PRECEDENCE_ORDER = ["HTTP_X_FORWARDED_FOR", "REMOTE_ADDR"] if WEB_TRUSTED_PROXIES else ["REMOTE_ADDR"]

# Where calls may go (model servers, judges, NeMo Gym servers, /stats): the compose vLLM service by default;
# a list of host:port pairs, hosts, ".domain"s or networks (see settings.py).
ENDPOINT_ALLOWED_HOSTS = env.list("ENDPOINT_ALLOWED_HOSTS", default=["vllm:8000"])
