"""A browser's live sockets end with its session: logging out closes them at once (user_logged_out sends to
the session's group, which every socket of that session joined), and a socket whose session has gone another
way (expired, deleted, another user logged in) notices at its next send (checked at most every
SESSION_RECHECK_S)."""
from __future__ import annotations

import hashlib
import logging
from importlib import import_module

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.contrib.auth import SESSION_KEY, user_logged_out

log = logging.getLogger(__name__)

SESSION_RECHECK_S = 30.0
ENDED_MESSAGE_TYPE = "session.ended"


def session_group(session_key: str) -> str:
    """The Channels group of one session's sockets (a digest: the key itself never goes to Redis)."""
    return "session-" + hashlib.sha256(session_key.encode()).hexdigest()[:40]


def session_user_id(session_key: str) -> str | None:
    """The user id the session store holds now for this key (None: logged out, expired, deleted)."""
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key=session_key)
    return store.get(SESSION_KEY)


def _close_sockets(sender, request, user, **kwargs):
    key = getattr(getattr(request, "session", None), "session_key", None)
    if not key:
        return
    try:
        async_to_sync(get_channel_layer().group_send)(session_group(key), {"type": ENDED_MESSAGE_TYPE})
    except Exception as exc:  # noqa: BLE001 - logging out never fails; the sockets notice at their next send
        log.warning("could not tell this session's sockets that it ended: %s", exc)


def connect_signals():
    user_logged_out.connect(_close_sockets, dispatch_uid="dashboard-close-session-sockets")
