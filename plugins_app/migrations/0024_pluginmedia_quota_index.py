# The quota check of media.put (services.media_store) sums a plugin's unexpired sizes from this index alone.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('plugins_app', '0023_memory_search_function'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='pluginmedia',
            index=models.Index(fields=['plugin', 'expires_at', 'size'], name='pluginmedia_quota'),
        ),
    ]
