"""The conversation hub's data: callers, keys, actors, conversations, turns, receipts, events."""
import hashlib
import secrets

from django.db import models
from django.db.models import BooleanField, Q
from django.db.models.expressions import RawSQL

from ugent_common.models import TimeStamped


class Role(models.TextChoices):
    OPERATOR = "operator", "operator"
    APPLICATION = "application", "application"


class Caller(TimeStamped):
    """A front end or integrating application that holds API keys."""

    name = models.SlugField(max_length=100, unique=True)
    role = models.CharField(max_length=20, choices=Role.choices, default=Role.APPLICATION)
    issuers = models.JSONField(default=list, blank=True,
                               help_text="Federation issuers an application may name users of.")
    default_model = models.CharField(max_length=200, blank=True, default="")
    from_config = models.BooleanField(default=False, help_text="Defined in ugent.toml / the environment.")
    allow_remote_control = models.BooleanField(
        null=True, blank=True, default=None,
        help_text=("May its requests change things through POST /v1/ugent/commands (/model, /harness edits, "
                   "/steering)? Unset: operators may, applications may not."))

    def __str__(self):
        return f"{self.name} ({self.role})"

    @property
    def remote_control_allowed(self) -> bool:
        """allow_remote_control as set, else by role: an operator front end may, an application may not."""
        if self.allow_remote_control is not None:
            return bool(self.allow_remote_control)
        return self.role == Role.OPERATOR

    @property
    def anonymous_actor_key(self) -> str:
        return f"web-user@{self.name}"


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiKey(TimeStamped):
    """A key of a caller; only its hash is stored."""

    caller = models.ForeignKey(Caller, on_delete=models.CASCADE, related_name="keys")
    label = models.CharField(max_length=100, blank=True, default="")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=12, editable=False, default="")
    active = models.BooleanField(default=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return f"{self.caller.name}:{self.prefix}…"

    @staticmethod
    def generate() -> str:
        return "ugk_" + secrets.token_urlsafe(32)

    def set_key(self, raw: str) -> None:
        self.key_hash = hash_key(raw)
        self.prefix = raw[:8]


class Actor(TimeStamped):
    """An end user: `{channel}:{user_id}`, `web-user@<caller>`, or a federated subject."""

    key = models.CharField(max_length=300, unique=True)
    channel = models.CharField(max_length=50, default="web")
    user_id = models.CharField(max_length=255, blank=True, default="")
    caller = models.ForeignKey(Caller, null=True, blank=True, on_delete=models.SET_NULL,
                               related_name="actors")
    federation_issuer = models.CharField(max_length=200, blank=True, default="")
    federation_subject = models.CharField(max_length=255, blank=True, default="")
    display_name = models.CharField(max_length=200, blank=True, default="")
    model_choice = models.CharField(max_length=200, blank=True, default="",
                                    help_text="The user's stored /model choice.")

    def __str__(self):
        return self.key


class Conversation(TimeStamped):
    """A conversation; it belongs to whoever first sent a message in it."""

    channel = models.CharField(max_length=50, default="web")
    client_id = models.CharField(max_length=200, blank=True, default="",
                                 help_text="Namespaces conversation ids for clients sharing a channel.")
    external_id = models.CharField(max_length=255)
    owner = models.ForeignKey(Actor, on_delete=models.PROTECT, related_name="conversations")
    hidden_messages = models.PositiveIntegerField(default=0, editable=False, help_text=(
        "How many of its messages compaction has hidden, kept by compaction: the session tail's hidden_count."))
    caller = models.ForeignKey(Caller, null=True, blank=True, on_delete=models.SET_NULL,
                               related_name="conversations")
    model_choice = models.CharField(max_length=200, blank=True, default="",
                                    help_text="The stored /model choice for this conversation.")
    working_directory = models.CharField(
        max_length=1000, blank=True, default="",
        help_text="Its working directory, relative to the workspace root (empty: the root). PUT /v1/ugent/directory.")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["channel", "client_id", "external_id"],
                                    name="uniq_conversation_identity"),
        ]
        # the admin's list filtered by channel, newest first: through the identity's index SQLite sorted every
        # conversation of the channel on each page load
        indexes = [models.Index(fields=["channel", "id"], name="conversation_channel_id")]

    def __str__(self):
        ns = f"{self.client_id}/" if self.client_id else ""
        return f"{self.channel}:{ns}{self.external_id}"


class ReceiptState(models.TextChoices):
    ACCEPTED = "accepted"
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    REFUSED = "refused"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    ABANDONED = "abandoned"


FINAL_STATES = {ReceiptState.COMPLETED, ReceiptState.CANCELLED, ReceiptState.REFUSED,
                ReceiptState.FAILED, ReceiptState.INTERRUPTED, ReceiptState.ABANDONED}


class Receipt(TimeStamped):
    """Where one message stands; the unique constraint makes a repeat run nothing."""

    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="receipts")
    client_message_id = models.CharField(max_length=255)
    content_hash = models.CharField(max_length=64)
    actor = models.ForeignKey(Actor, on_delete=models.PROTECT, related_name="receipts")
    state = models.CharField(max_length=20, choices=ReceiptState.choices, default=ReceiptState.ACCEPTED)
    answer = models.TextField(blank=True, default="")
    citations = models.JSONField(default=list, blank=True)
    files = models.JSONField(default=list, blank=True)
    reason = models.TextField(blank=True, default="", help_text="Why it was refused or failed.")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["conversation", "client_message_id"],
                                    name="uniq_receipt_client_message_id"),
        ]
        # a conversation's newest receipts (its snapshot, at each stream's subscribe and gap): PostgreSQL
        # walked the whole table's ids backwards, SQLite sorted every receipt of the conversation
        indexes = [models.Index(fields=["conversation", "id"], name="receipt_conv_id")]

    def __str__(self):
        return f"{self.client_message_id} ({self.state})"


class TurnState(models.TextChoices):
    ACCEPTED = "accepted"
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    REFUSED = "refused"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    ABANDONED = "abandoned"


LIVE_TURN_STATES = (TurnState.ACCEPTED, TurnState.RUNNING)

# How a turn's message came, when it was spoken (a turn's `input_mode`; "" for typed): the API's `input_mode`,
# and what keeps a conversation's messages out of memory under `[voice] memory_write = false`.
INPUT_MODES = ("voice", "live")


class TurnQuerySet(models.QuerySet):
    def live(self):
        """The accepted and running turns, read through the partial index `turn_live`, never the whole table.

        SQLite uses a partial index only for a query whose WHERE holds the index's own condition, and it
        decides that when the statement is prepared, before a parameter is bound: `state = %s` or
        `state__in=[...]` alone never match the index's literals, and the sweep (every
        UGENT_TURN_SWEEP_SECONDS) and each metrics scrape read every turn ever run. So the condition goes
        in as the index's literal SQL; PostgreSQL, which proves the index from bound values too, reads it
        the same way. Narrow it further with filter(state=…)."""
        table = self.model._meta.db_table
        states = ", ".join(f"'{s}'" for s in LIVE_TURN_STATES)  # the enum's own values, never input
        return self.filter(RawSQL(f'"{table}"."state" IN ({states})', (), output_field=BooleanField()))

    def spoken(self):
        """The turns whose message was spoken (`INPUT_MODES`), read through the partial index `turn_spoken_conv`
        by conversation: "did this conversation ever have voice?" is asked at a turn's end under `[voice]
        memory_write = false`, and through the conversation's own index it walked every turn the conversation
        ever ran. The condition goes in as the index's literal SQL, as `live()`'s does."""
        table = self.model._meta.db_table
        modes = ", ".join(f"'{m}'" for m in INPUT_MODES)  # the constants' own values, never input
        return self.filter(RawSQL(f'"{table}"."input_mode" IN ({modes})', (), output_field=BooleanField()))


class Turn(TimeStamped):
    """One run of the agent for one message."""

    objects = TurnQuerySet.as_manager()

    turn_id = models.CharField(max_length=100, unique=True)
    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="turns")
    actor = models.ForeignKey(Actor, on_delete=models.PROTECT, related_name="turns")
    receipt = models.OneToOneField(Receipt, on_delete=models.CASCADE, related_name="turn")
    state = models.CharField(max_length=20, choices=TurnState.choices, default=TurnState.ACCEPTED)
    model = models.CharField(max_length=200, blank=True, default="")
    profile = models.ForeignKey("plugins_app.AgentProfile", null=True, blank=True,
                                on_delete=models.SET_NULL, related_name="turns")
    allowed_tools = models.JSONField(null=True, blank=True)
    denied_tools = models.JSONField(null=True, blank=True)
    disable_memory_recall = models.BooleanField(default=False)
    disable_code_context = models.BooleanField(default=False)
    disable_memory_write = models.BooleanField(default=False)
    input_mode = models.CharField(max_length=10, blank=True, default="")
    include_thinking = models.BooleanField(default=False)
    citation_ids = models.JSONField(default=list, blank=True)
    context = models.JSONField(default=dict, blank=True,
                               help_text="What the hooks before the turn added (routing tags, context).")
    cancel_requested = models.BooleanField(default=False)
    stop_requested_by = models.CharField(max_length=300, blank=True, default="",
                                         help_text="The actor key (or turn_id holder) that asked it to stop.")
    error = models.TextField(blank=True, default="")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(
        null=True, blank=True,
        help_text="While running: the process running it renews this; past it, the turn has lost its worker.")
    # Who asked, for the usage sums: the caller, and the admin-issued key (null: a configured key).
    caller = models.ForeignKey(Caller, null=True, blank=True, on_delete=models.SET_NULL, related_name="turns")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="turns")
    # OpenAI's usage, from the upstream where it reports it, counted otherwise (usage_source).
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    total_tokens = models.PositiveIntegerField(null=True, blank=True)
    usage_source = models.CharField(max_length=10, blank=True, default="",
                                    help_text='"upstream": the engine reported it; "counted": counted here.')
    ttft_ms = models.FloatField(null=True, blank=True, help_text="Milliseconds from start to the first answer token.")
    # The files the turn's tools returned: [{artifact_id, id, name, mime, bytes, url, expires_at} | {…, pending}
    # | {…, error}] (channels_app.artifacts, docs/tools.md).
    artifacts = models.JSONField(default=list, blank=True)

    class Meta:
        # the sweep reads the live turns (running by lease, accepted by age); ended ones leave the index. A
        # conversation's live turn (a stop or a steer by conversation) is read through the second: through the
        # conversation's own index it walked every turn the conversation ever ran when none was live
        indexes = [models.Index(fields=["state"], name="turn_live", condition=Q(state__in=LIVE_TURN_STATES)),
                   models.Index(fields=["conversation", "id"], name="turn_live_conv",
                                condition=Q(state__in=LIVE_TURN_STATES)),
                   # whether a conversation ever had a spoken turn (TurnQuerySet.spoken): typed turns stay out
                   models.Index(fields=["conversation"], name="turn_spoken_conv", condition=Q(input_mode__in=INPUT_MODES))]

    def __str__(self):
        return f"{self.turn_id} ({self.state})"

    @property
    def is_spoken(self) -> bool:
        """Whether its message was spoken (`INPUT_MODES`); `Turn.objects.spoken()` reads such turns."""
        return (self.input_mode or "") in INPUT_MODES


class Message(TimeStamped):
    """A message as the conversation keeps it."""

    class Role(models.TextChoices):
        USER = "user"
        ASSISTANT = "assistant"
        SYSTEM = "system"

    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="messages")
    role = models.CharField(max_length=20, choices=Role.choices)
    content = models.TextField(blank=True, default="")
    actor = models.ForeignKey(Actor, null=True, blank=True, on_delete=models.SET_NULL)
    turn = models.ForeignKey(Turn, null=True, blank=True, on_delete=models.SET_NULL, related_name="messages")
    hidden = models.BooleanField(default=False, help_text="Hidden by compaction.")

    class Meta:
        # conversation history in order: the turn runner reads it every turn; and the newest summary
        # (statements.summary_latest_step, every turn too), which names the condition as literal SQL
        indexes = [models.Index(fields=["conversation", "id"], name="message_conv_id"),
                   models.Index(fields=["conversation", "id"], name="message_conv_system",
                                condition=Q(role="system")),
                   # the visible ones: the turn's history read (statements._history_sql), the session tail
                   models.Index(fields=["conversation", "id"], name="message_conv_visible",
                                condition=Q(hidden=False))]


class Event(models.Model):
    """The durable event log; its id is the stream cursor."""

    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="events")
    turn = models.ForeignKey(Turn, null=True, blank=True, on_delete=models.CASCADE, related_name="events")
    type = models.CharField(max_length=60)
    # Actor keys that may see it; empty means everyone who may see the conversation.
    audience = models.JSONField(default=list, blank=True)
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        # the chat stream reads a turn's events after a cursor
        indexes = [models.Index(fields=["turn", "id"], name="event_turn_id"),
                   # the activity stream reads a conversation's events after a cursor
                   models.Index(fields=["conversation", "id"], name="event_conv_id"),
                   # the pending artifacts' expiry (channels_app.artifacts): partial, so no other append
                   # writes to it
                   models.Index(fields=["created_at"], name="event_artifacts_pending",
                                condition=Q(type="ugent.artifacts_pending"))]
        constraints = [models.CheckConstraint(condition=~Q(type=""), name="event_type_not_empty")]

    def __str__(self):
        return f"#{self.id} {self.type}"


class SteeringState(models.TextChoices):
    PENDING = "pending"
    APPLIED = "applied"
    DROPPED = "dropped"


class Steering(TimeStamped):
    """A message steered into a running turn; the runner hands it to the engine before its next step."""

    turn = models.ForeignKey(Turn, on_delete=models.CASCADE, related_name="steerings")
    actor = models.ForeignKey(Actor, on_delete=models.PROTECT, related_name="steerings")
    text = models.TextField()
    state = models.CharField(max_length=10, choices=SteeringState.choices, default=SteeringState.PENDING)
    applied_at = models.DateTimeField(null=True, blank=True)
    client_message_id = models.CharField(max_length=255, blank=True, default="", help_text=(
        "The sender's idempotency key, if it sent one: a repeat is answered with this steering and adds none."))

    class Meta:
        # the runner asks "is anything pending for this turn?" between engine steps; a keyed steering's resend
        # is found by its key (streams.steering_repeat), not by walking every turn of the conversation
        indexes = [models.Index(fields=["turn", "state"], name="steering_turn_state"),
                   models.Index(fields=["client_message_id"], name="steering_key")]
        constraints = [models.UniqueConstraint(fields=["turn", "client_message_id"],
                                               condition=~models.Q(client_message_id=""),
                                               name="uniq_steering_message")]

    def __str__(self):
        return f"steering of {self.turn_id} ({self.state})"


class EventLogMark(models.Model):
    """A position the hub keeps in a table read in id order: where retention has pruned the event log to
    (cursors at or below it may have lost events), and how far the usage rollup has folded the turns."""

    name = models.CharField(max_length=50, unique=True)
    value = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    PRUNED_THROUGH = "pruned_through"
    USAGE_ROLLED_THROUGH = "usage_rolled_through"

    def __str__(self):
        return f"{self.name}={self.value}"


class Usage(TimeStamped):
    """What a caller's turns used through one of its admin-issued keys (`key_id`; 0: no such key, a configured
    key or a token), folded in by the usage rollup (channels_app.usage) up to its mark: every turn at or below
    the mark, none after it. A row per caller and key, so the admin's caller and key lists read these, not
    every turn ever run. A plain id, not a key's foreign key: a deleted key's turns stay its caller's."""

    caller = models.ForeignKey(Caller, on_delete=models.CASCADE, related_name="usage_rows")
    key_id = models.BigIntegerField(default=0)
    turns = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    total_tokens = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["caller", "key_id"], name="uniq_usage_caller_key")]

    def __str__(self):
        return f"{self.caller_id}/{self.key_id}: {self.turns} turns"


class Issuer(TimeStamped):
    """A `[[web.auth.issuers]]` entry: an identity provider whose JWTs name end users.

    A request carrying one of its tokens acts for `<actor_prefix><sub>` (channels_app.federation)."""

    issuer = models.CharField(max_length=200, unique=True, help_text="The tokens' `iss`, exactly.")
    jwks_url = models.URLField(max_length=500, help_text="Where its public keys are published (JWKS).")
    audience = models.CharField(max_length=200, help_text="The `aud` its tokens must carry for this daemon.")
    actor_prefix = models.CharField(max_length=100, unique=True,
                                    help_text="The actor is <actor_prefix><sub>, e.g. 'crm:'.")
    algorithms = models.JSONField(default=list, blank=True,
                                  help_text="Allowed algorithms (asymmetric only); empty means RS256, ES256.")
    leeway_secs = models.PositiveIntegerField(default=30, help_text="Clock skew allowed on exp and nbf.")
    from_config = models.BooleanField(default=False, help_text="Defined in ugent.toml (the file wins for it).")

    def __str__(self):
        return self.issuer


class CallerDefaults(TimeStamped):
    """Per-caller defaults: opt-outs and a model applied to every turn that asserts one federation issuer.
    A request can add opt-outs to them, never switch them back on."""

    issuer = models.CharField(max_length=200, unique=True,
                              help_text="The federation issuer a turn asserts (a token's iss, or federation_issuer).")
    model = models.CharField(max_length=200, blank=True, default="",
                             help_text="The model of its turns that name none (ugent-default or no model).")
    disable_memory_recall = models.BooleanField(default=False)
    disable_memory_write = models.BooleanField(default=False)
    disable_code_context = models.BooleanField(default=False)
    allowed_tools = models.JSONField(null=True, blank=True, help_text=(
        "Only these tools for its turns (null: no restriction). A request narrows it further, never widens it."))
    denied_tools = models.JSONField(default=list, blank=True, help_text='Never these tools; ["*"]: no tools at all.')
    from_config = models.BooleanField(default=False, help_text="Defined in ugent.toml (the file wins for it).")

    class Meta:
        verbose_name_plural = "caller defaults"

    def __str__(self):
        return f"defaults for {self.issuer}"


class File(TimeStamped):
    """An uploaded file (POST /v1/files): its bytes in the `ugent_files` storage, kept until expires_at.

    It belongs to its conversation; only that conversation's owner (and the operator) reads it."""

    file_id = models.CharField(max_length=64, unique=True)
    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="files")
    actor = models.ForeignKey(Actor, on_delete=models.PROTECT, related_name="files",
                              help_text="Who uploaded it (the conversation's owner).")
    caller = models.ForeignKey(Caller, null=True, blank=True, on_delete=models.SET_NULL, related_name="files")
    filename = models.CharField(max_length=255, help_text="The name the client gave it.")
    purpose = models.CharField(max_length=40, default="user_data")
    mime = models.CharField(max_length=100, help_text="Sniffed from the bytes, not taken from the client.")
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64, editable=False, help_text="Of the bytes; the download's ETag.")
    storage_name = models.CharField(max_length=300, editable=False, help_text="Its name in the storage.")
    expires_at = models.DateTimeField()

    class Meta:
        # the retention job reads the expired files
        indexes = [models.Index(fields=["expires_at"], name="file_expires_at")]
        constraints = [models.CheckConstraint(condition=~Q(file_id=""), name="file_id_not_empty")]

    def __str__(self):
        return f"{self.file_id} ({self.filename})"

# --- the harness: a conversation's goals and tasks, and the checks that verify them ---------------

class HarnessKind(models.TextChoices):
    GOAL = "goal"
    TASK = "task"


class HarnessState(models.TextChoices):
    OPEN = "open"
    DONE = "done"
    DROPPED = "dropped"


class HarnessItem(TimeStamped):
    """A goal or a task of a conversation (/harness), with the check that verifies it.

    A check is `phrase:TEXT` (the conversation's latest answer contains TEXT) or `file:PATH` (PATH
    exists inside the conversation's working directory); channels_app/harness.py runs it."""

    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="harness_items")
    kind = models.CharField(max_length=10, choices=HarnessKind.choices)
    text = models.TextField()
    state = models.CharField(max_length=10, choices=HarnessState.choices, default=HarnessState.OPEN)
    check_spec = models.TextField(blank=True, default="", help_text="phrase:TEXT or file:PATH; empty: none.")
    created_by = models.ForeignKey(Actor, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        # /harness and the snapshot list a conversation's items in order
        indexes = [models.Index(fields=["conversation", "id"], name="harness_conv_id")]

    def __str__(self):
        return f"{self.kind} #{self.pk} ({self.state})"


class HarnessVerification(models.Model):
    """One run of an item's check: what it found, committed with the turn end or the command that ran it."""

    item = models.ForeignKey(HarnessItem, on_delete=models.CASCADE, related_name="verifications")
    turn = models.ForeignKey(Turn, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    check_spec = models.TextField(help_text="The check as it was run.")
    passed = models.BooleanField()
    detail = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        # an item's latest verification (the snapshot, /harness)
        indexes = [models.Index(fields=["item", "id"], name="harness_verif_item_id")]

    def __str__(self):
        return f"verification of #{self.item_id} ({'passed' if self.passed else 'failed'})"

class QuestionKind(models.TextChoices):
    CHOICE = "choice"  # one question, options [{id, label}]
    FORM = "form"  # several choice questions answered together: answers [{question_id, option_id}]
    TEXT = "text"
    SECRET = "secret"  # the value lives in `answer` only until its asker takes it, then is blanked
    CONFIRM = "confirm"


class QuestionState(models.TextChoices):
    WAITING = "waiting"
    ANSWERED = "answered"
    ABORTED = "aborted"  # the user dismissed it ("action": "abort")
    EXPIRED = "expired"
    CANCELLED = "cancelled"  # its turn stopped


class Question(TimeStamped):
    """A question the agent asked mid-turn, waiting for the user it asked (channels_app.questions).

    A state machine moved only by conditional updates from `waiting`: of concurrent replies one wins."""

    request_id = models.CharField(max_length=100, unique=True, help_text="The id a reply names (request_id).")
    turn = models.ForeignKey(Turn, on_delete=models.CASCADE, related_name="questions")
    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="questions")
    actor = models.ForeignKey(Actor, on_delete=models.PROTECT, related_name="questions",
                              help_text="The user it asked: nobody else may see or answer it.")
    kind = models.CharField(max_length=10, choices=QuestionKind.choices)
    spec = models.JSONField(default=dict, blank=True, help_text="What was asked: prompt, options, questions.")
    state = models.CharField(max_length=10, choices=QuestionState.choices, default=QuestionState.WAITING)
    answer = models.JSONField(default=dict, blank=True,
                              help_text="The applied reply; a secret's value is blanked once its asker took it.")
    timeout_at = models.DateTimeField()
    resolved_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        # the snapshot and a channel's free-text reply look up the conversation's waiting question
        indexes = [models.Index(fields=["conversation", "state"], name="question_conv_state")]

    def __str__(self):
        return f"{self.request_id} ({self.kind}, {self.state})"


class ToolCallState(models.TextChoices):
    RUNNING = "running"
    DONE = "done"
    ERROR = "error"


class ToolCall(TimeStamped):
    """One tool a turn's engine called: what it was asked, what came back, how long it took."""

    turn = models.ForeignKey(Turn, on_delete=models.CASCADE, related_name="tool_calls")
    call_id = models.CharField(max_length=200, help_text="The engine's id for the call, echoed on its result.")
    name = models.CharField(max_length=200)
    toolbox = models.CharField(max_length=200, blank=True, default="")
    arguments = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=10, choices=ToolCallState.choices, default=ToolCallState.RUNNING)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    ms = models.FloatField(null=True, blank=True)
    step = models.PositiveIntegerField(default=0, help_text="The loop's step that asked for it (0: the first).")
    depth = models.PositiveIntegerField(default=0, help_text="0: the turn itself; 1+: a task it delegated.")

    class Meta:
        ordering = ["id"]

    def __str__(self):
        return f"{self.name} ({self.state})"
