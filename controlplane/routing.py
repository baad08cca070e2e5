"""WebSocket routes; each app contributes its own patterns."""
from controlplane.dashboard.routing import websocket_urlpatterns as dashboard_ws

websocket_urlpatterns = [*dashboard_ws]
