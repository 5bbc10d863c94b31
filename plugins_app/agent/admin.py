"""Admin for agent plugins: agent profiles."""
"""Agent profiles in the admin: pick an installed chat engine and give it its config."""
from django import forms
from django.contrib import admin

from plugins_app.agent.models import AgentProfile


def installed_chat_engines() -> list[tuple[str, str]]:
    from plugins_app.agent.engines.registry import chat_engines
    try:
        found = chat_engines()
    except Exception:  # a broken third-party plugin must not break the admin page
        found = {}
    return [(name, f"{name} ({cls.__module__}.{cls.__name__})") for name, cls in sorted(found.items())]


class AgentProfileForm(forms.ModelForm):
    class Meta:
        model = AgentProfile
        fields = "__all__"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        choices = installed_chat_engines()
        current = self.instance.provider if self.instance and self.instance.pk else None
        if current and current not in dict(choices):
            choices.append((current, f"{current} (not installed)"))
        self.fields["provider"] = forms.ChoiceField(choices=choices, label="Chat engine",
                                                    help_text="Installed opm.agents.chat engines.")


@admin.register(AgentProfile)
class AgentProfileAdmin(admin.ModelAdmin):
    form = AgentProfileForm
    list_display = ("name", "provider", "instance", "allowed", "is_default", "updated_at")
    list_filter = ("provider", "allowed", "is_default")
    search_fields = ("name", "provider", "instance")
    readonly_fields = ("created_at", "updated_at")
    change_list_template = "admin/plugins_app/agentprofile/change_list.html"

    def changelist_view(self, request, extra_context=None):
        extra_context = dict(extra_context or {}, installed_engines=installed_chat_engines())
        return super().changelist_view(request, extra_context=extra_context)


# --- channel plugins ---------------------------------------------------------------------------
