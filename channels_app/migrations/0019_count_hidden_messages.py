from django.db import migrations
from django.db.models import Count, OuterRef, Subquery
from django.db.models.functions import Coalesce

BATCH = 500


def count_hidden(apps, schema_editor):
    """What compaction hid before the count was kept, a batch of conversations at a time, each batch its own
    transaction (the migration is not atomic): no lock is held on every conversation while the messages are
    counted. Each count is set, not added: run again, it gives the same. Compactions by processes of the old
    version after this has run are not counted: migrate, then restart them (docs/deploy.md)."""
    Conversation, Message = apps.get_model('channels_app', 'Conversation'), apps.get_model('channels_app', 'Message')
    hidden = (Message.objects.filter(conversation=OuterRef('pk'), hidden=True).order_by()
              .values('conversation').annotate(n=Count('pk')).values('n'))
    after = 0
    while True:
        ids = list(Conversation.objects.filter(pk__gt=after).order_by('pk').values_list('pk', flat=True)[:BATCH])
        if not ids:
            return
        Conversation.objects.filter(pk__in=ids).update(hidden_messages=Coalesce(Subquery(hidden), 0))
        after = ids[-1]


class Migration(migrations.Migration):

    atomic = False  # a transaction a batch

    dependencies = [
        ('channels_app', '0018_conversation_hidden_messages'),
    ]

    operations = [
        migrations.RunPython(count_hidden, migrations.RunPython.noop),
    ]
