# Built concurrently on PostgreSQL (ugent_common.migration_ops).

from django.db import migrations, models

from ugent_common.migration_ops import (index_add_concurrently, index_added_concurrently,
                                         index_remove_concurrently)

# The turn's summary read (the newest visible system message of a conversation) walked the conversation's
# messages backwards until it met one: all of them in a conversation never compacted. Only system messages
# are in this index, so it costs the turn's user and assistant inserts nothing.
INDEX = models.Index(condition=models.Q(('role', 'system')), fields=['conversation', 'id'],
                     name='message_conv_system')


def _add(apps, schema_editor):
    index_add_concurrently(apps, schema_editor, 'channels_app', 'Message', INDEX)


def _remove(apps, schema_editor):
    index_remove_concurrently(apps, schema_editor, 'channels_app', 'Message', INDEX)


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY runs outside a transaction

    dependencies = [
        ('channels_app', '0011_steering_client_message_id'),
    ]

    operations = [index_added_concurrently('Message', INDEX, _add, _remove)]
