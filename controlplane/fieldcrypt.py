"""Secrets at rest: a model field stored encrypted (Fernet: AES-128-CBC + HMAC-SHA256, from `cryptography`),
read back as plain text, so the code that uses the value (the engine's Authorization header) never changes and
a copy of the database (a backup, a dump, a program that read the database file) does not hold the secret.

Keys: FIELD_ENCRYPTION_KEYS (Fernet keys, comma-separated; the first encrypts, every one decrypts, so a key
can be rotated), by default one derived from DJANGO_SECRET_KEY, which every process (web and workers) already
shares. A stored value is "fernet:<token>"; anything else is a value stored before encryption, read as is until
it is saved again (the migration re-saves them all)."""
from __future__ import annotations

import base64
import logging
from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings
from django.db import models

log = logging.getLogger(__name__)

PREFIX = "fernet:"


def derived_key(secret: str, purpose: str = "controlplane field encryption") -> bytes:
    """A Fernet key derived from the deployment's secret key (HKDF-SHA256)."""
    raw = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=purpose.encode()).derive(secret.encode())
    return base64.urlsafe_b64encode(raw)


@lru_cache(maxsize=4)
def _fernet(keys: tuple[str, ...], secret: str) -> MultiFernet:
    return MultiFernet([Fernet(k) for k in keys] if keys else [Fernet(derived_key(secret))])


def fernet() -> MultiFernet:
    return _fernet(tuple(k for k in getattr(settings, "FIELD_ENCRYPTION_KEYS", []) if k), settings.SECRET_KEY)


def encrypt(value: str) -> str:
    return PREFIX + fernet().encrypt(value.encode()).decode("ascii")


def decrypt(stored: str) -> str:
    """The plain text of a stored value; "" (logged) when no key reads it (the secret key changed)."""
    if not stored or not stored.startswith(PREFIX):
        return stored
    try:
        return fernet().decrypt(stored[len(PREFIX):].encode("ascii")).decode()
    except (InvalidToken, ValueError):
        log.error("an encrypted field could not be decrypted: DJANGO_SECRET_KEY or FIELD_ENCRYPTION_KEYS changed "
                  "since it was stored; it reads as empty until it is set again")
        return ""


class EncryptedTextField(models.TextField):
    """Plain text in Python, "fernet:<token>" in the database; an empty value stays empty (so `has a value`
    queries keep working). Lookups on the value itself cannot match (every encryption differs)."""

    def from_db_value(self, value, expression, connection):
        return decrypt(value) if value is not None else value

    def get_prep_value(self, value):
        value = super().get_prep_value(value)
        if not value:
            return value
        return encrypt(str(value))
