# A rollout's W3C trace id (the traceparent of its model requests).
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("jobs", "0010_merge_train")]

    operations = [
        migrations.AddField(
            model_name="rollout",
            name="trace_id",
            field=models.CharField(blank=True, default="", db_default="", max_length=32,
                                   help_text="W3C trace id sent in the traceparent of each of its model requests"),
        ),
    ]
