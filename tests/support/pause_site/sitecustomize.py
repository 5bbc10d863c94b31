"""Put on PYTHONPATH ahead of the project, this holds a process still in the middle of cron.toml's import,
so a test can kill -9 it there (tests/cron_app/test_cron_import_killed.py).

Python imports `sitecustomize` at every start. With UGENT_TEST_PAUSE_CRON_IMPORT set to a file's path, the
process that saves its UGENT_TEST_PAUSE_AFTER_TASKS-th cron task (a `post_save` of `cron_app.CronTask`,
connected by name, so nothing of the project is imported here) writes its pid to that file and sleeps:
inside the import's transaction, with some rows written and others not. Without the variable it does nothing.
"""
import os

if os.environ.get("UGENT_TEST_PAUSE_CRON_IMPORT"):
    def _connect() -> None:
        import time

        from django.db.models.signals import post_save

        mark = os.environ["UGENT_TEST_PAUSE_CRON_IMPORT"]
        after = int(os.environ.get("UGENT_TEST_PAUSE_AFTER_TASKS", "1"))
        saved = []

        def pause(sender, instance, **kwargs):
            saved.append(instance.task_id)
            if len(saved) == after:
                with open(mark + ".tmp", "w") as fh:
                    fh.write(f"{os.getpid()} {' '.join(saved)}")
                os.replace(mark + ".tmp", mark)
                time.sleep(3600)  # until the test's kill -9

        post_save.connect(pause, sender="cron_app.CronTask", weak=False, dispatch_uid="ugent-test-pause")

    _connect()
