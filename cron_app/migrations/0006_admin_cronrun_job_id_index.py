# Built concurrently on PostgreSQL (ugent_common.migration_ops).

from django.db import migrations, models

from ugent_common.migration_ops import AddIndexConcurrently

# The admin's list of one job's runs, newest first: each page load sorted every run the job ever had.
INDEX = models.Index(fields=['job_name', 'id'], name='cronrun_job_id')


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY runs outside a transaction

    dependencies = [
        ('cron_app', '0005_cron_file_digest'),
    ]

    operations = [AddIndexConcurrently('cronrun', INDEX)]
