"""Every UGENT_/DJANGO_/CELERY_ variable the code reads from the environment is documented: named in full in
README.md (its Configuration table) or a page under docs/ (a shorthand such as "`_MAX_SECS`" does not count). DJANGO_DEBUG,
CELERY_TASK_ALWAYS_EAGER and the plugins' two backoff caps were read and documented nowhere.

A name counts wherever it is written in the code as a string literal of its own, not only as the argument of env() or
os.environ: a variable read through a helper (UGENT_EXTRA_ENGINES, by registry._env_classes) or kept in a constant
was missed, and so was bench/ (UGENT_BENCH_REDIS)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ugent_site", "ugent_common", "channels_app", "rules_app", "cron_app", "plugins_app", "bench", "scripts")
# "UGENT_X" or 'UGENT_X', the whole literal: env("X"), os.environ.get("X"), _env_classes("X"), X = "X", ...
NAME = re.compile(r"""["']((?:UGENT|DJANGO|CELERY)_[A-Z0-9_]+)["']""")


def names_read() -> dict[str, list[str]]:
    """Each name, with the files it is written in."""
    found: dict[str, list[str]] = {}
    for path in [ROOT / "manage.py", *(p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py")))]:
        where = path.relative_to(ROOT).as_posix()
        for name in dict.fromkeys(m.group(1) for m in NAME.finditer(path.read_text(encoding="utf-8"))):
            found.setdefault(name, []).append(where)
    return found


def documented_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])


def test_the_scan_finds_the_settings_it_must():
    """The scan itself works: it finds a read of each kind (else the test below could pass on nothing)."""
    read = names_read()
    assert {"DJANGO_SECRET_KEY", "DJANGO_DEBUG", "CELERY_TASK_ALWAYS_EAGER", "UGENT_CONFIG", "UGENT_LOG_LEVEL",
            "UGENT_PLUGIN_BACKOFF_MAX_SECS", "UGENT_PLUGIN_RETRY_BACKOFF_MAX_SECS",
            "UGENT_EXTRA_ENGINES", "UGENT_EXTRA_SUMMARIZERS",  # read through registry._env_classes
            "UGENT_BENCH_REDIS"} <= set(read)  # bench/
    assert "bench/events_fanout.py" in read["UGENT_BENCH_REDIS"]
    assert len(read) > 100


def test_every_setting_read_from_the_environment_is_documented():
    text = documented_text()
    missing = [f"{name} (read in {', '.join(where)})" for name, where in sorted(names_read().items())
               if not re.search(rf"(?<![A-Z0-9_]){name}(?![A-Z0-9_])", text)]
    assert not missing, "documented nowhere (README.md's Configuration table or docs/):\n" + "\n".join(missing)


def test_the_readme_table_names_the_settings_that_were_documented_nowhere():
    table = (ROOT / "README.md").read_text(encoding="utf-8").split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1) for line in table.splitlines() if line.startswith("| `")
            for m in re.finditer(r"`((?:UGENT|DJANGO|CELERY)_[A-Z0-9_]+)`", line.split("|")[1])}
    assert {"DJANGO_DEBUG", "CELERY_TASK_ALWAYS_EAGER", "UGENT_PLUGIN_BACKOFF_MAX_SECS",
            "UGENT_PLUGIN_RETRY_BACKOFF_MAX_SECS", "UGENT_HOME", "UGENT_GLOBAL_PLUGINS_TOML"} <= rows
