# Built concurrently on PostgreSQL (ugent_common.migration_ops).

from django.db import migrations, models

from ugent_common.migration_ops import AddIndexConcurrently

# A conversation's snapshot (at each stream's subscribe and gap) reads its newest receipts: PostgreSQL walked
# every receipt's id backwards, SQLite sorted all of the conversation's.
INDEX = models.Index(fields=['conversation', 'id'], name='receipt_conv_id')


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY runs outside a transaction

    dependencies = [
        ('channels_app', '0014_turn_live_conv_index'),
    ]

    operations = [AddIndexConcurrently('receipt', INDEX)]
