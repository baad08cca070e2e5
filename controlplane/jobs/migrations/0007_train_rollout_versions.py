from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0006_dropin_output_files"),
        ("jobs", "0006_figures_rollout_created_brin"),
    ]

    operations = [
        migrations.AlterField(
            model_name="rollout", name="weight_version",
            field=models.CharField(blank=True, help_text="The weight version at dispatch", max_length=100),
        ),
        migrations.AddField(
            model_name="rollout", name="completed_version",
            field=models.CharField(blank=True, db_default="", help_text="The weight version in force when it completed",
                                   max_length=100),
        ),
        migrations.AddField(
            model_name="rollout", name="spans_update",
            field=models.BooleanField(default=False, db_default=False, help_text="A weight update happened while it ran "
                                                               "(completed_version != weight_version)"),
        ),
    ]
