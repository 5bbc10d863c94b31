from django.apps import AppConfig


class CronAppConfig(AppConfig):
    name = "cron_app"
    default_auto_field = "django.db.models.BigAutoField"
