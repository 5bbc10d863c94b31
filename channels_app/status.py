"""GET /v1/ugent/status: what the daemon reports. Each room contributes its own section."""
from __future__ import annotations

from typing import Callable

from django.conf import settings

_contributors: dict[str, Callable[[], dict]] = {}


def register(section: str, fn: Callable[[], dict]) -> None:
    """Add a section to the status report (called from an app's ready())."""
    _contributors[section] = fn


def status_report() -> dict:
    report = {"mode": settings.UGENT_MODE,
              "media": {"voice": {
                  "input": {"available": False, "reason": "no_engine", "transcription": False,
                            "dictation": False, "native_models": []},
                  "output": {"available": False, "reason": "no_engine"},
                  "live": {"available": False, "reason": "no_engine"}}}}
    for section, fn in sorted(_contributors.items()):
        try:
            report[section] = fn()
        except Exception as exc:  # one room's failure must not hide the rest
            report[section] = {"error": f"{type(exc).__name__}: {exc}"}
    return {"status": report}
