from django.db import migrations, models
from django.db.models import Count, OuterRef, Subquery
from django.db.models.functions import Coalesce


def count_hidden(apps, schema_editor):
    """What compaction hid before the count was kept: one UPDATE over the conversations that have any."""
    Conversation, Message = apps.get_model('channels_app', 'Conversation'), apps.get_model('channels_app', 'Message')
    hidden = (Message.objects.filter(conversation=OuterRef('pk'), hidden=True).order_by()
              .values('conversation').annotate(n=Count('pk')).values('n'))
    Conversation.objects.filter(pk__in=Message.objects.filter(hidden=True).values('conversation')).update(
        hidden_messages=Coalesce(Subquery(hidden), 0))


class Migration(migrations.Migration):

    dependencies = [
        ('channels_app', '0017_steering_key_index'),
    ]

    operations = [
        migrations.AddField(
            model_name='conversation',
            name='hidden_messages',
            field=models.PositiveIntegerField(default=0, editable=False, help_text='How many of its messages compaction has hidden, kept by compaction: the session tail\'s hidden_count.'),
        ),
        migrations.RunPython(count_hidden, migrations.RunPython.noop),
    ]
