# Built concurrently on PostgreSQL (ugent_common.migration_ops).

from django.db import migrations, models

from ugent_common.migration_ops import AddIndexConcurrently

# The admin's list of memory facts, newest change first: without it each page load sorted every fact.
INDEX = models.Index(fields=['updated_at', 'id'], name='memory_fact_updated_idx')


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY runs outside a transaction

    dependencies = [
        ('plugins_app', '0025_plugin_memory_max_mb'),
    ]

    operations = [AddIndexConcurrently('memoryfact', INDEX)]
