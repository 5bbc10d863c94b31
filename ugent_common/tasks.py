"""A Celery task by its name, for the services that enqueue it; and a beat entry that runs one every N seconds.

A room's tasks module imports its services (a task takes ids and calls a service); a service that
enqueues a task names it instead of importing it back, so the two modules form no cycle.
"""
from __future__ import annotations


def task_named(name: str):
    """The registered task `name` of the current Celery app (the project's), importing the apps'
    tasks modules first when this process has not yet (Celery's own autodiscovery)."""
    from celery import current_app
    tasks = current_app.tasks
    if name not in tasks:
        current_app.loader.import_default_modules()
    return tasks[name]


def beat_every(name: str, task: str, seconds: int, description: str) -> None:
    """Create or update the beat entry `name` that runs `task` every `seconds` (django-celery-beat): what each
    room's beat_init handler makes sure of, in every beat process (embedded or `celery beat`)."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask
    schedule, _ = IntervalSchedule.objects.get_or_create(every=seconds, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.update_or_create(name=name, defaults={
        "task": task, "interval": schedule, "enabled": True, "description": description})
