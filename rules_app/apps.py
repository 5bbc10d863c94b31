from django.apps import AppConfig


class RulesAppConfig(AppConfig):
    name = "rules_app"
    default_auto_field = "django.db.models.BigAutoField"
