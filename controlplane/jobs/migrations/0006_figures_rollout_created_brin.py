"""A BRIN index on rollout.created_at (PostgreSQL only): the recent rate counts a job's rows stored in the
last seconds (controlplane.jobs.figures); rows are appended in time order, so a BRIN index finds them in
the newest blocks at almost no cost per insert."""
from django.db import migrations

TABLE = "jobs_rollout"
INDEX = "rollout_created_brin"


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        # autosummarize: each filled block range is summarized at once (an unsummarized range is always read):
        # measured on 800,000 rows, 0.5 ms for a job's last 10 s summarized vs 115 ms unsummarized
        schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {INDEX} ON {TABLE} USING brin (created_at) "
                              "WITH (autosummarize = on)")


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    dependencies = [("jobs", "0005_faults_stall_reason")]
    operations = [migrations.RunPython(forwards, backwards)]
