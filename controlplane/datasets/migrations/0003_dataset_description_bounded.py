"""Dataset descriptions are bounded (2,000 characters): longer ones stored before are cut first."""
from django.db import migrations, models
from django.db.models.functions import Length, Substr

MAX = 2000


def cut_long_descriptions(apps, schema_editor):
    Dataset = apps.get_model("datasets", "Dataset")
    Dataset.objects.annotate(n=Length("description")).filter(n__gt=MAX).update(description=Substr("description", 1, MAX))


class Migration(migrations.Migration):

    dependencies = [
        ('datasets', '0002_nemogym_task_index'),
    ]

    operations = [
        migrations.RunPython(cut_long_descriptions, migrations.RunPython.noop),
        migrations.AlterField(
            model_name='dataset',
            name='description',
            field=models.CharField(blank=True, max_length=2000),
        ),
    ]
