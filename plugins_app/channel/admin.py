"""Admin for channel plugins: registrations, secrets, outbound deliveries."""
from django import forms
from django.contrib import admin, messages

from plugins_app.channel import selectors as plugin_selectors  # noqa: E402
from plugins_app.channel import services as plugin_services  # noqa: E402
from plugins_app.channel.models import DeliveryState, OutboundDelivery, Plugin, PluginSecret  # noqa: E402
from ugent_common.admin import BoundedListAdmin


class PluginSecretForm(forms.ModelForm):
    """A secret is written here and never read back: the value field always renders empty."""

    value = forms.CharField(widget=forms.PasswordInput(render_value=False), required=False,
                            help_text="Type a new value to set or replace it; the stored one is never shown.")

    class Meta:
        model = PluginSecret
        fields = ("name",)

    def clean(self):
        data = super().clean()
        if not self.instance.pk and not data.get("value"):
            self.add_error("value", "A new secret needs a value.")
        return data

    def save(self, commit=True):
        obj = super().save(commit=False)
        value = self.cleaned_data.get("value")
        if value:
            from plugins_app.channel.secrets import secret_encrypt
            obj.ciphertext = secret_encrypt(value)
        if commit:
            obj.save()
        return obj


class PluginSecretInline(admin.TabularInline):
    model = PluginSecret
    form = PluginSecretForm
    extra = 0
    fields = ("name", "value", "updated_at")
    readonly_fields = ("updated_at",)
    verbose_name = "secret (secret_env_refs)"


@admin.register(Plugin)
class PluginAdmin(admin.ModelAdmin):
    list_display = ("plugin_id", "kind", "enabled", "state", "state_reason", "disabled_reason",
                    "last_heartbeat", "restarts", "pid", "memory_cap")
    list_filter = ("enabled", "state", "kind")
    search_fields = ("plugin_id", "kind", "command")
    readonly_fields = ("state", "state_reason", "disabled_reason", "last_heartbeat", "restarts", "pid",
                       "created_at", "updated_at")
    inlines = [PluginSecretInline]
    actions = ["enable_again", "disable"]
    fieldsets = (
        (None, {"fields": ("plugin_id", "kind", "enabled", "command", "args", "env_refs", "secret_env_refs")}),
        ("Limits", {"fields": ("max_in_flight", "max_retries", "heartbeat_secs", "memory_max_mb")}),
        ("Routing", {"fields": ("workspace", "allowed_senders", "allow_remote_control")}),
        ("Supervision", {"fields": ("state", "state_reason", "disabled_reason", "last_heartbeat", "restarts", "pid",
                                    "created_at", "updated_at")}),
    )

    @admin.display(description="memory cap")
    def memory_cap(self, obj):
        """The cap its worker runs under: its own, or UGENT_PLUGIN_MEMORY_MAX_MB's."""
        mb = plugin_selectors.plugin_memory_max_mb(obj.memory_max_mb)
        shown = f"{mb} MiB" if mb else "none"
        return shown if obj.memory_max_mb is not None else f"{shown} (default)"

    def save_related(self, request, form, formsets, change):
        super().save_related(request, form, formsets, change)
        plugin = form.instance  # a secret set in the inline is one of the plugin's secret_env_refs
        names = list(plugin.secret_env_refs or [])
        for name in plugin.secrets.values_list("name", flat=True):
            if name not in names:
                names.append(name)
        if names != list(plugin.secret_env_refs or []):
            plugin.secret_env_refs = names
            plugin.save(update_fields=["secret_env_refs", "updated_at"])

    @admin.action(description="Enable again (clears the circuit breaker)", permissions=["change"])
    def enable_again(self, request, queryset):
        names = [p.plugin_id for p in queryset if plugin_services.plugin_enable(plugin=p)]
        self.message_user(request, f"Enabled {len(names)} plugin(s)" + (f" ({', '.join(names)})" if names else "")
                          + "; the supervisor starts them on its next step.")

    @admin.action(description="Disable", permissions=["change"])
    def disable(self, request, queryset):
        count = sum(plugin_services.plugin_disable(plugin=p) for p in queryset)
        self.message_user(request, f"Disabled {count} plugin(s); their workers stop.")


@admin.register(OutboundDelivery)
class OutboundDeliveryAdmin(BoundedListAdmin):
    list_display = ("delivery_id", "plugin", "state", "attempt", "last_error", "created", "delivered_at")
    list_filter = ("state", "plugin", ("created_at", admin.DateFieldListFilter))  # (plugins: a small table)
    sortable_by = ("delivery_id", "created")
    list_select_related = ("plugin",)
    search_fields = ("delivery_id", "channel_message_id", "plugin__plugin_id")
    readonly_fields = ("delivery_id", "plugin", "conversation", "turn", "text", "payload", "state", "attempt",
                       "not_before", "handed_out_at", "handed_out", "failures", "last_error",
                       "channel_message_id", "delivered_at", "created_at", "updated_at")
    exclude = ("claim",)
    actions = ["retry_dead_letters", "discard_dead_letters"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # a delivery is a record: a dead letter is requeued or discarded, never deleted

    @admin.action(description="Requeue the dead letters (send again)", permissions=["change"])
    def retry_dead_letters(self, request, queryset):
        count = sum(plugin_services.delivery_retry(delivery=d)
                    for d in queryset.filter(state=DeliveryState.DEAD_LETTER).select_related("plugin"))
        skipped = queryset.count() - count
        self.message_user(request, f"Queued {count} dead letter(s) again"
                          + (f"; {skipped} selected were not dead letters and were left alone" if skipped else "")
                          + ".", messages.SUCCESS if count else messages.WARNING)

    @admin.action(description="Discard the dead letters (never send them)", permissions=["change"])
    def discard_dead_letters(self, request, queryset):
        count = sum(plugin_services.delivery_discard(delivery=d)
                    for d in queryset.filter(state=DeliveryState.DEAD_LETTER))
        skipped = queryset.count() - count
        self.message_user(request, f"Discarded {count} dead letter(s)"
                          + (f"; {skipped} selected were not dead letters and were left alone" if skipped else "")
                          + ".", messages.SUCCESS if count else messages.WARNING)
