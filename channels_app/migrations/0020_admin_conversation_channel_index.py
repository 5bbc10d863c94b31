# Built concurrently on PostgreSQL (ugent_common.migration_ops).

from django.db import migrations, models

from ugent_common.migration_ops import AddIndexConcurrently

# The admin's list of a channel's conversations, newest first: SQLite sorted all of the channel's each page load.
INDEX = models.Index(fields=['channel', 'id'], name='conversation_channel_id')


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY runs outside a transaction

    dependencies = [
        ('channels_app', '0019_count_hidden_messages'),
    ]

    operations = [AddIndexConcurrently('conversation', INDEX)]
