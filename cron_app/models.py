"""Cron jobs (cron.toml ⇄ rows), their tasks and destinations, and the runs they make."""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q

from ugent_common.models import TimeStamped


class CronSettings(TimeStamped):
    """The top level of cron.toml: one row (pk=1)."""

    enabled = models.BooleanField(
        default=True, help_text="Off: no job runs, and rules that start a workflow are told "
                                "“cron is not running here”.")
    file_sha256 = models.CharField(
        max_length=64, blank=True, default="", editable=False,
        help_text="The SHA-256 of the cron.toml last imported: the daemon imports UGENT_CRON_FILE again only "
                  "when its text differs, so an admin edit stays until the file changes.")

    class Meta:
        verbose_name = verbose_name_plural = "cron settings"

    def __str__(self):
        return f"cron ({'enabled' if self.enabled else 'disabled'})"

    @classmethod
    def current(cls) -> "CronSettings":
        return cls.objects.get_or_create(pk=1)[0]


class Overlap(models.TextChoices):
    SKIP = "skip"  # a new run is not started while one is waiting or running
    QUEUE = "queue"  # a new run waits for a free place (max_concurrent_runs), at most that many wait
    ALLOW = "allow"  # runs start at once, up to max_concurrent_runs


class CatchUp(models.TextChoices):
    ONCE = "once"
    NONE = "none"


class CronJob(TimeStamped):
    """A `[[jobs]]` entry of cron.toml."""

    name = models.SlugField(max_length=100, unique=True, verbose_name="id",
                            help_text="The job's id in cron.toml; the workflow name rules use.")
    enabled = models.BooleanField(default=True)
    rule_trigger = models.BooleanField(default=False, help_text="A rule's StartWorkflow may start it.")
    schedule = models.CharField(max_length=200, blank=True, default="",
                                help_text="Five-field crontab (minute hour day-of-month month day-of-week); "
                                          "empty: only a rule or an operator starts it.")
    timezone = models.CharField(max_length=64, blank=True, default="",
                                help_text="IANA name the schedule is read in; empty: UTC.")
    overlap = models.CharField(max_length=10, choices=Overlap.choices, default=Overlap.SKIP)
    max_concurrent_runs = models.PositiveIntegerField(default=1)
    catch_up = models.CharField(max_length=10, choices=CatchUp.choices, default=CatchUp.ONCE,
                                help_text="A slot missed while cron was down: run it once on start, or not.")
    position = models.PositiveIntegerField(default=0, help_text="Order in cron.toml.")
    periodic_task = models.OneToOneField("django_celery_beat.PeriodicTask", null=True, blank=True,
                                         editable=False, on_delete=models.SET_NULL, related_name="cron_job")
    schedule_since = models.DateTimeField(null=True, blank=True, editable=False,
                                          help_text="Slots before this were never owed (schedule set or "
                                                    "enabled at this time).")

    class Meta:
        ordering = ["position", "name"]
        constraints = [models.CheckConstraint(condition=Q(max_concurrent_runs__gte=1),
                                              name="cronjob_max_concurrent_runs_positive")]

    def __str__(self):
        return self.name

    def clean(self):
        from cron_app.schedule import ScheduleError, parse_schedule, parse_timezone
        try:
            if self.schedule:
                parse_schedule(self.schedule)
        except ScheduleError as exc:
            raise ValidationError({"schedule": str(exc)})
        try:
            parse_timezone(self.timezone)
        except ScheduleError as exc:
            raise ValidationError({"timezone": str(exc)})


class CronTask(TimeStamped):
    """A `[[jobs.tasks]]` entry: one prompt, run as one agent turn."""

    job = models.ForeignKey(CronJob, on_delete=models.CASCADE, related_name="tasks")
    task_id = models.SlugField(max_length=100, verbose_name="id")
    prompt = models.TextField()
    model = models.CharField(max_length=200, blank=True, default="",
                             help_text="The agent profile's model name; empty: the default.")
    position = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["position", "id"]
        constraints = [models.UniqueConstraint(fields=["job", "task_id"], name="uniq_crontask_id")]

    def __str__(self):
        return f"{self.job.name}/{self.task_id}"


class CronDestination(TimeStamped):
    """A `[[jobs.destinations]]` entry: a conversation that receives the run's result."""

    job = models.ForeignKey(CronJob, on_delete=models.CASCADE, related_name="destinations")
    channel = models.CharField(max_length=50)
    conversation = models.CharField(max_length=255, help_text="The conversation's id on that channel.")
    position = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["position", "id"]

    def __str__(self):
        return f"{self.channel}:{self.conversation}"


class RunTrigger(models.TextChoices):
    SCHEDULED = "scheduled"
    RULE = "rule"
    TOOL = "tool"  # a turn's start_scheduled_job (cron_app/tools.py)
    MANUAL = "manual"
    CATCH_UP = "catch_up"


class RunState(models.TextChoices):
    WAITING = "waiting"  # overlap = queue: waits for a free place
    QUEUED = "queued"  # holds a place; its Celery task is on the way
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"  # the operator cancelled it (the admin)
    SKIPPED = "skipped"  # a slot that could not start (overlap, too many, missed with catch_up = none)


ACTIVE_STATES = (RunState.WAITING, RunState.QUEUED, RunState.RUNNING)
PLACE_STATES = (RunState.QUEUED, RunState.RUNNING)
FINAL_RUN_STATES = (RunState.COMPLETED, RunState.FAILED, RunState.TIMED_OUT, RunState.INTERRUPTED,
                    RunState.CANCELLED, RunState.SKIPPED)


class CronRun(TimeStamped):
    """One run of a job: who it acts for, why it started, and how each task went."""

    job = models.ForeignKey(CronJob, null=True, blank=True, on_delete=models.SET_NULL, related_name="runs")
    job_name = models.CharField(max_length=100, help_text="Kept when the job is deleted or re-imported.")
    trigger = models.CharField(max_length=20, choices=RunTrigger.choices)
    state = models.CharField(max_length=20, choices=RunState.choices, default=RunState.QUEUED)
    slot = models.DateTimeField(null=True, blank=True, help_text="The schedule slot it fired for.")
    acts_for = models.ForeignKey("channels_app.Actor", null=True, blank=True, on_delete=models.SET_NULL,
                                 related_name="+", help_text="Empty: a sender who could not be identified.")
    conversation = models.ForeignKey("channels_app.Conversation", null=True, blank=True,
                                     on_delete=models.SET_NULL, related_name="+",
                                     help_text="The run's own conversation (channel cron).")
    # where a rule-started run came from, and where its result goes back to
    origin = models.ForeignKey("channels_app.Conversation", null=True, blank=True,
                               on_delete=models.SET_NULL, related_name="+",
                               help_text="The conversation the starting message arrived in.")
    origin_channel = models.CharField(max_length=50, blank=True, default="")
    origin_conversation_id = models.CharField(max_length=255, blank=True, default="")
    origin_user_id = models.CharField(max_length=255, blank=True, default="")
    message = models.TextField(blank=True, default="", help_text="The message that started it (rule runs).")
    inject_context = models.BooleanField(default=False)
    boundary = models.CharField(max_length=64, blank=True, default="", editable=False,
                                help_text="The fence of the [rule_trigger] block.")
    limits = models.JSONField(default=dict, blank=True, help_text="The sender's opt-outs and tool limits.")
    outputs = models.JSONField(default=list, blank=True, help_text="Each task's turn, state and output.")
    result = models.TextField(blank=True, default="")
    deliveries = models.JSONField(default=list, blank=True, help_text="Where the result went, and how.")
    error = models.TextField(blank=True, default="")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # A run that `manage.py cron run` executes in its own process (embedded mode) is held by that
    # process: it renews the lease while it lives; a lapsed lease means it died and the run is over.
    runner = models.CharField(max_length=200, blank=True, default="", editable=False,
                              help_text="The `cron run` process executing it, if one is.")
    runner_lease_expires_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-id"]
        constraints = [
            # a schedule slot fires once, however many beats or workers see it
            models.UniqueConstraint(fields=["job_name", "slot"], condition=Q(slot__isnull=False),
                                    name="uniq_cronrun_job_slot"),
        ]
        # the claims count a job's waiting/queued/running runs; the sweep (every minute), start-up's recovery
        # and the health board read the runs in a state across jobs, which without an index of their own
        # meant every run ever made
        indexes = [models.Index(fields=["job_name", "state"], name="cronrun_job_state"),
                   models.Index(fields=["state"], name="cronrun_state"),
                   # the admin's list of one job's runs, newest first (a minutely job makes 1,440 a day): through
                   # (job name, state) each page load sorted every run the job ever had
                   models.Index(fields=["job_name", "id"], name="cronrun_job_id")]

    def __str__(self):
        return f"{self.job_name} #{self.pk} ({self.state})"
