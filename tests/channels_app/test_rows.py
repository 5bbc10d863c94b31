"""ugent_common.rows: the precompiled INSERT/UPDATE/SELECT of the turn path behave like the ORM.

Every check compares what `Table` wrote or read against the same row read (or written) through the
ORM, on whichever database the run uses (SQLite in embedded mode, PostgreSQL in servers mode).
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.db import connection
from django.utils import timezone

from ugent_common import rows
from channels_app.models import (Actor, Caller, Conversation, Event, Message, Receipt, ReceiptState, Turn,
                                 TurnState)
from ugent_common.rows import Table

pytestmark = pytest.mark.django_db


def _concrete(model):
    return [f for f in model._meta.concrete_fields]


def _as_db(obj):
    """Every concrete column of `obj` by attname, as a fresh ORM read of its row sees it."""
    fresh = type(obj).objects.get(pk=obj.pk)
    return {f.attname: getattr(fresh, f.attname) for f in _concrete(type(obj))}


def _attrs(obj):
    return {f.attname: getattr(obj, f.attname) for f in _concrete(type(obj))}


@pytest.fixture
def graph():
    """A caller, an actor, a conversation and a receipt made with the ORM."""
    caller = Caller.objects.create(name="rows-caller", role="operator")
    actor = Actor.objects.create(key="web:rows-user", user_id="rows-user", caller=caller)
    conv = Conversation.objects.create(external_id="rows-conv", owner=actor, caller=caller)
    receipt = Receipt.objects.create(conversation=conv, client_message_id="m1", content_hash="h1", actor=actor)
    return {"caller": caller, "actor": actor, "conv": conv, "receipt": receipt}


def _receipt(graph, n: str) -> Receipt:
    return Receipt.objects.create(conversation=graph["conv"], client_message_id=f"m-{n}", content_hash="h",
                                  actor=graph["actor"])


def _turn(graph, turn_id: str, **extra) -> Turn:
    return Turn.objects.create(turn_id=turn_id, conversation=graph["conv"], actor=graph["actor"],
                               receipt=_receipt(graph, turn_id), **extra)


# --- create / insert ---------------------------------------------------------------------------

def test_create_turn_fills_the_same_defaults_as_the_orm(graph):
    before = timezone.now()
    made = Table(Turn).create(turn_id="t-rows", conversation=graph["conv"], actor=graph["actor"],
                              receipt_id=graph["receipt"].pk, model="m-1",
                              context={"tags": ["a", "b"], "nested": {"n": 1, "ok": True}},
                              allowed_tools=["search"], include_thinking=True)
    after = timezone.now()
    orm = Turn.objects.create(turn_id="t-orm", conversation=graph["conv"], actor=graph["actor"],
                              receipt=_receipt(graph, "orm"), model="m-1",
                              context={"tags": ["a", "b"], "nested": {"n": 1, "ok": True}},
                              allowed_tools=["search"], include_thinking=True)

    stored = _as_db(made)
    # What create() returned is what the database holds.
    assert _attrs(made) == stored
    # Every column the two writes did not set differently matches the ORM's create.
    orm_stored = _as_db(orm)
    for name in set(stored) - {"id", "turn_id", "receipt_id", "created_at", "updated_at"}:
        assert stored[name] == orm_stored[name], name
    assert stored["state"] == TurnState.ACCEPTED
    assert stored["context"] == {"tags": ["a", "b"], "nested": {"n": 1, "ok": True}}
    assert isinstance(stored["citation_ids"], list) and stored["citation_ids"] == []
    assert stored["denied_tools"] is None and stored["profile_id"] is None
    assert stored["include_thinking"] is True and stored["cancel_requested"] is False
    assert stored["started_at"] is None and stored["finished_at"] is None
    for name in ("created_at", "updated_at"):
        assert timezone.is_aware(stored[name])
        assert before <= stored[name] <= after, name


def test_create_receipt_round_trips_json_lists_and_nullable_datetimes(graph):
    started = datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=dt_timezone.utc)
    citations = [{"id": "doc-1", "title": "Ünïcode", "score": 0.5}, {"id": "doc-2", "pages": [1, 2]}]
    made = Table(Receipt).create(conversation=graph["conv"], client_message_id="m-json", content_hash="x",
                                 actor_id=graph["actor"].pk, citations=citations, started_at=started)
    fresh = Receipt.objects.get(pk=made.pk)
    assert fresh.citations == citations
    assert fresh.files == [] and isinstance(fresh.files, list)
    assert fresh.state == ReceiptState.ACCEPTED and fresh.answer == "" and fresh.reason == ""
    assert fresh.started_at == started and fresh.finished_at is None
    assert fresh.conversation_id == graph["conv"].pk and fresh.actor_id == graph["actor"].pk
    assert _attrs(made) == _as_db(made)


def test_create_caller_defaults_and_booleans(db):
    made = Table(Caller).create(name="plain-app")
    fresh = Caller.objects.get(pk=made.pk)
    assert fresh.role == "application"
    assert fresh.issuers == [] and fresh.default_model == ""
    assert fresh.from_config is False
    flagged = Table(Caller).create(name="configured", from_config=True, issuers=["iss-1", "iss-2"])
    fresh = Caller.objects.get(pk=flagged.pk)
    assert fresh.from_config is True and fresh.issuers == ["iss-1", "iss-2"]


def test_created_instance_is_saved_state(graph):
    made = Table(Caller).create(name="saved-state", role="operator")
    assert isinstance(made.pk, int) and made.pk == made.id
    assert Caller.objects.filter(pk=made.pk, name="saved-state").exists()
    assert made._state.adding is False
    assert made._state.db == connection.alias
    # A model that thinks it is being added would find its own row a duplicate name.
    made.validate_unique()
    # Saving it again updates the row rather than inserting another one.
    made.default_model = "gpt-x"
    made.save()
    assert Caller.objects.filter(name="saved-state").count() == 1
    assert Caller.objects.get(pk=made.pk).default_model == "gpt-x"


def test_create_with_related_instance_keeps_it_cached(graph, django_assert_num_queries):
    conv, actor = graph["conv"], graph["actor"]
    made = Table(Message).create(conversation=conv, actor=actor, role=Message.Role.USER, content="hi")
    assert made.conversation_id == conv.pk and made.actor_id == actor.pk and made.turn_id is None
    with django_assert_num_queries(0):
        assert made.conversation is conv
        assert made.actor is actor
    fresh = Message.objects.get(pk=made.pk)
    assert (fresh.conversation_id, fresh.actor_id, fresh.role, fresh.content, fresh.hidden) == (
        conv.pk, actor.pk, "user", "hi", False)


def test_create_with_foreign_key_ids_loads_the_related_row(graph, django_assert_num_queries):
    actor = graph["actor"]
    made = Table(Conversation).create(external_id="by-id", owner_id=actor.pk, caller_id=None)
    fresh = Conversation.objects.get(pk=made.pk)
    assert fresh.owner_id == actor.pk and fresh.caller_id is None
    assert fresh.channel == "web" and fresh.client_id == "" and fresh.model_choice == ""
    with django_assert_num_queries(1):
        assert made.owner == actor
    assert made.caller is None


def test_create_event_without_updated_at(graph):
    turn = _turn(graph, "t-ev")
    before = timezone.now()
    made = Table(Event).create(conversation=graph["conv"], turn=turn, type="turn.started",
                               data={"k": [1, 2, {"x": None}]})
    fresh = Event.objects.get(pk=made.pk)
    assert fresh.turn_id == turn.pk and fresh.conversation_id == graph["conv"].pk
    assert fresh.data == {"k": [1, 2, {"x": None}]} and fresh.audience == []
    assert before <= fresh.created_at <= timezone.now()
    assert made.created_at == fresh.created_at
    assert made.turn is turn


def test_insert_returns_the_new_id_and_writes_defaults(graph):
    t = Table(Message)
    first = t.insert(conversation=graph["conv"], role=Message.Role.ASSISTANT, content="a")
    second = t.insert(conversation_id=graph["conv"].pk, role="user", content="b", hidden=True)
    assert isinstance(first, int) and second > first
    got = {m.pk: (m.role, m.content, m.hidden, m.actor_id) for m in Message.objects.all()}
    assert got == {first: ("assistant", "a", False, None), second: ("user", "b", True, None)}
    assert all(timezone.is_aware(m.created_at) for m in Message.objects.all())


def test_table_is_cached_per_model():
    assert rows.table(Turn) is rows.table(Turn)
    assert rows.table(Turn) is not rows.table(Receipt)
    assert rows.table(Turn).model is Turn


# --- update ------------------------------------------------------------------------------------

def test_update_only_touches_rows_matching_where(graph):
    one, two = _turn(graph, "t-1"), _turn(graph, "t-2")
    t = Table(Turn)
    finished = datetime(2024, 1, 2, 3, 4, 5, 600000, tzinfo=dt_timezone.utc)
    count = t.update({"id": one.pk}, state=TurnState.COMPLETED, context={"route": "x"}, finished_at=finished,
                     cancel_requested=True)
    assert count == 1
    one_after, two_after = Turn.objects.get(pk=one.pk), Turn.objects.get(pk=two.pk)
    assert one_after.state == "completed" and one_after.context == {"route": "x"}
    assert one_after.finished_at == finished and one_after.cancel_requested is True
    assert _attrs(two_after) == _attrs(two)


def test_update_returns_the_row_count(graph):
    conv = graph["conv"]
    for text in ("a", "b", "c"):
        Message.objects.create(conversation=conv, role="user", content=text)
    other = Conversation.objects.create(external_id="other", owner=graph["actor"])
    Message.objects.create(conversation=other, role="user", content="z")
    t = Table(Message)
    assert t.update({"conversation": conv.pk, "hidden": False}, hidden=True) == 3
    assert t.update({"conversation": conv.pk, "hidden": False}, hidden=True) == 0
    assert t.update({"id": 10 ** 9}, content="nobody") == 0
    assert sorted(Message.objects.filter(hidden=True).values_list("content", flat=True)) == ["a", "b", "c"]
    assert Message.objects.get(conversation=other).hidden is False


def test_update_state_guard_on_a_running_turn_changes_nothing(graph):
    turn = _turn(graph, "t-guard", state=TurnState.RUNNING)
    before = _as_db(turn)
    t = Table(Turn)
    assert t.update({"id": turn.pk, "state": TurnState.ACCEPTED}, state=TurnState.CANCELLED,
                    error="should not land") == 0
    assert _as_db(turn) == before
    assert t.update({"id": turn.pk, "state": "running"}, state=TurnState.COMPLETED) == 1
    assert Turn.objects.get(pk=turn.pk).state == "completed"


def test_update_bumps_updated_at(graph):
    turn = _turn(graph, "t-bump")
    old = timezone.now() - timedelta(days=3)
    Turn.objects.filter(pk=turn.pk).update(updated_at=old, created_at=old)
    before = timezone.now()
    assert Table(Turn).update({"id": turn.pk}, model="other") == 1
    fresh = Turn.objects.get(pk=turn.pk)
    assert fresh.model == "other"
    assert before <= fresh.updated_at <= timezone.now()
    assert fresh.created_at == old
    # An explicit updated_at is written as given.
    stamp = datetime(2023, 3, 4, 5, 6, 7, tzinfo=dt_timezone.utc)
    Table(Turn).update({"id": turn.pk}, updated_at=stamp)
    assert Turn.objects.get(pk=turn.pk).updated_at == stamp


def test_update_a_model_without_updated_at(graph):
    turn = _turn(graph, "t-evu")
    event = Event.objects.create(conversation=graph["conv"], turn=turn, type="a", data={})
    assert Table(Event).update({"id": event.pk}, data={"done": [1]}, audience=["web:x"]) == 1
    fresh = Event.objects.get(pk=event.pk)
    assert fresh.data == {"done": [1]} and fresh.audience == ["web:x"]
    assert fresh.created_at == event.created_at


# --- get / from_row / select_list ----------------------------------------------------------------

def test_get_returns_none_without_a_match(graph):
    assert Table(Turn).get(turn_id="nope") is None
    assert Table(Caller).get(name="rows-caller", role="application") is None


def test_get_returns_the_lowest_id_of_several_matches(graph):
    actor = graph["actor"]
    # Inserted so that neither the unique (channel, client_id, external_id) index order nor the
    # physical order after an update puts the lowest id first.
    made = [Conversation.objects.create(client_id="multi", external_id=x, owner=actor) for x in ("z", "y", "x")]
    Conversation.objects.filter(pk=made[0].pk).update(model_choice="moved")
    got = Table(Conversation).get(channel="web", client_id="multi")
    assert got is not None and got.pk == made[0].pk and got.external_id == "z"
    assert got.model_choice == "moved"
    assert Table(Conversation).get(client_id="multi", external_id="x").pk == made[2].pk
    assert Table(Conversation).get(pk=made[1].pk).external_id == "y"
    assert Table(Conversation).get(id=made[1].pk).external_id == "y"


def test_get_decodes_json_booleans_and_aware_datetimes(graph):
    started = datetime(2024, 2, 3, 4, 5, 6, 789000, tzinfo=dt_timezone.utc)
    turn = _turn(graph, "t-get", state=TurnState.RUNNING, context={"tags": ["r"], "deep": {"a": [1, None]}},
                 citation_ids=["c1", "c2"], allowed_tools=None, denied_tools=["shell"],
                 include_thinking=True, started_at=started)
    got = Table(Turn).get(turn_id="t-get")
    assert isinstance(got, Turn) and got.pk == turn.pk
    assert got._state.adding is False and got._state.db == connection.alias
    assert got.get_deferred_fields() == set()
    assert got.context == {"tags": ["r"], "deep": {"a": [1, None]}}
    assert got.citation_ids == ["c1", "c2"]
    assert got.allowed_tools is None and got.denied_tools == ["shell"]
    assert got.include_thinking is True and got.cancel_requested is False
    assert got.started_at == started and timezone.is_aware(got.started_at)
    assert got.finished_at is None
    assert timezone.is_aware(got.created_at) and got.created_at == turn.created_at
    assert timezone.is_aware(got.updated_at) and got.updated_at == turn.updated_at
    assert _attrs(got) == _as_db(turn)
    # By a foreign key id and an enum value too.
    assert Table(Turn).get(conversation=graph["conv"].pk, state=TurnState.RUNNING).pk == turn.pk


def test_get_reads_a_caller_like_the_orm(db):
    orm = Caller.objects.create(name="reader", role="application", issuers=["a", "b"], from_config=True)
    got = Table(Caller).get(name="reader")
    assert _attrs(got) == _as_db(orm)
    assert got.issuers == ["a", "b"] and got.from_config is True


def test_values_list_reads_what_the_orms_values_list_reads(graph):
    for n, state in enumerate([TurnState.RUNNING, TurnState.COMPLETED, TurnState.RUNNING]):
        _turn(graph, f"t-vl-{n}", state=state, model=f"m-{2 - n}", context={"n": n})
    t = Table(Turn)
    names = ["id", "turn_id", "state", "model", "context"]
    for order_by in (("id",), ("model", "id"), ("state", "turn_id")):
        for where in ({}, {"state": TurnState.RUNNING}, {"conversation": graph["conv"].pk, "profile": None},
                      {"state": "nope"}):
            orm = list(Turn.objects.filter(**where).order_by(*order_by).values_list(*names))
            assert t.values_list(names, order_by=order_by, **where) == orm, (order_by, where)
    assert len(t.values_list(["id"], state=TurnState.RUNNING)) == 2
    # Built once per shape: another value of the same shape adds no statement.
    shapes = len(t._get_sql)
    t.values_list(["id"], state=TurnState.COMPLETED)
    assert len(t._get_sql) == shapes


def test_from_row_with_partial_columns_defers_the_rest(graph, django_assert_num_queries):
    turn = _turn(graph, "t-part", state=TurnState.RUNNING, context={"k": "v"}, model="m-part",
                 started_at=datetime(2024, 7, 1, 12, 0, tzinfo=dt_timezone.utc))
    t = Table(Turn)
    names = ["id", "state", "context", "started_at"]
    row = rows.fetchone(f"SELECT {t.select_list(names, 'tt')} FROM {t.name} tt WHERE tt.id = %s", [turn.pk])
    got = t.from_row(names, row)
    with django_assert_num_queries(0):
        assert got.pk == turn.pk and got.state == "running"
        assert got.context == {"k": "v"}
        assert got.started_at == datetime(2024, 7, 1, 12, 0, tzinfo=dt_timezone.utc)
        assert timezone.is_aware(got.started_at)
    deferred = got.get_deferred_fields()
    assert {"turn_id", "model", "conversation_id", "created_at", "citation_ids"} <= deferred
    assert not deferred & set(names)
    # A deferred field loads from the database when read.
    with django_assert_num_queries(1):
        assert got.model == "m-part"
    assert "model" not in got.get_deferred_fields()
    assert got.turn_id == "t-part"
    assert got.citation_ids == []


def test_from_row_of_every_column_equals_the_orm_row(graph):
    turn = _turn(graph, "t-all", context={"x": 1}, finished_at=timezone.now())
    t = Table(Turn)
    row = rows.fetchone(f"SELECT {t.select_list(t.attnames)} FROM {t.name} WHERE id = %s", [turn.pk])
    got = t.from_row(t.attnames, row)
    assert got.get_deferred_fields() == set()
    assert _attrs(got) == _as_db(turn)


def test_select_list_and_col_name_the_model_columns(graph):
    t = Table(Turn)
    assert t.attnames[0] == "id"
    assert set(t.attnames) == {f.attname for f in _concrete(Turn)}
    # col() takes a field's name or attname and gives its quoted column.
    assert t.col("conversation") == t.col("conversation_id") == connection.ops.quote_name("conversation_id")
    assert t.name == connection.ops.quote_name(Turn._meta.db_table)
    assert t.select_list(["id", "turn_id"], "x") == (
        f"x.{connection.ops.quote_name('id')}, x.{connection.ops.quote_name('turn_id')}")


def test_fetchone_and_fetchall(graph):
    m = Table(Message)
    ids = [m.insert(conversation=graph["conv"], role="user", content=c) for c in ("one", "two")]
    sql = f"SELECT id, {m.col('content')} FROM {m.name} WHERE {m.col('conversation')} = %s ORDER BY id"
    assert rows.fetchall(sql, [graph["conv"].pk]) == [(ids[0], "one"), (ids[1], "two")]
    assert tuple(rows.fetchone(sql, [graph["conv"].pk])) == (ids[0], "one")
    assert rows.fetchone(sql, [10 ** 9]) is None
    assert rows.fetchall(sql, [10 ** 9]) == []


def test_from_row_takes_columns_in_any_order_and_none_in_where_is_is_null(tcast):
    from ugent_common import rows
    from channels_app.models import Actor, Conversation
    actor = Actor.objects.create(key="web:rows-order", user_id="rows-order")
    conv = Conversation.objects.create(external_id="c-order-x", owner=actor)
    t = rows.table(Conversation)
    got = t.from_row(["external_id", "owner_id", "id"], ("c-order-x", actor.pk, conv.pk))
    assert (got.pk, got.external_id, got.owner_id) == (conv.pk, "c-order-x", actor.pk)
    assert t.get(external_id="c-order-x", caller=None).pk == conv.pk
    assert t.update({"id": conv.pk, "caller": None}, model_choice="m") == 1
    assert Conversation.objects.get(pk=conv.pk).model_choice == "m"


# --- the raw statement path ----------------------------------------------------------------------

def test_statements_skip_djangos_cursor_wrapper_when_nothing_watches(graph, monkeypatch):
    from django.db.backends import utils
    wrapped = []
    real = utils.CursorWrapper.execute
    monkeypatch.setattr(utils.CursorWrapper, "execute", lambda self, *a, **k: wrapped.append(a) or real(self, *a, **k))
    t = Table(Turn)
    made = t.insert(turn_id="t-raw", conversation=graph["conv"], actor=graph["actor"], receipt=graph["receipt"])
    assert t.update({"id": made}, state=TurnState.RUNNING) == 1
    assert rows.fetchone(f"SELECT {t.col('state')} FROM {t.name} WHERE id = %s", [made]) == (TurnState.RUNNING,)
    assert wrapped == []


def test_an_execute_wrapper_still_sees_every_statement(graph):
    seen = []

    def watch(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    t = Table(Turn)
    with connection.execute_wrapper(watch):
        made = t.insert(turn_id="t-watched", conversation=graph["conv"], actor=graph["actor"],
                        receipt=graph["receipt"])
        t.update({"id": made}, state=TurnState.RUNNING)
        rows.fetchall(f"SELECT id FROM {t.name} WHERE id = %s", [made])
    assert [s.split()[0] for s in seen] == ["INSERT", "UPDATE", "SELECT"]


def test_a_constraint_violation_is_djangos_integrity_error_and_a_savepoint_recovers(graph):
    from django.db import IntegrityError, transaction
    t = Table(Receipt)
    with transaction.atomic():
        with pytest.raises(IntegrityError):
            with transaction.atomic():
                t.insert(conversation=graph["conv"], actor=graph["actor"], client_message_id="m1", content_hash="x")
        assert t.insert(conversation=graph["conv"], actor=graph["actor"], client_message_id="m2",
                        content_hash="x") > 0
    assert Receipt.objects.filter(conversation=graph["conv"]).count() == 2


def test_a_statement_in_a_broken_transaction_is_refused_like_the_orms(graph):
    from django.db import IntegrityError, transaction
    from django.db.transaction import TransactionManagementError
    t = Table(Receipt)
    with pytest.raises(TransactionManagementError):
        with transaction.atomic():
            try:
                with transaction.atomic(savepoint=False):
                    t.insert(conversation=graph["conv"], actor=graph["actor"], client_message_id="m1",
                             content_hash="x")
            except IntegrityError:
                pass
            rows.fetchone(f"SELECT 1 FROM {t.name}", [])


def test_aware_datetimes_in_any_zone_and_naive_ones_store_as_the_orm_does(graph):
    plus5 = dt_timezone(timedelta(hours=5))
    aware = datetime(2026, 3, 1, 17, 0, 0, 123456, tzinfo=plus5)
    turn = _turn(graph, "t-zones")
    Table(Turn).update({"id": turn.pk}, started_at=aware)
    turn.refresh_from_db()
    assert turn.started_at == aware and turn.started_at.utcoffset() == timedelta(0)
    # a naive datetime goes through Django's own adaptation (its warning included)
    with pytest.warns(RuntimeWarning, match="naive datetime"):
        Table(Turn).update({"id": turn.pk}, finished_at=datetime(2026, 3, 1, 12, 0, 0))
    turn.refresh_from_db()
    assert turn.finished_at == datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt_timezone.utc)
