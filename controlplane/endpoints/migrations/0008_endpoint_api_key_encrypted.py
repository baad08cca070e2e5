"""Endpoint API keys are encrypted at rest (controlplane/fieldcrypt.py): the column becomes text and every key
stored in plain text is encrypted; backwards, they are decrypted again."""
import controlplane.fieldcrypt
import django.core.validators
from django.db import migrations


def encrypt_stored_keys(apps, schema_editor):
    Endpoint = apps.get_model("endpoints", "Endpoint")
    for endpoint in Endpoint.objects.exclude(api_key="").only("pk", "api_key").iterator():
        endpoint.save(update_fields=["api_key"])  # read as is (plain text), written encrypted


def decrypt_stored_keys(apps, schema_editor):
    table = apps.get_model("endpoints", "Endpoint")._meta.db_table
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(f"SELECT id, api_key FROM {table} WHERE api_key LIKE 'fernet:%%'")
        rows = cursor.fetchall()
        for pk, stored in rows:
            cursor.execute(f"UPDATE {table} SET api_key = %s WHERE id = %s",
                           [controlplane.fieldcrypt.decrypt(stored)[:500], pk])


class Migration(migrations.Migration):

    dependencies = [
        ('endpoints', '0007_scale_endpoint_worker_queue'),
    ]

    operations = [
        migrations.AlterField(
            model_name='endpoint',
            name='api_key',
            field=controlplane.fieldcrypt.EncryptedTextField(blank=True, validators=[django.core.validators.MaxLengthValidator(500)]),
        ),
        migrations.RunPython(encrypt_stored_keys, decrypt_stored_keys),
    ]
