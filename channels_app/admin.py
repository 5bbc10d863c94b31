"""The operator's view of the hub: callers and keys, actors, conversations, turns, receipts, events.

Turns, receipts, messages and events are records: read-only here. What the operator does to them is an
action or a button that calls a service (stop a turn; revoke, rotate or issue a key)."""
from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.http import Http404, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from channels_app import events, files, services, streams, usage
from channels_app.models import (INPUT_MODES, LIVE_TURN_STATES, ApiKey, Actor, Caller, CallerDefaults, Conversation,
                                 Event, File, Issuer, Message, Receipt, Steering, Turn)
from ugent_common import config
from ugent_common.admin import BoundedListAdmin, RecordAdmin, values_filter

def admin_actor(request) -> str:
    """Who did it, as the turn's stop_requested_by and the messages say: the admin account's name."""
    return f"admin:{request.user.get_username()}"


def turn_stop_from_admin(request, turn: Turn) -> tuple[bool, str]:
    """The stop service behind POST /v1/ugent/stop, for an admin account: (stopped, what to tell them)."""
    by = admin_actor(request)
    if streams.turn_stop_request(turn_pk=turn.pk, by=by):
        return True, f"Asked turn {turn.turn_id} to stop (by {by}); it stops within one engine step."
    turn.refresh_from_db(fields=["state", "cancel_requested", "stop_requested_by"])
    if turn.state in LIVE_TURN_STATES:
        return False, f"Turn {turn.turn_id} is already stopping (asked by {turn.stop_requested_by})."
    return False, f"Turn {turn.turn_id} has ended ({turn.state}): there is nothing to stop."


class UsageChangeList(ChangeList):
    """A caller's or key's list, each row carrying what its turns used (`obj.usage`): the rollup's totals and
    the turns since its mark (channels_app.usage), read for the rows of the page shown."""

    def get_results(self, request):
        super().get_results(request)
        self.result_list = list(self.result_list)
        of = self.model_admin.usage_of
        by_caller, by_key = usage.usage_for(**{of: [obj.pk for obj in self.result_list]})
        found = by_caller if of == "caller_ids" else by_key
        for obj in self.result_list:
            obj.usage = found.get(obj.pk)


class UsageSums:
    """Tokens used by the turns of the row (a caller's, or one admin-issued key's): the usage rollup's totals
    and the turns since its mark, not a sum over every turn at each page load. Not sortable: a sort would
    need every row's figures."""

    usage_of = "caller_ids"

    def get_changelist(self, request, **kwargs):
        return UsageChangeList

    @staticmethod
    def _figure(obj, name: str) -> int:
        figures = getattr(obj, "usage", None)
        return figures[name] if figures else 0

    @admin.display(description="turns")
    def turns_count(self, obj):
        return self._figure(obj, "turns")

    @admin.display(description="prompt tokens")
    def prompt_tokens(self, obj):
        return self._figure(obj, "prompt_tokens")

    @admin.display(description="completion tokens")
    def completion_tokens(self, obj):
        return self._figure(obj, "completion_tokens")

    @admin.display(description="total tokens")
    def total_tokens(self, obj):
        return self._figure(obj, "total_tokens")


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
    list_display = ("name", "role", "issuers", "key_env", "default_model", "from_config", *USAGE_COLUMNS,
                    "created_at")
    list_filter = ("role", "from_config")
    search_fields = ("name",)
    inlines = [ApiKeyInline]
    actions = ["issue_key"]

    @admin.display(description="key read from")
    def key_env(self, obj):
        """The environment variable (or vault entry) a configured caller's key comes from; never the key."""
        return config.key_env_of(obj.name) or "—"

    @admin.action(description="Issue a new key (shown once)", permissions=["change"])
    def issue_key(self, request, queryset):
        for caller in queryset:
            _key, raw = services.api_key_issue(caller=caller)
            self.message_user(request, f"New key for {caller.name} (copy it now, it is not shown again): {raw}",
                              messages.WARNING)


@admin.register(ApiKey)
class ApiKeyAdmin(UsageSums, admin.ModelAdmin):
    usage_of = "key_ids"
    list_display = ("__str__", "caller", "label", "active", "last_used_at", *USAGE_COLUMNS, "created_at")
    list_filter = ("active", "caller__role")
    list_select_related = ("caller",)
    search_fields = ("caller__name", "label", "prefix")
    readonly_fields = ("caller", "active", "prefix", "key_hash", "last_used_at")
    fields = ("caller", "label", "active", "prefix", "key_hash", "last_used_at")
    actions = ["revoke", "rotate"]

    def has_add_permission(self, request):
        return False

    @admin.action(description="Revoke (the key stops working at once)", permissions=["change"])
    def revoke(self, request, queryset):
        revoked = [str(k) for k in queryset.select_related("caller") if services.api_key_revoke(key_pk=k.pk)]
        skipped = queryset.count() - len(revoked)
        self.message_user(request, f"Revoked {len(revoked)} key(s)" + (f": {', '.join(revoked)}" if revoked else "")
                          + (f"; {skipped} already revoked" if skipped else "") + ".",
                          messages.SUCCESS if revoked else messages.WARNING)

    @admin.action(description="Rotate (a new key shown once; the old one revoked)", permissions=["change"])
    def rotate(self, request, queryset):
        for key in queryset.select_related("caller"):
            rotated = services.api_key_rotate(key_pk=key.pk)
            if rotated is None:
                self.message_user(request, f"{key} is revoked: nothing to rotate.", messages.WARNING)
                continue
            new, raw = rotated
            self.message_user(request, f"Rotated {key}: {key.prefix}… is revoked. The new key for "
                              f"{new.caller.name} (copy it now, it is not shown again): {raw}", messages.WARNING)


def models_known() -> list[str]:
    """The models a turn may name: the agent profiles' (a turn's model is its profile's name)."""
    from plugins_app.agent.models import AgentProfile
    return list(AgentProfile.objects.values_list("name", flat=True))


@admin.register(Actor)
class ActorAdmin(BoundedListAdmin):
    list_display = ("key", "channel", "caller", "federation_issuer", "model_choice", "created")
    list_filter = (("channel", values_filter(("web",))), "caller")
    sortable_by = ("key", "created")
    list_select_related = ("caller",)
    search_fields = ("key", "user_id", "display_name", "federation_subject")


#: The newest messages a conversation's page shows; the rest are a link away (the message list, by conversation).
RECENT_MESSAGES = 50
#: What a message's text shows there, at most; its own page shows all of it.
MESSAGE_TEXT_SHOWN = 500


@admin.register(Conversation)
class ConversationAdmin(BoundedListAdmin):
    """A conversation's stored /model choice is the operator's to edit. Who and where it is (its channel, client
    id, id, owner and caller) are what access and idempotency hang on: changing its channel opened it to every
    sender, its owner handed over its history. Its working directory is changed through PUT
    /v1/ugent/directory, which keeps it inside the workspace. A conversation is created by its first message;
    one that holds records (turns, receipts, messages, events: never deleted here) cannot be deleted either."""

    list_display = ("external_id", "channel", "client_id", "owner", "caller", "model_choice", "created")
    list_filter = (("channel", values_filter(("web",))), "caller")
    list_select_related = ("owner", "caller")
    search_fields = ("external_id", "client_id", "owner__key")
    readonly_fields = ("channel", "client_id", "external_id", "owner", "caller", "working_directory",
                       "created_at", "updated_at", "recent_messages")

    @admin.display(description="messages")
    def recent_messages(self, obj):
        """The newest RECENT_MESSAGES messages, oldest first, and a link to all of them: a page of one read,
        whatever the conversation's length (an inline of every message was a read and a form row each)."""
        if obj is None or obj.pk is None:
            return "-"
        rows = list(Message.objects.filter(conversation=obj).select_related("actor")
                    .order_by("-id")[:RECENT_MESSAGES + 1])
        more, rows = len(rows) > RECENT_MESSAGES, rows[:RECENT_MESSAGES][::-1]
        every = reverse("admin:channels_app_message_changelist") + f"?conversation__id__exact={obj.pk}"
        if not rows:
            return "none yet"
        body = format_html_join("\n", '<tr><td><a href="{}">{}</a></td><td>{}</td><td>{}</td><td>{}</td>'
                                       '<td>{}</td><td>{}</td></tr>', (
            (reverse("admin:channels_app_message_change", args=[m.pk]), m.pk, m.role,
             m.content if len(m.content) <= MESSAGE_TEXT_SHOWN else m.content[:MESSAGE_TEXT_SHOWN] + " …",
             m.actor.key if m.actor_id else "-", "hidden" if m.hidden else "", m.created_at)
            for m in rows))
        caption = (f"the newest {RECENT_MESSAGES}, oldest first" if more else "all of them, oldest first")
        return format_html('<p>{} (<a href="{}">every message of this conversation</a>)</p><table>'
                           '<thead><tr><th>id</th><th>role</th><th>content</th><th>actor</th><th></th>'
                           '<th>created at</th></tr></thead><tbody>{}</tbody></table>', caption, every, body)

    def has_add_permission(self, request):
        return False

    def save_model(self, request, obj, form, change):
        # only what the form changed: a full save would write back hidden_messages as the page read it, and
        # lose what a compaction counted meanwhile
        obj.save(update_fields=[*form.changed_data, "updated_at"] if change else None)


@admin.register(Turn)
class TurnAdmin(RecordAdmin):
    list_display = ("turn_id", "state", "age", "model", "conversation", "actor", "stop_requested_by",
                    "total_tokens", "usage_source", "created", "finished_at")
    list_filter = ("state", ("model", values_filter(models_known)),
                   ("input_mode", values_filter(("", *INPUT_MODES))), "cancel_requested",
                   ("created_at", admin.DateFieldListFilter))
    list_select_related = ("conversation", "actor")
    search_fields = ("turn_id", "conversation__external_id", "actor__key", "stop_requested_by")
    sortable_by = ("turn_id", "created")
    actions = ["stop"]
    change_form_template = "admin/channels_app/turn/change_form.html"

    @admin.display(description="age")
    def age(self, obj):
        end = obj.finished_at or timezone.now()
        seconds = max(0, int((end - obj.created_at).total_seconds()))
        return f"{seconds // 60}m {seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"

    def has_stop_permission(self, request):
        return self.may_act(request)

    @admin.action(description="Stop the selected running turns", permissions=["stop"])
    def stop(self, request, queryset):
        stopped = 0
        for turn in queryset:
            ok, text = turn_stop_from_admin(request, turn)
            stopped += ok
            if not ok:
                self.message_user(request, text, messages.WARNING)
        if stopped:
            self.message_user(request, f"Asked {stopped} turn(s) to stop (by {admin_actor(request)}); "
                              "each stops within one engine step.", messages.SUCCESS)

    def get_urls(self):
        return [path("<path:object_id>/stop/", self.admin_site.admin_view(self.stop_view),
                     name="channels_app_turn_stop")] + super().get_urls()

    def stop_view(self, request, object_id):
        """The Stop button on a running turn's page (POST only)."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_stop_permission(request):  # before the lookup: an account that may not stop learns no ids
            self.message_user(request, "Your account may not stop turns.", messages.ERROR)
            return HttpResponseRedirect(reverse("admin:channels_app_turn_changelist"))
        turn = self.get_object(request, unquote(object_id))  # None for a missing id and one that is no id ("abc")
        if turn is None:
            raise Http404("No such turn.")
        ok, text = turn_stop_from_admin(request, turn)
        self.message_user(request, text, messages.SUCCESS if ok else messages.WARNING)
        return HttpResponseRedirect(reverse("admin:channels_app_turn_change", args=[turn.pk]))

    def render_change_form(self, request, context, *args, obj=None, **kwargs):
        context["can_stop"] = bool(obj and obj.state in LIVE_TURN_STATES and not obj.cancel_requested
                                   and self.has_stop_permission(request))
        return super().render_change_form(request, context, *args, obj=obj, **kwargs)


@admin.register(Receipt)
class ReceiptAdmin(RecordAdmin):
    list_display = ("client_message_id", "state", "conversation", "actor", "created", "finished_at")
    list_filter = ("state", ("created_at", admin.DateFieldListFilter))
    list_select_related = ("conversation", "actor")
    search_fields = ("client_message_id", "conversation__external_id", "actor__key", "answer")


@admin.register(Message)
class MessageAdmin(RecordAdmin):
    list_display = ("id", "conversation", "role", "short", "hidden", "created")
    list_filter = ("role", "hidden", ("created_at", admin.DateFieldListFilter))
    list_select_related = ("conversation",)
    search_fields = ("content", "conversation__external_id")

    @admin.display(description="content")
    def short(self, obj):
        return obj.content[:80]


@admin.register(Event)
class EventAdmin(RecordAdmin):
    list_display = ("id", "type", "conversation", "turn", "created")
    list_filter = (("type", values_filter(lambda: events.EVENT_TYPES)), ("created_at", admin.DateFieldListFilter))
    list_select_related = ("conversation", "turn")
    search_fields = ("type", "conversation__external_id", "turn__turn_id")


@admin.register(Steering)
class SteeringAdmin(BoundedListAdmin):
    list_display = ("id", "turn", "state", "created")
    list_filter = ("state", ("created_at", admin.DateFieldListFilter))
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


@admin.register(File)
class FileAdmin(RecordAdmin):
    """Uploaded files (POST /v1/files): records, deleted only by retention (channels_app.files.files_prune)."""

    list_display = ("file_id", "filename", "mime", "size", "conversation", "actor", "created", "expires_at")
    list_select_related = ("conversation", "actor")
    list_filter = (("mime", values_filter()), ("purpose", values_filter(files.PURPOSES)),
                   ("created_at", admin.DateFieldListFilter))
    sortable_by = ("file_id", "created", "expires_at")
    search_fields = ("file_id", "filename", "conversation__external_id", "actor__key")
    readonly_fields = ("file_id", "conversation", "actor", "caller", "filename", "purpose", "mime", "size",
                       "sha256", "storage_name", "created_at", "updated_at", "expires_at")
