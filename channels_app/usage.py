"""What callers and their keys have used: the turns folded into running totals (`Usage`), so the admin's
caller and key lists read a row per caller and key, and the few turns since the last fold, not every turn
ever run (a sum over every turn at each page load grew with the hub's whole history).

`usage_rollup` (beat, every UGENT_USAGE_ROLLUP_SECS) folds the turns after the mark
(`EventLogMark.USAGE_ROLLED_THROUGH`) in id order, moving the mark with the totals under its row lock, and
stops at the first turn
still live (its usage is written at its end) or younger than UGENT_USAGE_ROLLUP_MARGIN_SECS: on PostgreSQL a
turn's id is handed out before its transaction commits, so a younger id may be seen while an older one is
still to appear; the margin outlasts any accept. Every turn at or below the mark is in the totals once;
`usage_for` adds those after it, read by id from the mark: what a page shows is every turn's usage, exactly
what summing every turn would give."""
from __future__ import annotations

from collections import defaultdict
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from channels_app.models import LIVE_TURN_STATES, Caller, EventLogMark, Turn, Usage

#: Turns read a transaction at a time by the rollup (short: in embedded mode a transaction holds the one writer).
ROLLUP_CHUNK = 5_000
USAGE_ROLLUP_TASK_NAME = "ugent-usage-rollup"
FIELDS = ("turns", "prompt_tokens", "completion_tokens", "total_tokens")


def usage_mark() -> int:
    """The last turn id folded into the totals (0: none yet)."""
    return EventLogMark.objects.filter(name=EventLogMark.USAGE_ROLLED_THROUGH).values_list(
        "value", flat=True).first() or 0


def usage_rollup(*, now=None, chunk: int = ROLLUP_CHUNK) -> int:
    """Fold the turns after the mark into the totals, up to the first live or young one; how many were folded.

    Each chunk is read before its transaction and written in a short one (one upsert of the totals, which
    SQLite sends 124 rows a statement: in embedded mode a transaction holds the one writer), which folds it only
    if the mark has not moved since the read (another rollup's chunk: then it reads again). A caller deleted
    meanwhile is passed over; one deleted in the instant before the write fails it, and the chunk is read
    again."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.UGENT_USAGE_ROLLUP_MARGIN_SECS)
    folded, failed = 0, 0
    while True:
        mark = usage_mark()
        rows = list(Turn.objects.filter(id__gt=mark).order_by("id").values_list(
            "id", "state", "created_at", "caller_id", "api_key_id", "prompt_tokens", "completion_tokens",
            "total_tokens")[:chunk])
        taken = []
        for row in rows:
            if row[1] in LIVE_TURN_STATES or row[2] >= cutoff:
                break
            taken.append(row)
        if not taken:
            return folded
        sums: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        for _id, _state, _created, caller_id, key_id, prompt, completion, total in taken:
            if caller_id is None:  # its caller was deleted: no list shows it
                continue
            add = sums[(caller_id, key_id or 0)]
            add[0] += 1
            add[1] += prompt or 0
            add[2] += completion or 0
            add[3] += total or 0
        try:
            with transaction.atomic():
                mark_row, _ = EventLogMark.objects.select_for_update().get_or_create(
                    name=EventLogMark.USAGE_ROLLED_THROUGH)
                if mark_row.value != mark:
                    continue  # another rollup folded a chunk meanwhile: read again from its mark
                _fold(sums, mark_row=mark_row, through=taken[-1][0])
        except IntegrityError:  # a caller deleted between the check and the write: nothing was written
            failed += 1
            if failed > 3:
                raise
            continue
        failed = 0
        folded += len(taken)
        if len(taken) < len(rows) or len(rows) < chunk:
            return folded


def _fold(sums: dict[tuple[int, int], list[int]], *, mark_row: EventLogMark, through: int) -> None:
    """Add `sums` to the totals and move the mark to `through`, inside the caller's transaction."""
    alive = set(Caller.objects.filter(pk__in={caller_id for caller_id, _key in sums}).values_list("pk", flat=True))
    had = {(u.caller_id, u.key_id): u for u in Usage.objects.filter(caller_id__in=alive)}
    stamp = timezone.now()
    totals = []
    for (caller_id, key_id), add in sorted(sums.items()):
        if caller_id not in alive:  # deleted since its turns were read: no list shows it
            continue
        old = had.get((caller_id, key_id))
        figures = {f: (getattr(old, f) if old else 0) + n for f, n in zip(FIELDS, add)}
        totals.append(Usage(caller_id=caller_id, key_id=key_id, created_at=stamp, updated_at=stamp, **figures))
    Usage.objects.bulk_create(totals, update_conflicts=True, unique_fields=["caller", "key_id"],
                              update_fields=[*FIELDS, "updated_at"])
    mark_row.value = through
    mark_row.save(update_fields=["value", "updated_at"])


def usage_for(*, caller_ids=(), key_ids=()) -> tuple[dict[int, dict], dict[int, dict]]:
    """Every turn's usage summed per caller (of `caller_ids`) and per admin-issued key (of `key_ids`): the
    folded totals, and the turns after the mark read by id. The mark is read before and after the totals, and
    all is read again if a rollup moved it between the two: its turns would be in the totals and after the
    mark read first, counted twice."""
    def totals():
        rows = Usage.objects.none()
        if caller_ids:
            rows = rows | Usage.objects.filter(caller_id__in=list(caller_ids))
        if key_ids:
            rows = rows | Usage.objects.filter(key_id__in=list(key_ids))
        return [(u.caller_id, u.key_id, {f: getattr(u, f) for f in FIELDS}) for u in rows]
    for _attempt in range(10):
        mark = usage_mark()
        folded = totals()
        if usage_mark() == mark:
            break
    else:  # rollups folding chunk after chunk (the first fold after an upgrade): read under the mark's lock
        with transaction.atomic():
            mark = EventLogMark.objects.select_for_update().filter(
                name=EventLogMark.USAGE_ROLLED_THROUGH).values_list("value", flat=True).first() or 0
            folded = totals()
    by_caller: dict[int, dict] = {pk: dict.fromkeys(FIELDS, 0) for pk in caller_ids}
    by_key: dict[int, dict] = {pk: dict.fromkeys(FIELDS, 0) for pk in key_ids}
    # the turns since the mark, summed here: a GROUP BY made SQLite walk every turn through the caller's index
    # for its order, where the id range reads only these. A rollup that folds some of them once the totals were
    # read leaves them after this mark: each is counted once.
    recent = Turn.objects.filter(id__gt=mark).order_by().values_list(
        "caller_id", "api_key_id", "prompt_tokens", "completion_tokens", "total_tokens")
    rows = folded + [(caller_id, key_id or 0, {"turns": 1, "prompt_tokens": prompt or 0,
                                               "completion_tokens": completion or 0, "total_tokens": total or 0})
                     for caller_id, key_id, prompt, completion, total in recent.iterator(chunk_size=2000)
                     if caller_id is not None]
    for caller_id, key_id, figures in rows:
        for target in (by_caller.get(caller_id), by_key.get(key_id) if key_id else None):
            if target is not None:
                for f in FIELDS:
                    target[f] += figures[f]
    return by_caller, by_key


def usage_rollup_schedule_ensure() -> None:
    """Create or update the beat entry that runs the rollup (django-celery-beat)."""
    from ugent_common.tasks import beat_every
    beat_every(USAGE_ROLLUP_TASK_NAME, "channels_app.tasks.rollup_usage", settings.UGENT_USAGE_ROLLUP_SECS,
               "Folds ended turns into each caller's and key's usage totals.")
