from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("jobs", "0007_train_rollout_versions")]

    operations = [
        migrations.AddField(
            model_name="collectionjob", name="max_version_lag",
            field=models.PositiveIntegerField(blank=True, help_text="The largest version lag a trainer accepts (null: any)",
                                              null=True),
        ),
        migrations.AddField(
            model_name="collectionjob", name="stale_policy",
            field=models.CharField(choices=[("recollect", "Recollect"), ("mark", "Mark")], default="mark", max_length=10),
        ),
        migrations.AddField(
            model_name="rollout", name="stale",
            field=models.BooleanField(default=False, db_default=False, help_text="Past the job's max_version_lag when it was to be handed "
                                                               "out: kept (stale_policy mark), never streamed"),
        ),
    ]
