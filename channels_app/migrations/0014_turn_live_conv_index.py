# Built concurrently on PostgreSQL (ugent_common.migration_ops).

from django.db import migrations, models

from ugent_common.migration_ops import AddIndexConcurrently

# A conversation's live turn (a stop or a steer by conversation, the conversation repair) was read through
# the conversation's own index on SQLite: every turn it ever ran, when none was live. Only live turns are in
# this one.
INDEX = models.Index(condition=models.Q(('state__in', ('accepted', 'running'))), fields=['conversation', 'id'],
                     name='turn_live_conv')


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY runs outside a transaction

    dependencies = [
        ('channels_app', '0013_message_conv_visible_index'),
    ]

    operations = [AddIndexConcurrently('turn', INDEX)]
