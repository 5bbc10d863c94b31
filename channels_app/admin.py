"""The operator's view of the hub: callers and keys, actors, conversations, turns, receipts, events."""
from django.contrib import admin, messages
from django.db.models import Count, Sum

from channels_app.models import (ApiKey, Actor, Caller, Conversation, Event, Message, Receipt, Steering, Turn)


class UsageSums:
    """Tokens used by the turns of the row (a caller's, or one admin-issued key's), summed in the list's query."""

    usage_path = "turns"

    def get_queryset(self, request):
        p = self.usage_path
        return super().get_queryset(request).annotate(
            usage_turns=Count(p, distinct=True), usage_prompt=Sum(f"{p}__prompt_tokens"),
            usage_completion=Sum(f"{p}__completion_tokens"), usage_total=Sum(f"{p}__total_tokens"))

    @admin.display(description="turns", ordering="usage_turns")
    def turns_count(self, obj):
        return obj.usage_turns

    @admin.display(description="prompt tokens", ordering="usage_prompt")
    def prompt_tokens(self, obj):
        return obj.usage_prompt or 0

    @admin.display(description="completion tokens", ordering="usage_completion")
    def completion_tokens(self, obj):
        return obj.usage_completion or 0

    @admin.display(description="total tokens", ordering="usage_total")
    def total_tokens(self, obj):
        return obj.usage_total or 0


USAGE_COLUMNS = ("turns_count", "prompt_tokens", "completion_tokens", "total_tokens")


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    extra = 0
    fields = ("label", "prefix", "key_hash", "active", "last_used_at", "created_at")
    readonly_fields = ("prefix", "key_hash", "last_used_at", "created_at")
    can_delete = True

    def has_add_permission(self, request, obj=None):
        return False  # keys are issued with the "Issue a new key" action, which shows the key once


@admin.register(Caller)
class CallerAdmin(UsageSums, admin.ModelAdmin):
    # usage: every turn the caller's keys asked for, configured keys included
    list_display = ("name", "role", "default_model", "from_config", *USAGE_COLUMNS, "created_at")
    list_filter = ("role", "from_config")
    search_fields = ("name",)
    inlines = [ApiKeyInline]
    actions = ["issue_key"]

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
class ApiKeyAdmin(UsageSums, admin.ModelAdmin):
    list_display = ("__str__", "caller", "label", "active", "last_used_at", *USAGE_COLUMNS, "created_at")
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
    list_display = ("turn_id", "state", "model", "conversation", "actor", "input_mode", "total_tokens",
                    "usage_source", "created_at", "finished_at")
    list_filter = ("state", "model", "input_mode", "disable_memory_write")
    list_select_related = ("conversation", "actor")
    search_fields = ("turn_id", "conversation__external_id", "actor__key")
    readonly_fields = ("turn_id", "receipt", "created_at", "started_at", "finished_at", "caller", "api_key",
                       "prompt_tokens", "completion_tokens", "total_tokens", "usage_source", "ttft_ms")
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
