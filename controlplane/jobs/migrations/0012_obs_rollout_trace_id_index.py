# An index on Rollout.trace_id (partial: rows with one), for the lookup by trace id from any job (/traces/<id>/).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0011_obs_rollout_trace_id'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='rollout',
            index=models.Index(condition=models.Q(('trace_id', ''), _negated=True), fields=['trace_id'], name='rollout_trace_id'),
        ),
    ]
