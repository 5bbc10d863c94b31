from django.apps import AppConfig


class PluginsAppConfig(AppConfig):
    name = "plugins_app"
    default_auto_field = "django.db.models.BigAutoField"
