"""Channel plugins' rows: registrations, secrets, outbound deliveries, media."""
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models
from django.db.models import Q

from ugent_common.models import TimeStamped


PLUGIN_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"


def validate_senders(value) -> None:
    """A list of ``channel:sender_id`` entries or ``"*"`` (allowed_senders, allow_remote_control)."""
    if not isinstance(value, list):
        raise ValidationError('A list of "channel:sender_id" entries, e.g. ["telegram:123456789"].')
    for entry in value:
        if entry != "*" and not (isinstance(entry, str) and entry.partition(":")[0] and entry.partition(":")[2]):
            raise ValidationError("%(value)r is not channel:sender_id (or \"*\").", params={"value": entry})


class PluginState(models.TextChoices):
    STOPPED = "stopped"
    RUNNING = "running"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    COOLDOWN = "cooldown"
    DISABLED = "disabled"


class Plugin(TimeStamped):
    """A channel plugin registration (one `[[plugins]]` entry of plugins.toml): what the supervisor runs."""

    plugin_id = models.CharField("id", max_length=100, unique=True,
                                 validators=[RegexValidator(PLUGIN_ID_RE, "Letters, digits, '.', '_' and '-'.")],
                                 help_text="telegram-main; also namespaces the plugin's conversations.")
    kind = models.CharField(max_length=100, validators=[RegexValidator(r"^channel-[a-z0-9][a-z0-9_-]*$",
                                                                       "A kind looks like channel-telegram.")])
    enabled = models.BooleanField(default=True)
    command = models.CharField(max_length=500, blank=True, default="",
                               help_text="The worker executable; `python` is the daemon's own. Empty for a kind "
                                         "UGENT ships: it runs that kind's own worker.")
    args = models.JSONField(default=list, blank=True)
    env_refs = models.JSONField(default=list, blank=True,
                                help_text="Names of environment variables the worker gets from the daemon's.")
    secret_env_refs = models.JSONField(default=list, blank=True,
                                       help_text="Names of variables the worker gets from the secrets vault.")
    max_in_flight = models.PositiveIntegerField(default=64)
    max_retries = models.PositiveIntegerField(default=5)
    heartbeat_secs = models.FloatField(default=30.0)
    memory_max_mb = models.PositiveIntegerField(
        "memory cap (MiB)", null=True, blank=True,
        help_text="The most data (heap, thread stacks) each process of its worker may hold, in MiB: past it an "
                  "allocation fails and the worker is restarted like any crash. Empty: UGENT_PLUGIN_MEMORY_MAX_MB "
                  "(2048 by default); 0: no cap.")
    workspace = models.CharField(max_length=500, blank=True, default="")
    allowed_senders = models.JSONField(default=list, blank=True, validators=[validate_senders],
                                       help_text='"telegram:123456789" entries; empty lets everyone in.')
    allow_remote_control = models.JSONField(
        default=list, blank=True, validators=[validate_senders],
        help_text='Senders ("telegram:123456789" entries, or "*" for every allowed sender) whose slash commands may '
                  'change things (/model NAME, /harness edits, /steering, /compress, /sandbox); empty: nobody.')
    # what the supervisor reports
    state = models.CharField(max_length=20, choices=PluginState.choices, default=PluginState.STOPPED)
    state_reason = models.CharField(max_length=500, blank=True, default="")
    disabled_reason = models.TextField(blank=True, default="",
                                       help_text="Why the circuit breaker (or setup) disabled it.")
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    restarts = models.PositiveIntegerField(default=0, help_text="Times the supervisor restarted its worker "
                                                                "after it exited or stopped heartbeating.")

    class Meta:
        ordering = ["plugin_id"]
        constraints = [
            models.CheckConstraint(condition=Q(max_in_flight__gte=1), name="plugin_max_in_flight_positive"),
            models.CheckConstraint(condition=Q(heartbeat_secs__gte=0), name="plugin_heartbeat_not_negative"),
        ]

    def __str__(self):
        return self.plugin_id

    @property
    def channel(self) -> str:
        """The channel's name in actor ids: `telegram` for kind `channel-telegram`."""
        return self.kind.removeprefix("channel-")


class PluginSecret(TimeStamped):
    """One secret_env_refs value, encrypted at rest (plugins_app.channel.secrets); never shown back."""

    plugin = models.ForeignKey(Plugin, on_delete=models.CASCADE, related_name="secrets")
    name = models.CharField(max_length=200, validators=[RegexValidator(r"^[A-Za-z_][A-Za-z0-9_]*$")])
    ciphertext = models.TextField(editable=False)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["plugin", "name"], name="uniq_plugin_secret")]

    def __str__(self):
        return f"{self.plugin_id}:{self.name}"


class DeliveryState(models.TextChoices):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    DELIVERED = "delivered"
    DEAD_LETTER = "dead_letter"
    DISCARDED = "discarded"  # a dead letter the operator chose not to send


class OutboundDelivery(TimeStamped):
    """A message a plugin's worker must send to its channel: polled, sent, acked (at least once)."""

    delivery_id = models.CharField(max_length=64, unique=True, editable=False,
                                   help_text="The idempotency key the worker acks by.")
    plugin = models.ForeignKey(Plugin, on_delete=models.CASCADE, related_name="deliveries")
    conversation = models.ForeignKey("channels_app.Conversation", on_delete=models.CASCADE,
                                     related_name="plugin_deliveries")
    turn = models.ForeignKey("channels_app.Turn", null=True, blank=True, on_delete=models.SET_NULL,
                             related_name="plugin_deliveries")
    text = models.TextField(blank=True, default="")
    payload = models.JSONField(default=dict, blank=True,
                               help_text="attachments, reply_to_message_id, metadata.")
    state = models.CharField(max_length=20, choices=DeliveryState.choices, default=DeliveryState.PENDING)
    attempt = models.PositiveIntegerField(default=1)
    # The attempts before the operator's last requeue of it as a dead letter: the worker is handed attempt
    # numbers that only grow (its outbox resends only a higher attempt than the one it failed), while the
    # retry budget (max_retries) counts from the requeue.
    attempt_base = models.PositiveIntegerField(default=0, editable=False)
    not_before = models.DateTimeField(null=True, blank=True, help_text="A retry waits until then.")
    claim = models.CharField(max_length=40, blank=True, default="", editable=False)
    handed_out_at = models.DateTimeField(null=True, blank=True)
    handed_out = models.PositiveIntegerField(default=0)
    failures = models.JSONField(default=list, blank=True)
    last_error = models.TextField(blank=True, default="", help_text="The dead letter's reason.")
    channel_message_id = models.CharField(max_length=512, blank=True, default="")
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "outbound deliveries"
        constraints = [
            # one answer per turn per plugin, however often the turn's end is recorded
            models.UniqueConstraint(fields=["plugin", "turn"], name="uniq_delivery_per_turn"),
        ]
        # outbound.poll reads a plugin's pending (and counts its in-flight) deliveries in id order
        indexes = [models.Index(fields=["plugin", "state", "id"], name="delivery_plugin_state"),
                   # the hourly prune finds settled deliveries past their retention here
                   models.Index(fields=["state", "updated_at"], name="delivery_settled"),
                   # the admin's list by state, newest first: through delivery_settled each page load sorted every
                   # delivery in the state (every delivered one)
                   models.Index(fields=["state", "id"], name="delivery_state_id")]

    def __str__(self):
        return f"{self.delivery_id} ({self.state})"


class PluginMedia(TimeStamped):
    """An attachment a worker stored with media.put (or the hub stored for a worker to fetch)."""

    media_id = models.CharField(max_length=64, unique=True)
    plugin = models.ForeignKey(Plugin, on_delete=models.CASCADE, related_name="media")
    content_type = models.CharField(max_length=200)
    filename = models.CharField(max_length=500, blank=True, default="")
    size = models.PositiveIntegerField(default=0)
    data = models.BinaryField()
    expires_at = models.DateTimeField()

    class Meta:
        # The hourly prune finds expired media here; without it every stored file's bytes are read,
        # since SQLite keeps `data` before `expires_at` in each row (and in overflow pages).
        # The quota check of media.put sums a plugin's unexpired sizes from the second one alone.
        indexes = [models.Index(fields=["expires_at"], name="pluginmedia_expiry"),
                   models.Index(fields=["plugin", "expires_at", "size"], name="pluginmedia_quota")]

    def __str__(self):
        return self.media_id
