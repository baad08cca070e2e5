from django.apps import AppConfig
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


def weak_secret_key(key: str) -> bool:
    return key == settings.INSECURE_DEFAULT_SECRET_KEY or len(key) < 50 or len(set(key)) < 5


class ApiConfig(AppConfig):
    name = "controlplane.api"
    label = "api"

    def ready(self):
        from controlplane.outbound import install

        install()  # every call out of this process goes through the gate with the settings' policy
        # Production settings refuse to start with the published laptop key (or any weak one).
        if getattr(settings, "REQUIRE_STRONG_SECRET_KEY", False) and weak_secret_key(settings.SECRET_KEY):
            raise ImproperlyConfigured(
                "DJANGO_SECRET_KEY must be set to a random value of at least 50 characters in production "
                "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(64))')")
