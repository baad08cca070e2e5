"""ASGI entry point: HTTP through Django, WebSockets through Channels (authenticated)."""
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from controlplane.bodylimit import BodySizeLimitMiddleware  # noqa: E402
from controlplane.inflight import InFlightMiddleware  # noqa: E402
from controlplane.routing import websocket_urlpatterns  # noqa: E402
from controlplane.senddeadline import SendDeadlineMiddleware  # noqa: E402

application = ProtocolTypeRouter(
    {
        # Bodies over the limit are refused before Django reads them (see controlplane.bodylimit); a client that
        # stops reading an answer is let go (controlplane.senddeadline); a request's place among its user's open
        # ones is freed however it ended (controlplane.inflight).
        "http": InFlightMiddleware(SendDeadlineMiddleware(BodySizeLimitMiddleware(django_asgi_app))),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
