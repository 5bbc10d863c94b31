"""Cron in the admin: the top-level switch, jobs with their tasks and destinations, and the runs."""
from django.contrib import admin, messages

from cron_app import services
from cron_app.models import CronDestination, CronJob, CronRun, CronSettings, CronTask
from ugent_common.admin import BoundedListAdmin, values_filter


@admin.register(CronSettings)
class CronSettingsAdmin(admin.ModelAdmin):
    list_display = ("__str__", "enabled", "updated_at")
    readonly_fields = ("file_sha256", "created_at", "updated_at")

    def has_add_permission(self, request):
        return not CronSettings.objects.exists()

    def save_model(self, request, obj, form, change):
        services.cron_settings_set(enabled=obj.enabled)


class CronTaskInline(admin.StackedInline):
    model = CronTask
    extra = 0
    fields = ("task_id", "prompt", "model", "position")


class CronDestinationInline(admin.TabularInline):
    model = CronDestination
    extra = 0
    fields = ("channel", "conversation", "position")


@admin.register(CronJob)
class CronJobAdmin(admin.ModelAdmin):
    list_display = ("name", "enabled", "rule_trigger", "schedule", "timezone", "overlap",
                    "max_concurrent_runs", "catch_up", "periodic_task")
    list_select_related = ("periodic_task",)
    list_filter = ("enabled", "rule_trigger", "overlap", "catch_up")
    search_fields = ("name", "tasks__prompt")
    readonly_fields = ("periodic_task", "schedule_since", "created_at", "updated_at")
    inlines = [CronTaskInline, CronDestinationInline]
    actions = ["run_now"]

    def save_related(self, request, form, formsets, change):
        super().save_related(request, form, formsets, change)
        # the beat schedule follows the row: a service, after the row and its inlines are saved
        services.cron_job_schedule_sync(job=form.instance)

    def delete_model(self, request, obj):
        services.cron_job_delete(job=obj)

    def delete_queryset(self, request, queryset):
        for job in queryset.select_related("periodic_task"):
            services.cron_job_delete(job=job)

    @admin.action(description="Run now (as the operator)")
    def run_now(self, request, queryset):
        for job in queryset:
            try:
                run = services.cron_run_manual(job_name=job.name)
            except services.CronError as exc:
                self.message_user(request, str(exc), messages.WARNING)
            else:
                self.message_user(request, f"Cron job '{job.name}': run #{run.pk} is {run.state}.")


def job_names() -> list[str]:
    return list(CronJob.objects.values_list("name", flat=True))


@admin.register(CronRun)
class CronRunAdmin(BoundedListAdmin):
    list_display = ("id", "job_name", "trigger", "state", "slot", "acts_for", "origin_channel", "created",
                    "finished_at")
    list_select_related = ("acts_for",)
    # a run's job_name outlives its job: the jobs' names are offered, and those of the newest runs
    list_filter = ("state", "trigger", ("job_name", values_filter(job_names)), ("created_at", admin.DateFieldListFilter))
    search_fields = ("job_name", "error", "result", "acts_for__key")
    actions = ["cancel", "retry"]

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in self.model._meta.fields]

    def has_act_permission(self, request):
        return request.user.has_perm("cron_app.change_cronrun")

    @admin.action(description="Cancel the selected runs (a live turn is asked to stop)", permissions=["act"])
    def cancel(self, request, queryset):
        by = f"admin:{request.user.get_username()}"
        done, left = [], []
        for run in queryset:
            (done if services.cron_run_cancel(run_pk=run.pk, by=by) else left).append(run)
        if done:
            self.message_user(request, f"Cancelled {len(done)} run(s) (by {by}): "
                              + ", ".join(f"#{r.pk} of '{r.job_name}'" for r in done) + ".", messages.SUCCESS)
        for run in left:
            run.refresh_from_db(fields=["state"])
            self.message_user(request, f"Run #{run.pk} of '{run.job_name}' has ended ({run.state}): "
                              "there is nothing to cancel.", messages.WARNING)

    @admin.action(description="Retry: run the job again now (as the operator)", permissions=["act"])
    def retry(self, request, queryset):
        for run in queryset:
            try:
                new = services.cron_run_retry(run_pk=run.pk)
            except services.CronError as exc:
                self.message_user(request, str(exc), messages.WARNING)
            else:
                self.message_user(request, f"Retried run #{run.pk} of '{run.job_name}': run #{new.pk} is "
                                  f"{new.state}.", messages.SUCCESS)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
