"""A Celery task by its name, for the services that enqueue it.

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
