"""Authentication by API token (django-rest-knox: tokens stored hashed, with an expiry). Kept apart from
the views (controlplane.api.auth): DRF imports it from settings while its own views module loads."""
from hmac import compare_digest

from django.utils import timezone
from knox.auth import TokenAuthentication as KnoxTokenAuthentication
from knox.crypto import hash_token
from knox.signals import token_expired
from rest_framework.exceptions import AuthenticationFailed

EXPIRED_MESSAGE = "Token expired: get a new one with POST /api/auth/token/ (username, password)."


class ExpiringTokenAuthentication(KnoxTokenAuthentication):
    """knox's hashed-token authentication; a token that matched but had expired (knox deletes it and says
    only "Invalid token.") answers a 401 that says so."""

    def authenticate_credentials(self, token: bytes):
        self._presented = token.decode("utf-8", "replace")
        self._expired = False
        try:
            return super().authenticate_credentials(token)
        except AuthenticationFailed:
            if self._expired:
                raise AuthenticationFailed(EXPIRED_MESSAGE, code="token_expired") from None
            raise

    def _cleanup_token(self, auth_token) -> bool:
        """True (and the token deleted) when `auth_token` has expired. Only this token: knox also reads all the
        user's other tokens on every request to delete the expired ones (a query per request, as many rows as
        the user has tokens); issue_token deletes those instead, once per login."""
        if auth_token.expiry is None or auth_token.expiry >= timezone.now():
            return False
        if compare_digest(hash_token(self._presented), auth_token.digest):
            self._expired = True
        username = auth_token.user.get_username()
        auth_token.delete()
        token_expired.send(sender=KnoxTokenAuthentication, username=username, source="auth_token")
        return True
