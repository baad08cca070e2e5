from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("datasets", "0001_initial")]

    operations = [
        migrations.AddField(model_name="datasetrow", name="task_index", field=models.PositiveIntegerField(null=True)),
        migrations.AddField(model_name="datasetrow", name="occurrence", field=models.PositiveIntegerField(default=0)),
        migrations.AddField(model_name="datasetrow", name="line_digest",
                            field=models.BinaryField(null=True, editable=False)),
    ]
