"""Existing API tokens keep working: each DRF token (plaintext, no expiry, in authtoken_token) becomes a
knox token with the same value, stored as its SHA-512 digest, expiring API_TOKEN_TTL_DAYS from now; then
the plaintext rows are deleted. The table is read with SQL because rest_framework.authtoken is no longer
installed (a fresh database has no such table: nothing to do)."""
from django.conf import settings
from django.db import migrations
from django.utils import timezone


def hash_drf_tokens(apps, schema_editor):
    from knox.crypto import hash_token
    from knox.settings import CONSTANTS, knox_settings

    conn = schema_editor.connection
    if "authtoken_token" not in conn.introspection.table_names():
        return
    AuthToken = apps.get_model("knox", "AuthToken")
    with conn.cursor() as cur:
        cur.execute("SELECT key, user_id FROM authtoken_token")
        rows = cur.fetchall()
    ttl = knox_settings.TOKEN_TTL
    expiry = timezone.now() + ttl if ttl else None
    AuthToken.objects.bulk_create(
        [AuthToken(digest=hash_token(key), token_key=key[:CONSTANTS.TOKEN_KEY_LENGTH], user_id=user_id, expiry=expiry)
         for key, user_id in rows], ignore_conflicts=True)
    with conn.cursor() as cur:
        cur.execute("DELETE FROM authtoken_token")


class Migration(migrations.Migration):
    dependencies = [
        ("knox", "0009_extend_authtoken_field"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]
    operations = [migrations.RunPython(hash_drf_tokens, migrations.RunPython.noop)]
