from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0004_verification_runs_and_cache"),
    ]

    operations = [
        migrations.AddField(
            model_name="collectionjob",
            name="stall_reason",
            field=models.TextField(blank=True, default="", help_text="Why the watchdog flagged the job stalled"),
        ),
    ]
