from django.apps import AppConfig


class ChannelsAppConfig(AppConfig):
    name = "channels_app"
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "Conversations and turns"
