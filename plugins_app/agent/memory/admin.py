"""Memory in the admin: every user's facts (searchable, editable, pin/forget actions) and the settings row."""
from django.contrib import admin, messages

from plugins_app.agent.memory import services
from plugins_app.agent.memory.conf import ADMIN_FIELDS
from plugins_app.agent.memory.extract import normalize
from plugins_app.agent.memory.models import MemoryFact, MemorySettings
from ugent_common.admin import BoundedListAdmin


@admin.register(MemoryFact)
class MemoryFactAdmin(BoundedListAdmin):
    # newest change first (the model's order), through memory_fact_updated_idx
    list_display = ("short_text", "actor_key", "tier", "pinned", "source", "source_ref", "seen_count", "updated_at")
    list_filter = ("tier", "pinned", "source", ("updated_at", admin.DateFieldListFilter))
    sortable_by = ("updated_at",)
    search_fields = ("actor_key", "text")
    readonly_fields = ("id", "normalized", "seen_count", "seen_in", "last_seen_at", "created_at", "updated_at")
    fields = ("id", "actor_key", "text", "normalized", "tier", "pinned", "source", "source_ref", "expires_at",
              "seen_count", "seen_in", "last_seen_at", "created_at", "updated_at")
    SEEN_IN_SHOWN = 20
    actions = ("pin", "unpin")

    @admin.display(description="text", ordering="text")
    def short_text(self, obj):
        return obj.text if len(obj.text) <= 80 else obj.text[:77] + "…"

    @admin.display(description="seen in")
    def seen_in(self, obj):
        """The turns whose messages stated the fact, newest first (each counted once in seen_count)."""
        if obj.pk is None:
            return "-"
        refs = list(obj.sightings.order_by("-id").values_list("ref", flat=True)[:self.SEEN_IN_SHOWN + 1])
        if not refs:
            return "-"
        more = " …" if len(refs) > self.SEEN_IN_SHOWN else ""
        return ", ".join(refs[:self.SEEN_IN_SHOWN]) + more

    def save_model(self, request, obj, form, change):
        # the duplicate key follows the text; the index follows by trigger (or is re-embedded)
        obj.normalized = normalize(obj.text)
        super().save_model(request, obj, form, change)
        services.fact_edited(fact=obj, changed=list(form.changed_data) if change else ["text", "actor_key"])

    def delete_model(self, request, obj):
        services.facts_delete(fact_ids=[obj.pk])

    def delete_queryset(self, request, queryset):
        services.facts_delete(fact_ids=list(queryset.values_list("id", flat=True)))

    @admin.action(description="Pin the selected facts (always recalled)")
    def pin(self, request, queryset):
        done = sum(services.fact_pin(actor_key=f.actor_key, fact_id=f.pk) for f in queryset)
        self.message_user(request, f"Pinned {done} fact(s).", messages.SUCCESS)

    @admin.action(description="Unpin the selected facts")
    def unpin(self, request, queryset):
        done = sum(services.fact_pin(actor_key=f.actor_key, fact_id=f.pk, pinned=False) for f in queryset)
        self.message_user(request, f"Unpinned {done} fact(s).", messages.SUCCESS)


@admin.register(MemorySettings)
class MemorySettingsAdmin(admin.ModelAdmin):
    list_display = ("__str__", *ADMIN_FIELDS, "updated_at")
    readonly_fields = ("in_force",)
    fields = (*ADMIN_FIELDS, "in_force")

    @admin.display(description="in force now")
    def in_force(self, obj):
        from plugins_app.agent.memory.conf import memory_conf
        c = memory_conf()
        return (f"backend={c.backend}, recall_cadence={c.recall_cadence}, max_hits={c.max_hits}, "
                f"max_injected_tokens_est={c.max_injected_tokens_est}, extractor={c.extractor}")

    def has_add_permission(self, request):
        return not MemorySettings.objects.exists()

    def save_model(self, request, obj, form, change):
        services.memory_settings_save(row=obj)
