"""Five-field crontab expressions: parsing, and the slot a firing belongs to.

The fields mean what Celery's `crontab` makes of them (minute hour day-of-month
month day-of-week, 0 = Sunday), because beat fires them: in particular a
day-of-month and a day-of-week both given must both match.
"""
from __future__ import annotations

from datetime import date, datetime, timedelta, timezone as dt_timezone
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery.schedules import crontab


class ScheduleError(ValueError):
    pass


FIELDS = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")


def split_schedule(expr: str) -> dict[str, str]:
    parts = (expr or "").split()
    if len(parts) != 5:
        raise ScheduleError(f"schedule '{expr}' is not a five-field crontab expression "
                            "(minute hour day-of-month month day-of-week)")
    return dict(zip(FIELDS, parts))


def parse_schedule(expr: str) -> crontab:
    fields = split_schedule(expr)
    try:
        c = crontab(**fields)
    except Exception as exc:
        raise ScheduleError(f"schedule '{expr}' is not a valid crontab expression: {exc}") from None
    if not (c.minute and c.hour and c.day_of_month and c.month_of_year and c.day_of_week):
        raise ScheduleError(f"schedule '{expr}' never fires")
    return c


def parse_timezone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(f"timezone '{name}' is not a known IANA time zone") from None


def _day_matches(c: crontab, day: date) -> bool:
    return (day.month in c.month_of_year and day.day in c.day_of_month
            and day.isoweekday() % 7 in c.day_of_week)


def slot_at_or_before(expr: str, tz_name: str, now: datetime) -> datetime | None:
    """The latest time the schedule fires at that is not after `now` (UTC, whole minute)."""
    c = parse_schedule(expr)
    tz = parse_timezone(tz_name)
    local = now.astimezone(tz).replace(second=0, microsecond=0)
    day = local.date()
    hours = sorted(c.hour, reverse=True)
    minutes = sorted(c.minute, reverse=True)
    for _ in range(366 * 8):  # a Feb 29 on a given weekday can be years away
        if _day_matches(c, day):
            today = day == local.date()
            for h in hours:
                if today and h > local.hour:
                    continue
                for m in minutes:
                    if today and h == local.hour and m > local.minute:
                        continue
                    return datetime(day.year, day.month, day.day, h, m, tzinfo=tz).astimezone(dt_timezone.utc)
        day -= timedelta(days=1)
    return None


def slot_after(expr: str, tz_name: str, now: datetime) -> datetime | None:
    """The first time the schedule fires at that is after `now` (UTC, whole minute): its next run."""
    c = parse_schedule(expr)
    tz = parse_timezone(tz_name)
    local = now.astimezone(tz).replace(second=0, microsecond=0)
    day = local.date()
    hours = sorted(c.hour)
    minutes = sorted(c.minute)
    for _ in range(366 * 8):
        if _day_matches(c, day):
            today = day == local.date()
            for h in hours:
                if today and h < local.hour:
                    continue
                for m in minutes:
                    if today and h == local.hour and m <= local.minute:
                        continue
                    return datetime(day.year, day.month, day.day, h, m, tzinfo=tz).astimezone(dt_timezone.utc)
        day += timedelta(days=1)
    return None
