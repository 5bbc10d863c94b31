from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('channels_app', '0017_steering_key_index'),
    ]

    operations = [
        migrations.AddField(
            model_name='conversation',
            name='hidden_messages',
            field=models.PositiveIntegerField(default=0, editable=False, help_text='How many of its messages compaction has hidden, kept by compaction: the session tail\'s hidden_count.'),
        ),
    ]
