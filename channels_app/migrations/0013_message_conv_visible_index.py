# Built concurrently on PostgreSQL (ugent_common.migration_ops).

from django.db import migrations, models

from ugent_common.migration_ops import AddIndexConcurrently

# The turn's history read (the newest visible user and assistant messages) walked the conversation's messages
# backwards until it had its limit: in a compacted conversation with fewer visible than that, every hidden
# message, on each turn after a compaction. The session tail's page read goes through it too.
INDEX = models.Index(condition=models.Q(('hidden', False)), fields=['conversation', 'id'],
                     name='message_conv_visible')


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY runs outside a transaction

    dependencies = [
        ('channels_app', '0012_message_conv_system_index'),
    ]

    operations = [AddIndexConcurrently('message', INDEX)]
