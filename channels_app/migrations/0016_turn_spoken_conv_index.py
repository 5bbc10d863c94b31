# Built concurrently on PostgreSQL (ugent_common.migration_ops).

from django.db import migrations, models

from ugent_common.migration_ops import AddIndexConcurrently

# "Did this conversation ever have a spoken turn?" (memory under [voice] memory_write = false, at each turn's
# end) was read through the conversation's own index: every turn the conversation ever ran. Only spoken turns
# are in this one.
INDEX = models.Index(condition=models.Q(('input_mode__in', ('voice', 'live'))), fields=['conversation'],
                     name='turn_spoken_conv')


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY runs outside a transaction

    dependencies = [
        ('channels_app', '0015_receipt_conv_id_index'),
    ]

    operations = [AddIndexConcurrently('turn', INDEX)]
