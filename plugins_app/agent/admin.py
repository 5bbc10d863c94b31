"""Admin for agent plugins: agent profiles."""
"""Agent profiles in the admin: pick an installed chat engine and give it its config."""
from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404, redirect
from django.urls import path
from django.views.decorators.http import require_POST

from plugins_app.agent.models import AgentProfile


def installed_chat_engines() -> list[tuple[str, str]]:
    from plugins_app.agent.engines.registry import chat_engines
    try:
        found = chat_engines()
    except Exception:  # a broken third-party plugin must not break the admin page
        found = {}
    return [(name, f"{name} ({cls.__module__}.{cls.__name__})") for name, cls in sorted(found.items())]


class AgentProfileForm(forms.ModelForm):
    """Secrets in the config are never rendered back: the config shows the rest, and each stored secret
    is a "replace" field that is always empty (leave it empty to keep the stored value)."""

    replace_secret = forms.ChoiceField(required=False, label="Replace a stored secret", choices=[],
                                       help_text="Stored secrets are encrypted and never shown.")
    replace_secret_value = forms.CharField(required=False, label="New value", strip=False,
                                           widget=forms.PasswordInput(render_value=False),
                                           help_text="Replaces the secret chosen above; empty keeps it.")

    class Meta:
        model = AgentProfile
        fields = "__all__"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from ugent_common.secrets import secrets_hidden
        stored = self.instance.config if self.instance and self.instance.pk else {}
        shown, self.secret_paths = secrets_hidden(stored or {})
        self.initial["config"] = shown
        self.fields["replace_secret"].choices = [("", "(none)")] + [(p, p) for p in self.secret_paths]
        choices = installed_chat_engines()
        current = self.instance.provider if self.instance and self.instance.pk else None
        if current and current not in dict(choices):
            choices.append((current, f"{current} (not installed)"))
        self.fields["provider"] = forms.ChoiceField(choices=choices, label="Chat engine",
                                                    help_text="Installed opm.agents.chat engines.")

    def clean_config(self):
        """The typed config, with the stored secrets it does not show kept unless replaced."""
        config = self.cleaned_data.get("config") or {}
        if not isinstance(config, dict):
            raise forms.ValidationError("The config must be a JSON object.")
        stored = self.instance.config if self.instance and self.instance.pk else {}
        merged = dict(config)
        for path in getattr(self, "secret_paths", []):
            replacement = (self.data.get(self.add_prefix("replace_secret_value")) or ""
                           if self.data.get(self.add_prefix("replace_secret")) == path else "")
            node_in, node_out, keys = stored, merged, path.split("/")
            for key in keys[:-1]:
                node_in = node_in.get(key, {}) if isinstance(node_in, dict) else {}
                node_out = node_out.setdefault(key, {}) if isinstance(node_out, dict) else {}
            if not isinstance(node_out, dict) or keys[-1] in node_out:
                continue  # typed anew in the config itself
            node_out[keys[-1]] = replacement if replacement else node_in.get(keys[-1])
        return merged


@admin.register(AgentProfile)
class AgentProfileAdmin(admin.ModelAdmin):
    form = AgentProfileForm
    list_display = ("name", "provider", "instance", "allowed", "is_default", "updated_at")
    list_filter = ("provider", "allowed", "is_default")
    search_fields = ("name", "provider", "instance")
    readonly_fields = ("created_at", "updated_at")
    change_list_template = "admin/plugins_app/agentprofile/change_list.html"
    change_form_template = "admin/plugins_app/agentprofile/change_form.html"

    def get_urls(self):
        test = self.admin_site.admin_view(require_POST(self.test_connection_view))
        return [path("<int:pk>/test-connection/", test, name="plugins_app_agentprofile_test_connection"),
                *super().get_urls()]

    def test_connection_view(self, request, pk):
        """The change page's "test connection" button: one tiny call to the engine, the result as a message."""
        profile = get_object_or_404(AgentProfile, pk=pk)
        if not self.has_change_permission(request, profile):
            raise PermissionDenied
        from plugins_app.agent.services import profile_connection_test
        result = profile_connection_test(profile=profile)
        self.message_user(request, ("Connection works: " if result.ok else "Connection failed: ") + result.message,
                          messages.SUCCESS if result.ok else messages.ERROR)
        return redirect("admin:plugins_app_agentprofile_change", pk)

    def changelist_view(self, request, extra_context=None):
        extra_context = dict(extra_context or {}, installed_engines=installed_chat_engines())
        return super().changelist_view(request, extra_context=extra_context)


# --- channel plugins ---------------------------------------------------------------------------
