# Built concurrently on PostgreSQL (ugent_common.migration_ops).

from django.db import migrations, models

from ugent_common.migration_ops import AddIndexConcurrently

# The turn's summary read (the newest visible system message of a conversation) walked the conversation's
# messages backwards until it met one: all of them in a conversation never compacted. Only system messages
# are in this index, so it costs the turn's user and assistant inserts nothing.
INDEX = models.Index(condition=models.Q(('role', 'system')), fields=['conversation', 'id'],
                     name='message_conv_system')


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY runs outside a transaction

    dependencies = [
        ('channels_app', '0011_steering_client_message_id'),
    ]

    operations = [AddIndexConcurrently('message', INDEX)]
