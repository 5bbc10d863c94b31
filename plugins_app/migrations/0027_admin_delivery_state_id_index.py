# Built concurrently on PostgreSQL (ugent_common.migration_ops).

from django.db import migrations, models

from ugent_common.migration_ops import AddIndexConcurrently

# The admin's list of the deliveries in a state, newest first: each page load sorted every one in it.
INDEX = models.Index(fields=['state', 'id'], name='delivery_state_id')


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY runs outside a transaction

    dependencies = [
        ('plugins_app', '0026_admin_memory_fact_updated_index'),
    ]

    operations = [AddIndexConcurrently('outbounddelivery', INDEX)]
