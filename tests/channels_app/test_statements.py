"""channels_app.statements: each named raw statement reads what its ORM equivalent reads.

Every public function of the module is run against the same rows as the ORM query it stands for,
on whichever database the run uses (SQLite embedded, PostgreSQL in servers mode). A function
without a pin here fails `test_every_statement_has_a_pin`; f-string SQL written anywhere else in
the apps fails `test_no_raw_sql_outside_rows_and_statements`.
"""
from __future__ import annotations

import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest
from django.db import connection, connections, transaction
from django.db.models import Max
from django.test.utils import CaptureQueriesContext

from channels_app import statements
from ugent_common import rows
from channels_app.models import (Actor, ApiKey, Caller, Conversation, Event, Message, Receipt, Steering,
                                 SteeringState, Turn, TurnState, hash_key)
from plugins_app.agent.models import AgentProfile

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def graph():
    """Two conversations with receipts, turns, messages (visible, hidden, summaries), steering and events."""
    caller = Caller.objects.create(name="st-caller", role="operator", issuers=["https://idp.example"])
    actor = Actor.objects.create(key="web:st-user", user_id="st-user", caller=caller)
    profile = AgentProfile.objects.create(name="st-model", provider="ugent-notes", config={"k": [1, 2]})
    convs, turns = [], []
    for c in range(2):
        conv = Conversation.objects.create(external_id=f"st-conv-{c}", owner=actor, caller=caller)
        convs.append(conv)
        for n in range(4):
            receipt = Receipt.objects.create(conversation=conv, client_message_id=f"m{c}-{n}", content_hash="h",
                                             actor=actor)
            turn = Turn.objects.create(turn_id=f"st-{c}-{n}", conversation=conv, actor=actor, receipt=receipt,
                                       profile=profile if n % 2 == 0 else None, context={"text": f"q{n}"},
                                       state=TurnState.RUNNING if n == 3 else TurnState.COMPLETED,
                                       cancel_requested=n == 1)
            turns.append(turn)
            Message.objects.create(conversation=conv, turn=turn, role=Message.Role.USER, content=f"q{c}{n}",
                                   actor=actor, hidden=n == 0)
            Message.objects.create(conversation=conv, turn=turn, role=Message.Role.ASSISTANT, content=f"a{c}{n}")
            if n == 1:
                Message.objects.create(conversation=conv, role=Message.Role.SYSTEM, content=f"summary {c} old")
                Message.objects.create(conversation=conv, role=Message.Role.SYSTEM, content=f"summary {c}")
                Message.objects.create(conversation=conv, role=Message.Role.SYSTEM, content="hidden", hidden=True)
            for e in range(3):
                Event.objects.create(conversation=conv, turn=turn, type=f"turn.e{e}", data={"n": n, "e": [e, "é"]})
        Steering.objects.create(turn=turns[-1], actor=actor, text="steer")
        Steering.objects.create(turn=turns[-2], actor=actor, text="done", state=SteeringState.APPLIED)
    return {"caller": caller, "actor": actor, "profile": profile, "convs": convs, "turns": turns}


# --- the pins, one per statement ---------------------------------------------------------------

def pin_receipt_exists(g):
    for conv in g["convs"]:
        for cmid in ("m0-1", "m1-2", "nope", ""):
            assert statements.receipt_exists(conv.pk, cmid) == \
                Receipt.objects.filter(conversation_id=conv.pk, client_message_id=cmid).exists()
    assert statements.receipt_exists(g["convs"][0].pk, "m0-1") and not statements.receipt_exists(g["convs"][0].pk,
                                                                                                   "m1-1")


def pin_turn_state(g):
    for turn in g["turns"]:
        assert statements.turn_state(turn.pk) == Turn.objects.get(pk=turn.pk).state
    assert statements.turn_state(10 ** 9) is None


def pin_turn_stop_check(g):
    for turn in g["turns"]:
        orm = Turn.objects.get(pk=turn.pk)
        waits = Steering.objects.filter(turn_id=turn.pk, state=SteeringState.PENDING).exists()
        assert statements.turn_stop_check(turn.pk) == (orm.cancel_requested, orm.state, waits)
    assert any(statements.turn_stop_check(t.pk)[2] for t in g["turns"])
    assert statements.turn_stop_check(10 ** 9) is None


def pin_steering_pending(g):
    for turn in g["turns"]:
        assert statements.steering_pending(turn.pk) == \
            Steering.objects.filter(turn_id=turn.pk, state=SteeringState.PENDING).exists()


def pin_turn_fetch(g):
    for turn in g["turns"]:
        got = statements.turn_fetch(turn.pk)
        orm = Turn.objects.select_related("conversation", "actor", "profile").get(pk=turn.pk)
        for name in statements._TURN_COLUMNS:
            assert getattr(got, name) == getattr(orm, name), name
        for name in statements._CONVERSATION_COLUMNS:
            assert getattr(got.conversation, name) == getattr(orm.conversation, name), name
        for name in statements._ACTOR_COLUMNS:
            assert getattr(got.actor, name) == getattr(orm.actor, name), name
        if orm.profile is None:
            assert got.profile is None
        else:
            assert {f.attname: getattr(got.profile, f.attname) for f in AgentProfile._meta.concrete_fields} == \
                {f.attname: getattr(orm.profile, f.attname) for f in AgentProfile._meta.concrete_fields}
        assert got.pending_steering == orm.steerings.filter(state=SteeringState.PENDING).exists()
    with pytest.raises(Turn.DoesNotExist):
        statements.turn_fetch(10 ** 9)


def pin_history_tail(g):
    for turn in g["turns"]:
        for limit in (1, 2, 5, 50):
            orm = list(Message.objects.filter(conversation_id=turn.conversation_id, hidden=False,
                                              role__in=[Message.Role.USER, Message.Role.ASSISTANT],
                                              turn_id__lt=turn.pk).order_by("-id")
                       .values_list("role", "content")[:limit])
            orm.reverse()
            assert statements.history_tail(turn.conversation_id, turn.pk, limit) == orm
    assert statements.history_tail(g["turns"][3].conversation_id, g["turns"][3].pk, 50)  # not vacuous


def pin_summary_latest(g):
    for conv in g["convs"]:
        orm = (Message.objects.filter(conversation_id=conv.pk, hidden=False, role=Message.Role.SYSTEM)
               .order_by("-id").values_list("content", flat=True).first())
        assert statements.summary_latest(conv.pk) == orm
    assert statements.summary_latest(g["convs"][1].pk) == "summary 1"
    assert statements.summary_latest(10 ** 9) is None


def pin_turn_history_step(g):
    """The turn named by id alone: its conversation's history, its profile's history_turns (the default
    without a profile), as history_tail reads it once the turn is known."""
    from plugins_app.agent.models import AgentProfile
    for history_turns, default in ((3, 2), (0, 4)):
        AgentProfile.objects.filter(pk=g["profile"].pk).update(history_turns=history_turns)
        for turn in g["turns"]:
            limit = history_turns if turn.profile_id else default
            assert rows.batch([statements.turn_history_step(turn.pk, default)]) == \
                [statements.history_tail(turn.conversation_id, turn.pk, limit)]
    last = g["turns"][3]  # no profile, five visible messages before it: the default is its limit
    assert last.profile_id is None and len(statements.history_tail(last.conversation_id, last.pk, 50)) == 5
    assert len(rows.batch([statements.turn_history_step(last.pk, 2)])[0]) == 2
    with_profile = g["turns"][2]  # its profile's history_turns is 0 now: nothing
    assert with_profile.profile_id and rows.batch([statements.turn_history_step(with_profile.pk, 20)]) == [[]]
    assert rows.batch([statements.turn_history_step(10 ** 9, 5)]) == [[]]


def pin_turn_summary_step(g):
    for turn in g["turns"]:
        assert rows.batch([statements.turn_summary_step(turn.pk)]) == [statements.summary_latest(turn.conversation_id)]
    assert rows.batch([statements.turn_summary_step(g["turns"][5].pk)]) == ["summary 1"]
    assert rows.batch([statements.turn_summary_step(10 ** 9)]) == [None]


def pin_harness_open_exists(g):
    from channels_app.models import HarnessItem, HarnessState
    conv0, conv1 = g["convs"]
    HarnessItem.objects.create(conversation=conv0, kind="goal", text="no check", check_spec="")
    HarnessItem.objects.create(conversation=conv1, kind="goal", text="done", check_spec="phrase:x", state=HarnessState.DONE)
    for conv in g["convs"]:
        assert statements.harness_open_exists(conv.pk) == HarnessItem.objects.filter(
            conversation_id=conv.pk, state=HarnessState.OPEN).exclude(check_spec="").exists()
    assert not statements.harness_open_exists(conv0.pk)
    HarnessItem.objects.create(conversation=conv0, kind="task", text="open", check_spec="phrase:x")
    assert statements.harness_open_exists(conv0.pk) and not statements.harness_open_exists(conv1.pk)
    # as steps of one batch (the end of a turn sends it with the turn's lock)
    assert rows.batch([statements.harness_open_step(conv0.pk), statements.harness_open_step(conv1.pk)]) == [True, False]


pin_harness_open_step = pin_harness_open_exists


def pin_turn_events_after(g):
    for turn in g["turns"]:
        ids = list(Event.objects.filter(turn_id=turn.pk).order_by("id").values_list("id", flat=True))
        for cursor in (0, ids[0], ids[-1]):
            orm = [(e.pk, e.type, e.data) for e in Event.objects.filter(turn_id=turn.pk, id__gt=cursor).order_by("id")]
            assert statements.turn_events_after(turn.pk, cursor) == orm
    assert statements.turn_events_after(g["turns"][0].pk, 0)[0][2] == {"n": 0, "e": [0, "é"]}


def pin_event_id_before(g):
    for turn in g["turns"]:
        ids = list(Event.objects.filter(turn_id=turn.pk).values_list("id", flat=True))
        for first in (ids[0], ids[-1], ids[-1] + 1000):
            orm = Event.objects.filter(turn_id=turn.pk, id__lt=first).aggregate(m=Max("id"))["m"] or 0
            assert statements.event_id_before(turn.pk, first) == orm
    assert statements.event_id_before(g["turns"][0].pk, 10 ** 9) > 0


def pin_caller_for_key_hash(g):
    caller = g["caller"]
    ApiKey.objects.create(caller=caller, key_hash=hash_key("sk-live"), prefix="sk-live")
    ApiKey.objects.create(caller=caller, key_hash=hash_key("sk-off"), prefix="sk-off", active=False)
    for raw in ("sk-live", "sk-off", "sk-none"):
        key = ApiKey.objects.select_related("caller").filter(key_hash=hash_key(raw), active=True).first()
        got = statements.caller_for_key_hash(hash_key(raw))
        if key is None:
            assert got is None
            continue
        key_id, got_caller = got
        assert key_id == key.pk
        assert {f.attname: getattr(got_caller, f.attname) for f in Caller._meta.concrete_fields} == \
            {f.attname: getattr(key.caller, f.attname) for f in Caller._meta.concrete_fields}
    assert statements.caller_for_key_hash(hash_key("sk-live")) is not None


def pin_database_ping(g):
    with CaptureQueriesContext(connection) as seen:
        assert statements.database_ping() is None
    assert [q["sql"] for q in seen.captured_queries] == ["SELECT 1"]


def _other_connection():
    other = connections.create_connection("default")
    other.ensure_connection()
    return other


def pin_turn_lock(g):
    """PostgreSQL: as `select_for_update(no_key=True)`: FOR UPDATE from elsewhere waits, an append's
    KEY SHARE does not. SQLite: nothing (the IMMEDIATE transaction already holds the write lock)."""
    turn = g["turns"][0]
    if connection.vendor != "postgresql":
        with CaptureQueriesContext(connection) as seen, transaction.atomic():
            statements.turn_lock(turn.pk)
        assert not [q for q in seen.captured_queries if "SELECT" in q["sql"]]
        return
    other = _other_connection()
    try:
        with transaction.atomic():
            statements.turn_lock(turn.pk)
            with other.cursor() as cur:
                cur.execute(f"SELECT id FROM {Turn._meta.db_table} WHERE id = %s FOR KEY SHARE NOWAIT", [turn.pk])
                with pytest.raises(Exception, match="lock"):
                    cur.execute(f"SELECT id FROM {Turn._meta.db_table} WHERE id = %s FOR UPDATE NOWAIT", [turn.pk])
    finally:
        other.close()


def pin_event_log_lock(g):
    """PostgreSQL: as `pg_advisory_xact_lock(EVENT_LOG_LOCK)`: held until the transaction ends."""
    if connection.vendor != "postgresql":
        with CaptureQueriesContext(connection) as seen, transaction.atomic():
            statements.event_log_lock()
        assert not [q for q in seen.captured_queries if "SELECT" in q["sql"]]
        return
    other = _other_connection()
    try:
        with other.cursor() as cur:
            with transaction.atomic():
                statements.event_log_lock()
                cur.execute("SELECT pg_try_advisory_lock(%s)", [statements.EVENT_LOG_LOCK])
                assert cur.fetchone()[0] is False
            cur.execute("SELECT pg_try_advisory_lock(%s)", [statements.EVENT_LOG_LOCK])
            assert cur.fetchone()[0] is True
            cur.execute("SELECT pg_advisory_unlock(%s)", [statements.EVENT_LOG_LOCK])
    finally:
        other.close()


# --- steps: the same statements sent together (rows.batch: one round trip on PostgreSQL) -------------

def _steps_read_what_the_functions_read(g):
    """Every read step of a turn in one batch reads what each function (pinned above) reads alone."""
    from ugent_common import rows
    for turn in g["turns"]:
        with CaptureQueriesContext(connection) as seen:
            state, waits, fetched, past, skipped, summary, latest = rows.batch([
                statements.turn_state_step(turn.pk), statements.steering_pending_step(turn.pk),
                statements.turn_fetch_step(turn.pk), statements.history_tail_step(turn.conversation_id, turn.pk, 5),
                None, statements.summary_latest_step(turn.conversation_id), statements.turn_event_latest_step(turn.pk)])
        assert skipped is None
        if connection.vendor == "postgresql":
            assert len(seen.captured_queries) == 1  # one round trip
        assert state == statements.turn_state(turn.pk)
        assert waits == statements.steering_pending(turn.pk)
        assert fetched.pk == statements.turn_fetch(turn.pk).pk and fetched.pending_steering == waits
        assert past == statements.history_tail(turn.conversation_id, turn.pk, 5)
        assert summary == statements.summary_latest(turn.conversation_id)
        assert latest == Event.objects.filter(turn_id=turn.pk).aggregate(m=Max("id"))["m"]
    missing = 10 ** 9
    assert rows.batch([statements.turn_state_step(missing), statements.turn_fetch_step(missing),
                       statements.turn_event_latest_step(missing), None]) == [None, None, 0, None]


pin_turn_state_step = pin_steering_pending_step = pin_turn_fetch_step = _steps_read_what_the_functions_read
pin_history_tail_step = pin_summary_latest_step = pin_turn_event_latest_step = _steps_read_what_the_functions_read


def pin_conversation_event_head_step(g):
    """The conversation's newest event and the fields a stream's rows carry, as the ORM reads them."""
    from channels_app.models import Conversation
    from ugent_common import rows
    for turn in g["turns"]:
        conv = Conversation.objects.get(pk=turn.conversation_id)
        for turn_pk, turn_id in ((turn.pk, turn.turn_id), (None, None)):
            (head,) = rows.batch([statements.conversation_event_head_step(conv.pk, turn_pk)])
            newest = Event.objects.filter(conversation_id=conv.pk).aggregate(m=Max("id"))["m"] or 0
            assert head == (newest, conv.external_id, conv.client_id, conv.channel, conv.owner_id, turn_id)
    assert rows.batch([statements.conversation_event_head_step(10 ** 9, None)]) == [None]


def _locking_steps(g):
    """The turn's row lock and the log's lock taken in one batch hold as the functions' do."""
    from ugent_common import rows
    turn = g["turns"][0]
    if connection.vendor != "postgresql":
        assert statements.turn_lock_step(turn.pk) is None and statements.event_log_lock_step() is None
        return
    other = _other_connection()
    try:
        with other.cursor() as cur:
            with transaction.atomic():
                rows.batch([statements.turn_lock_step(turn.pk), statements.event_log_lock_step()])
                cur.execute("SELECT pg_try_advisory_lock(%s)", [statements.EVENT_LOG_LOCK])
                assert cur.fetchone()[0] is False
                with pytest.raises(Exception, match="lock"):
                    cur.execute(f"SELECT id FROM {Turn._meta.db_table} WHERE id = %s FOR UPDATE NOWAIT", [turn.pk])
    finally:
        other.close()


pin_turn_lock_step = pin_event_log_lock_step = _locking_steps


def pin_receipt_running_step(g):
    """The receipt of a turn claimed at a time is marked running as the ORM's update by its id would; a turn
    not running, or claimed at another time, changes no receipt."""
    from datetime import timedelta

    from django.utils import timezone

    from channels_app.models import ReceiptState
    from ugent_common import rows
    now = timezone.now().replace(microsecond=123456)
    running, done = g["turns"][3], g["turns"][0]
    Turn.objects.filter(pk=running.pk).update(started_at=now)
    others = dict(Receipt.objects.exclude(pk=running.receipt_id).values_list("id", "updated_at"))
    assert rows.batch([statements.receipt_running_step(running.pk, now - timedelta(seconds=1))]) == [0]
    assert rows.batch([statements.receipt_running_step(done.pk, now)]) == [0]
    assert rows.batch([statements.receipt_running_step(running.pk, now)]) == [1]
    receipt = Receipt.objects.get(pk=running.receipt_id)
    assert (receipt.state, receipt.started_at) == (ReceiptState.RUNNING, now)
    assert dict(Receipt.objects.exclude(pk=running.receipt_id).values_list("id", "updated_at")) == others


def _commit_durability(g):
    """PostgreSQL: commit_unflushed_step turns synchronous_commit off for its transaction only, and
    commit_flushed back on; SQLite: neither sends anything."""
    from ugent_common import rows
    if connection.vendor != "postgresql":
        with CaptureQueriesContext(connection) as seen, transaction.atomic():
            assert statements.commit_unflushed_step() is None
            statements.commit_flushed()
        assert not [q for q in seen.captured_queries if "synchronous_commit" in q["sql"]]
        return

    def setting():
        with connection.cursor() as cur:
            cur.execute("SHOW synchronous_commit")
            return cur.fetchone()[0]
    before = setting()
    with transaction.atomic():
        rows.batch([statements.commit_unflushed_step()])
        assert setting() == "off"
        statements.commit_flushed()
        assert setting() == "on"
    with transaction.atomic():
        rows.batch([statements.commit_unflushed_step()])
    assert setting() == before  # SET LOCAL: the next transaction is as before


pin_commit_unflushed_step = pin_commit_flushed = _commit_durability


PINS = {name[len("pin_"):]: fn for name, fn in dict(globals()).items() if name.startswith("pin_")}
# need committed rows another connection can see, or transactions of their own
_LOCKING = {"turn_lock", "event_log_lock", "turn_lock_step", "event_log_lock_step", "commit_unflushed_step",
            "commit_flushed"}


@pytest.mark.django_db
@pytest.mark.parametrize("name", sorted(set(PINS) - _LOCKING))
def test_statement_reads_what_the_orm_reads(name, graph):
    PINS[name](graph)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", sorted(_LOCKING))
def test_locking_statement_locks_what_the_orm_locks(name, graph):
    PINS[name](graph)


def test_every_statement_has_a_pin():
    public = {name for name, fn in inspect.getmembers(statements, inspect.isfunction)
              if fn.__module__ == statements.__name__ and not name.startswith("_")}
    assert public == set(PINS), f"without a pin: {sorted(public - set(PINS))}; stale pins: {sorted(set(PINS) - public)}"


# --- no f-string SQL elsewhere -----------------------------------------------------------------

APPS = ("channels_app", "rules_app", "plugins_app", "cron_app", "ugent_site", "ugent_common")
# Where statements may be written: the builder, the hub's statements, and the channel SDK's own
# SQLite outbox (it runs in the worker process, on its own file, without Django).
# The workers' own files are separate SQLite databases beside their outboxes (no Django in a worker),
# never the daemon's: their statements stay with them, parameterised.
ALLOWED = {"ugent_common/rows.py", "channels_app/statements.py",
           "plugins_app/channel/sdk/outbox.py", "plugins_app/channel/workers/email/state.py",
           # the sent-parts journal (Telegram, WhatsApp, LINE): a SQLite file of the worker's own
           "plugins_app/channel/sdk/journal.py",
           # WeCom's uploaded media ids and sent cards; Salesforce's replay id: SQLite files of those workers' own
           "plugins_app/channel/workers/wecom/state.py", "plugins_app/channel/workers/salesforce/cometd.py",
           # memory's full-text search: FTS5's MATCH and its vocabulary, PostgreSQL's tsquery, which the ORM cannot say
           "plugins_app/agent/memory/backends.py",
           # the memory report's read of SQLite's cache_size pragma (a debug hook, off by default)
           "ugent_site/memstats.py",
           # PostgreSQL's session advisory lock, which the ORM cannot take
           "ugent_common/dblock.py",
           # the migrations' CREATE INDEX CONCURRENTLY on PostgreSQL, which a schema editor cannot say
           "ugent_common/migration_ops.py"}
_SQL_IN_FSTRING = re.compile(r"\b(SELECT|INSERT INTO|DELETE FROM)\b|\bUPDATE\s+\{|\b(FROM|JOIN|WHERE|ORDER BY|"
                             r"GROUP BY|SET|AND|OR)\s+\{|\{[^}]*\}\s+(WHERE|SET|FROM|JOIN|ORDER BY)\b")
_RAW_CALL = re.compile(r"\brows\.(fetchone|fetchall|_run)\(|\.execute\(\s*[rfbRFB]*[\"']")


def raw_sql_in(source: str) -> list[str]:
    """The f-strings that build SQL, and the raw statement calls, in one module's source."""
    found = [m.group(0) for m in _RAW_CALL.finditer(source)]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING:
            prefix = re.match(r"[A-Za-z]*", tok.string).group(0).lower()
            if "f" in prefix and _SQL_IN_FSTRING.search(tok.string):
                found.append(tok.string)
    return found


def test_the_detector_finds_fstring_sql_and_raw_calls():
    planted = ('t = rows.table(Turn)\n'
               'sql = f"SELECT {t.col(\'state\')} FROM {t.name} WHERE id = %s"\n'
               'row = rows.fetchone(sql, [1])\n'
               'more = (f"SELECT 1 "\n        f"FROM {t.name}")\n'
               'cur.execute("SELECT 1")\n')
    assert len(raw_sql_in(planted)) == 5
    # Text for people is not SQL.
    assert raw_sql_in('msg = f"rule \'{name}\' from {where} (priority {p})"\npipe.execute()\n') == []


def test_no_raw_sql_outside_rows_and_statements():
    offenders = {}
    for app in APPS:
        for path in sorted((REPO / app).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in ALLOWED or "/migrations/" in rel:
                continue
            found = raw_sql_in(path.read_text())
            if found:
                offenders[rel] = found
    assert offenders == {}, "write statements in channels_app/statements.py (or use rows.Table's builders)"
