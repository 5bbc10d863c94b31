"""Rules in the admin: the file's set read-only with its load status, admin-owned rules
editable (validated by the engine as they are saved), and a "Test a message" page."""
from __future__ import annotations

import json

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.template.response import TemplateResponse
from django.urls import path

from rules_app import engine, services
from rules_app.models import Rule, RuleSet, RuleSource, WorkspaceTrust


class RuleInline(admin.TabularInline):
    model = Rule
    fields = ("position", "name", "priority", "decision", "params_text", "condition_text", "dropped_reason")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True
    ordering = ("position", "id")

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    @admin.display(description="condition")
    def condition_text(self, rule):
        return json.dumps(rule.condition, ensure_ascii=False)

    @admin.display(description="params")
    def params_text(self, rule):
        return json.dumps(rule.params, ensure_ascii=False) if rule.params else ""


@admin.register(RuleSet)
class RuleSetAdmin(admin.ModelAdmin):
    list_display = ("name", "source", "status", "rule_count", "path", "loaded_at", "error_short")
    list_filter = ("source", "status")
    search_fields = ("name", "path")
    inlines = [RuleInline]
    change_list_template = "admin/rules_app/ruleset/change_list.html"
    FILE_FIELDS = ("name", "source", "path", "status", "on_error", "rule_count", "dropped_text", "last_error",
                   "warnings_text", "loaded_at", "updated_at")

    def get_fields(self, request, obj=None):
        if obj is not None and obj.read_only:
            return self.FILE_FIELDS
        if obj is None:
            return ("name",)
        return ("name", "source", "rule_count", "dropped_text", "version", "loaded_at", "updated_at")

    def get_readonly_fields(self, request, obj=None):
        if obj is not None and obj.read_only:
            return self.FILE_FIELDS
        if obj is None:
            return ()
        return ("source", "rule_count", "dropped_text", "version", "loaded_at", "updated_at")

    def has_change_permission(self, request, obj=None):
        if obj is not None and obj.read_only:
            return False  # the file's set is shown, never edited: edit the file
        return super().has_change_permission(request, obj)

    def has_delete_permission(self, request, obj=None):
        if obj is not None and obj.read_only:
            return False
        return super().has_delete_permission(request, obj)

    def save_model(self, request, obj, form, change):
        # only an admin set's name can be edited here; the file's set is written by the loader
        if not change:
            obj.source = RuleSource.ADMIN
        super().save_model(request, obj, form, change)

    @admin.display(description="last error")
    def error_short(self, obj):
        return (obj.last_error[:80] + "…") if len(obj.last_error) > 80 else obj.last_error

    @admin.display(description="dropped rules")
    def dropped_text(self, obj):
        return "\n".join(f"rule dropped (rule={d['rule']}, reason={d['reason']})" for d in obj.dropped) or "-"

    @admin.display(description="warnings")
    def warnings_text(self, obj):
        return "\n".join(obj.warnings) or "-"

    # -- Test a message ---------------------------------------------------------------------

    def get_urls(self):
        return [path("test-message/", self.admin_site.admin_view(self.test_message_view),
                     name="rules_app_ruleset_test_message"), *super().get_urls()]

    def test_message_view(self, request):
        from rules_app.runtime import runtime
        if not self.has_view_permission(request):
            raise PermissionDenied
        form = TestMessageForm(request.POST or None)
        explanation = None
        if request.method == "POST" and form.is_valid():
            d = form.cleaned_data
            msg = engine.MessageFacts(text=d["text"], channel=d["channel"] or None, source_type=d["source_type"] or None,
                                 user_id=d["user_id"] or None, conversation_id=d["conversation_id"] or None,
                                 input_mode=d["input_mode"] or None)
            explanation = runtime.ruleset().explain(msg)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "title": "Test a message",
            "form": form,
            "explanation": explanation,
            "result": _result(explanation) if explanation else None,
            "rules_in_force": len(runtime.ruleset()),
        }
        return TemplateResponse(request, "admin/rules_app/ruleset/test_message.html", context)


def _result(explanation: engine.Explanation) -> dict:
    match = explanation.match
    rules = [{"name": t.rule.name, "priority": t.rule.priority, "matched": t.matched, "reached": t.reached,
              "decision": engine.describe_decision(t.rule.decision), "trace": "\n".join(t.condition.lines())}
             for t in explanation.rules]
    if match.refused:
        headline = f"Refused: {engine.CLOSED_ANSWER}"
    elif match.rule is None:
        headline = "No rule matched: the agent answers."
    else:
        headline = f'Rule "{match.rule.name}" decides: {engine.describe_decision(match.decision)}'
    return {"headline": headline, "decided_by": match.rule.name if match.rule else None,
            "answer": match.answer, "rules": rules, "error": explanation.error,
            "dry_run": (engine.DRY_RUN_MATCHED.format(name=match.rule.name) if match.rule
                        else engine.DRY_RUN_NO_MATCH.format(text=explanation.message.text))}


class TestMessageForm(forms.Form):
    text = forms.CharField(widget=forms.Textarea(attrs={"rows": 3, "cols": 80}), strip=False)
    channel = forms.CharField(required=False, initial="web", help_text="web, slack, discord, line, …")
    source_type = forms.CharField(required=False, initial="user", help_text="user, group, room, unknown")
    user_id = forms.CharField(required=False)
    conversation_id = forms.CharField(required=False)
    input_mode = forms.ChoiceField(required=False, choices=[("", "(typed: none)"), ("voice", "voice"),
                                                            ("live", "live")])


class RuleForm(forms.ModelForm):
    class Meta:
        model = Rule
        fields = ("ruleset", "name", "priority", "condition", "decision", "params", "position")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "ruleset" in self.fields:
            self.fields["ruleset"].queryset = RuleSet.objects.filter(source=RuleSource.ADMIN)


@admin.register(Rule)
class RuleAdmin(admin.ModelAdmin):
    form = RuleForm
    list_display = ("name", "ruleset", "priority", "decision", "position", "dropped_reason")
    list_filter = ("ruleset__source", "decision", "ruleset")
    list_select_related = ("ruleset",)
    search_fields = ("name",)
    readonly_fields = ("created_at", "updated_at")

    def _file_rule(self, obj) -> bool:
        return obj is not None and obj.ruleset.source == RuleSource.FILE

    def has_change_permission(self, request, obj=None):
        if self._file_rule(obj):
            return False
        return super().has_change_permission(request, obj)

    def has_delete_permission(self, request, obj=None):
        if self._file_rule(obj):
            return False
        return super().has_delete_permission(request, obj)

    def get_changeform_initial_data(self, request):
        initial = super().get_changeform_initial_data(request)
        if "ruleset" not in initial:
            admin_set = RuleSet.objects.filter(source=RuleSource.ADMIN).order_by("id").first()
            if admin_set is not None:
                initial["ruleset"] = admin_set.pk
        initial.setdefault("condition", {"always": True})
        initial.setdefault("params", {})
        return initial

    def save_model(self, request, obj, form, change):
        try:
            services.rule_save(rule=obj)
        except ValidationError as exc:  # form.full_clean already ran the same checks; a race is the rest
            messages.error(request, "; ".join(exc.messages))

    def delete_model(self, request, obj):
        services.rule_delete(rule=obj)

    def delete_queryset(self, request, queryset):
        for rule in queryset.select_related("ruleset"):
            if rule.ruleset.source == RuleSource.ADMIN:
                services.rule_delete(rule=rule)


@admin.register(WorkspaceTrust)
class WorkspaceTrustAdmin(admin.ModelAdmin):
    list_display = ("path", "trusted_flag", "approved_by", "created_at", "revoked_at")
    readonly_fields = ("path", "approved_by", "created_at", "updated_at", "revoked_at")
    search_fields = ("path",)
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False  # approved with `python manage.py firewall workspace approve`

    @admin.display(boolean=True, description="trusted")
    def trusted_flag(self, obj):
        return obj.trusted

    @admin.action(description="Revoke trust")
    def revoke(self, request, queryset):
        count = sum(services.workspace_trust_revoke(path=t.path) for t in queryset)
        self.message_user(request, f"Revoked trust in {count} workspace(s).")

