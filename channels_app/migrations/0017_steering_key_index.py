# Built concurrently on PostgreSQL (ugent_common.migration_ops).

from django.db import migrations, models

from ugent_common.migration_ops import AddIndexConcurrently

# A keyed steering's resend was looked for through the conversation's turns, every turn the conversation ever
# ran; by its key it is one or two rows.
INDEX = models.Index(fields=['client_message_id'], name='steering_key')


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY runs outside a transaction

    dependencies = [
        ('channels_app', '0016_turn_spoken_conv_index'),
    ]

    operations = [AddIndexConcurrently('steering', INDEX)]
