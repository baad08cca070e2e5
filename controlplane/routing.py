"""WebSocket routes; each app contributes its own patterns."""
websocket_urlpatterns = []
