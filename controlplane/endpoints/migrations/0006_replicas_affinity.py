from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('endpoints', '0005_apischema_admin_actions'),
    ]

    operations = [
        migrations.AddField(
            model_name='endpoint',
            name='replica_affinity',
            field=models.BooleanField(default=True, help_text='Send the repeats of one task to one replica (its prefix cache serves the shared prompt); a replica out of rotation or overloaded is left for the least loaded one'),
        ),
    ]
