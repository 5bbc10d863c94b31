"""The operator's view of the hub: callers and keys, actors, conversations, turns, receipts, events."""
from django import forms
from django.contrib import admin, messages

from channels_app.models import (ApiKey, Actor, Caller, CallerDefaults, Conversation, Event, Issuer, Message,
                                 Receipt, Steering, Turn)
from ugent_common import config


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    extra = 0
    fields = ("label", "prefix", "key_hash", "active", "last_used_at", "created_at")
    readonly_fields = ("prefix", "key_hash", "last_used_at", "created_at")
    can_delete = True

    def has_add_permission(self, request, obj=None):
        return False  # keys are issued with the "Issue a new key" action, which shows the key once


@admin.register(Caller)
class CallerAdmin(admin.ModelAdmin):
    list_display = ("name", "role", "issuers", "key_env", "default_model", "from_config", "created_at")
    list_filter = ("role", "from_config")
    search_fields = ("name",)
    inlines = [ApiKeyInline]
    actions = ["issue_key"]

    @admin.display(description="key read from")
    def key_env(self, obj):
        """The environment variable (or vault entry) a configured caller's key comes from; never the key."""
        return config.key_env_of(obj.name) or "—"

    @admin.action(description="Issue a new key (shown once)")
    def issue_key(self, request, queryset):
        for caller in queryset:
            raw = ApiKey.generate()
            key = ApiKey(caller=caller, label="issued in the admin")
            key.set_key(raw)
            key.save()
            self.message_user(request, f"New key for {caller.name} (copy it now, it is not shown again): {raw}",
                              messages.WARNING)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("__str__", "caller", "label", "active", "last_used_at", "created_at")
    list_filter = ("active", "caller__role")
    list_select_related = ("caller",)
    search_fields = ("caller__name", "label", "prefix")
    readonly_fields = ("prefix", "key_hash", "last_used_at")
    fields = ("caller", "label", "active", "prefix", "key_hash", "last_used_at")

    def has_add_permission(self, request):
        return False


@admin.register(Actor)
class ActorAdmin(admin.ModelAdmin):
    list_display = ("key", "channel", "caller", "federation_issuer", "model_choice", "created_at")
    list_filter = ("channel", "caller")
    list_select_related = ("caller",)
    search_fields = ("key", "user_id", "display_name", "federation_subject")


class MessageInline(admin.TabularInline):
    model = Message
    extra = 0
    fields = ("role", "content", "actor", "hidden", "created_at")
    readonly_fields = ("role", "content", "actor", "created_at")


@admin.register(Conversation)
class ConversationAdmin(admin.ModelAdmin):
    list_display = ("external_id", "channel", "client_id", "owner", "caller", "model_choice", "created_at")
    list_filter = ("channel", "caller")
    list_select_related = ("owner", "caller")
    search_fields = ("external_id", "client_id", "owner__key")
    readonly_fields = ("created_at", "updated_at")
    inlines = [MessageInline]


@admin.register(Turn)
class TurnAdmin(admin.ModelAdmin):
    list_display = ("turn_id", "state", "model", "conversation", "actor", "input_mode", "created_at", "finished_at")
    list_filter = ("state", "model", "input_mode", "disable_memory_write")
    list_select_related = ("conversation", "actor")
    search_fields = ("turn_id", "conversation__external_id", "actor__key")
    readonly_fields = ("turn_id", "receipt", "created_at", "started_at", "finished_at")
    raw_id_fields = ("conversation", "actor", "profile")


@admin.register(Receipt)
class ReceiptAdmin(admin.ModelAdmin):
    list_display = ("client_message_id", "state", "conversation", "actor", "created_at", "finished_at")
    list_filter = ("state",)
    list_select_related = ("conversation", "actor")
    search_fields = ("client_message_id", "conversation__external_id", "actor__key", "answer")
    readonly_fields = ("content_hash", "created_at", "started_at", "finished_at")
    raw_id_fields = ("conversation", "actor")


@admin.register(Message)
class MessageAdmin(admin.ModelAdmin):
    list_display = ("id", "conversation", "role", "short", "hidden", "created_at")
    list_filter = ("role", "hidden")
    list_select_related = ("conversation",)
    search_fields = ("content", "conversation__external_id")
    raw_id_fields = ("conversation", "actor", "turn")

    @admin.display(description="content")
    def short(self, obj):
        return obj.content[:80]


@admin.register(Event)
class EventAdmin(admin.ModelAdmin):
    list_display = ("id", "type", "conversation", "turn", "created_at")
    list_filter = ("type",)
    list_select_related = ("conversation", "turn")
    search_fields = ("type", "conversation__external_id", "turn__turn_id")
    readonly_fields = ("conversation", "turn", "type", "audience", "data", "created_at")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(Steering)
class SteeringAdmin(admin.ModelAdmin):
    list_display = ("id", "turn", "state", "created_at")
    list_filter = ("state",)
    list_select_related = ("turn",)
    search_fields = ("turn__turn_id",)
    raw_id_fields = ("turn",)


class IssuerForm(forms.ModelForm):
    """The same rules as [[web.auth.issuers]] in ugent.toml (ugent_common.config)."""

    class Meta:
        model = Issuer
        fields = ("issuer", "jwks_url", "audience", "actor_prefix", "algorithms", "leeway_secs")

    def _checked(self, name, check):
        try:
            return check(self.cleaned_data[name])
        except ValueError as exc:
            raise forms.ValidationError(str(exc))

    def clean_actor_prefix(self):
        prefix = self._checked("actor_prefix", config.actor_prefix_check)
        for other in Issuer.objects.exclude(pk=self.instance.pk).values_list("actor_prefix", flat=True):
            if other.startswith(prefix) or prefix.startswith(other):
                raise forms.ValidationError(f"{prefix!r} and another issuer's {other!r} could collide.")
        return prefix

    def clean_algorithms(self):
        algs = self.cleaned_data["algorithms"] or list(config.DEFAULT_ALGORITHMS)
        if not isinstance(algs, list) or not all(isinstance(a, str) for a in algs):
            raise forms.ValidationError("a list of algorithm names, such as [\"RS256\", \"ES256\"]")
        try:
            return config.algorithms_check(algs)
        except ValueError as exc:
            raise forms.ValidationError(str(exc))

    def clean_leeway_secs(self):
        value = self.cleaned_data["leeway_secs"]
        if value > config.MAX_LEEWAY_SECS:
            raise forms.ValidationError(f"at most {config.MAX_LEEWAY_SECS} seconds")
        return value


@admin.register(Issuer)
class IssuerAdmin(admin.ModelAdmin):
    form = IssuerForm
    list_display = ("issuer", "actor_prefix", "audience", "jwks_url", "algorithms", "leeway_secs", "from_config")
    list_filter = ("from_config",)
    search_fields = ("issuer", "actor_prefix", "audience")
    readonly_fields = ("from_config", "created_at", "updated_at")
    actions = ["forget_jwks"]

    @admin.action(description="Fetch these issuers' JWKS again on their next token")
    def forget_jwks(self, request, queryset):
        from channels_app.federation import jwks_forget
        n = jwks_forget(urls=[i.jwks_url for i in queryset])
        self.message_user(request, f"{n} cached JWKS forgotten; the next token of each fetches it again.")


@admin.register(CallerDefaults)
class CallerDefaultsAdmin(admin.ModelAdmin):
    list_display = ("issuer", "model", "disable_memory_recall", "disable_memory_write", "disable_code_context",
                    "from_config")
    list_filter = ("from_config", "disable_memory_recall", "disable_memory_write", "disable_code_context")
    search_fields = ("issuer", "model")
    readonly_fields = ("from_config", "created_at", "updated_at")
