from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0005_faults_stall_reason"),
    ]

    operations = [
        migrations.AddField(
            model_name="collectionjob",
            name="output_files",
            field=models.JSONField(blank=True, default=dict,
                                   help_text="The CLI's output files: where this job's lines begin in each"),
        ),
        migrations.AddField(
            model_name="collectionjob",
            name="collection_options",
            field=models.JSONField(blank=True, default=dict),
        ),
    ]
