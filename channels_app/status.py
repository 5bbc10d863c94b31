"""GET /v1/ugent/status: what the daemon reports. Each room contributes its own section.

The sections are named in settings (`UGENT_STATUS_SECTIONS`: section → dotted path of a function
returning a dict), so the hub imports none of the rooms that report.
"""
from __future__ import annotations

from typing import Callable

from django.conf import settings
from django.utils.module_loading import import_string

_contributors: dict[str, Callable[[], dict]] = {}


def register(section: str, fn: Callable[[], dict]) -> None:
    """Add a section to the status report at run time, beside the ones settings name."""
    _contributors[section] = fn


def _sections() -> dict[str, Callable[[], dict]]:
    for section, path in getattr(settings, "UGENT_STATUS_SECTIONS", {}).items():
        if section not in _contributors:
            _contributors[section] = import_string(path)
    return _contributors


def status_report() -> dict:
    from channels_app.voice import voice_input_status
    report = {"mode": settings.UGENT_MODE,
              "media": {"voice": {
                  "input": voice_input_status(),
                  "output": {"available": False, "reason": "no_engine"},
                  "live": {"available": False, "reason": "no_engine"}}}}
    for section, fn in sorted(_sections().items()):
        try:
            report[section] = fn()
        except Exception as exc:  # one room's failure must not hide the rest
            report[section] = {"error": f"{type(exc).__name__}: {exc}"}
    return {"status": report}
