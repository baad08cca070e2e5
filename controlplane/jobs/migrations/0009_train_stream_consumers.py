import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("jobs", "0008_train_staleness")]

    operations = [
        migrations.CreateModel(
            name="StreamConsumer",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("name", models.CharField(max_length=100)),
                ("groups", models.BooleanField(default=False, help_text="Batches of complete groups (all repeats of a task)")),
                ("skip_equal", models.BooleanField(default=False, help_text="Groups whose rewards are all equal are left out")),
                ("cursor", models.BigIntegerField(default=0)),
                ("delivered", models.PositiveBigIntegerField(default=0, help_text="Rollouts acknowledged")),
                ("pending_token", models.CharField(blank=True, max_length=64)),
                ("pending_ids", models.JSONField(blank=True, default=list)),
                ("pending_cursor", models.BigIntegerField(default=0)),
                ("acked_token", models.CharField(blank=True, max_length=64)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("updated_at", models.DateTimeField(auto_now=True)),
                ("job", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="stream_consumers",
                                          to="jobs.collectionjob")),
            ],
            options={"constraints": [models.UniqueConstraint(fields=("job", "name"), name="uniq_stream_consumer")]},
        ),
    ]
