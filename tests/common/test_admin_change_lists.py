"""The admin's change lists of the tables that grow with the traffic cost the same per page load at any size.

Each used to read its whole table on every page load: the paginator's COUNT(*) and a second one of the
unfiltered table (show_full_result_count), SELECT DISTINCT over a text column for a filter's choices (event
types, models, channels, mimes, job names), date_hierarchy's DISTINCT of the years, and for memory facts a sort
of every fact. ugent_common.admin.BoundedListAdmin counts over a LIMIT in the list's order, offers filter
choices the code knows (and the newest rows' values), filters dates by range and sorts only where an index
serves the order.

The measure is the databases' own, never a duration. SQLite: the instructions its virtual machine runs for a
logged-in superuser's page load (tests/support/plans.vm_steps), at 1,500 and at 4,500 rows: the old lists ran
about three times as many at the larger size, these the same. PostgreSQL: each statement the page load runs
on the table, run again under EXPLAIN ANALYZE with sequential scans off (so a table this small is read as a
large one would be, through its indexes): the rows each reads from the table stay under a bound the table is
three times larger than (the old count alone read all 4,500)."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.utils import timezone

from channels_app.models import Actor, Conversation, Event, File, Message, Receipt, Steering, Turn
from cron_app.models import CronRun
from plugins_app.agent.memory.models import MemoryFact
from plugins_app.channel.models import OutboundDelivery, Plugin
from tests.support.plans import statements_on, vm_steps

pytestmark = pytest.mark.django_db

SMALL, LARGE = 1500, 4500
# the most rows a page load's statement may read from its table: the count's 1,001 in the list's order (and
# the page's 100 among them, or a filter's sample of the newest 1,000), with room for the planner's way there
ROWS_READ_BOUND = 2200


class Rows:
    """The rows the lists are filled with: one actor, conversation, turn and plugin that the rest hang on."""

    def __init__(self):
        self.actor = Actor.objects.create(key="web:alice", user_id="alice")
        self.conv = Conversation.objects.create(external_id="c-1", owner=self.actor)
        self.receipt = Receipt.objects.create(conversation=self.conv, client_message_id="m-0", content_hash="x",
                                              actor=self.actor)
        self.turn = Turn.objects.create(turn_id="turn-0", conversation=self.conv, actor=self.actor,
                                        receipt=self.receipt)
        self.plugin = Plugin.objects.create(plugin_id="echo-main", kind="echo")

    def add(self, page: str, start: int, n: int) -> None:
        getattr(self, "fill_" + page.split("/")[1])(range(start, start + n))

    def fill_event(self, ids):
        Event.objects.bulk_create([Event(conversation=self.conv, turn=self.turn, type="turn.delta",
                                         data={"text": "x"}) for _ in ids], batch_size=1000)

    def fill_message(self, ids):
        Message.objects.bulk_create([Message(conversation=self.conv, role="user", content=f"m {i}")
                                     for i in ids], batch_size=1000)

    def fill_receipt(self, ids):
        Receipt.objects.bulk_create([Receipt(conversation=self.conv, client_message_id=f"r-{i}", content_hash="x",
                                             actor=self.actor, state="completed") for i in ids], batch_size=1000)

    def fill_turn(self, ids):
        receipts = Receipt.objects.bulk_create([Receipt(conversation=self.conv, client_message_id=f"t-{i}",
                                                        content_hash="x", actor=self.actor) for i in ids],
                                               batch_size=1000)
        Turn.objects.bulk_create([Turn(turn_id=f"turn-{i}", conversation=self.conv, actor=self.actor, receipt=r,
                                       state="completed", model="scripted") for i, r in zip(ids, receipts)],
                                 batch_size=1000)

    def fill_steering(self, ids):
        Steering.objects.bulk_create([Steering(turn=self.turn, actor=self.actor, text=f"s {i}", state="applied")
                                      for i in ids], batch_size=1000)

    def fill_file(self, ids):
        later = timezone.now() + timedelta(days=30)
        File.objects.bulk_create([File(file_id=f"file-{i}", conversation=self.conv, actor=self.actor,
                                       filename=f"f{i}.txt", mime="text/plain", size=1, sha256="x",
                                       storage_name=f"s{i}", expires_at=later) for i in ids], batch_size=1000)

    def fill_conversation(self, ids):
        Conversation.objects.bulk_create([Conversation(external_id=f"conv-{i}", owner=self.actor) for i in ids],
                                         batch_size=1000)

    def fill_actor(self, ids):
        Actor.objects.bulk_create([Actor(key=f"web:user-{i}", user_id=f"user-{i}") for i in ids], batch_size=1000)

    def fill_outbounddelivery(self, ids):
        OutboundDelivery.objects.bulk_create([OutboundDelivery(delivery_id=f"d-{i}", plugin=self.plugin,
                                                               conversation=self.conv, state="delivered")
                                              for i in ids], batch_size=1000)

    def fill_cronrun(self, ids):
        CronRun.objects.bulk_create([CronRun(job_name="nightly", trigger="scheduled", state="completed")
                                     for i in ids], batch_size=1000)

    def fill_memoryfact(self, ids):
        MemoryFact.objects.bulk_create([MemoryFact(actor_key="web:alice", text=f"fact {i}", normalized=f"fact {i}")
                                        for i in ids], batch_size=1000)


# each change list, and a filtered load of it as an operator opens it (every row matches: a result smaller
# than the count's reach is counted exactly, and its cost is its own size)
PAGES = {
    "channels_app/event": {"type": "turn.delta"},
    "channels_app/message": {"role__exact": "user"},
    "channels_app/turn": {"state__exact": "completed", "model": "scripted"},
    "channels_app/receipt": {"state__exact": "completed"},
    "channels_app/steering": {"state__exact": "applied"},
    "channels_app/file": {"mime": "text/plain"},
    "channels_app/conversation": {"channel": "web"},
    "channels_app/actor": {"channel": "web"},
    "plugins_app/outbounddelivery": {"state__exact": "delivered"},
    "cron_app/cronrun": {"state__exact": "completed", "job_name": "nightly"},
    "plugins_app/memoryfact": {"tier__exact": "contextual"},
}


def _table(page: str) -> str:
    app, model = page.split("/")
    return f"{app}_{model}"


def _loads(admin_client, page: str, params: dict) -> list:
    """The change list, as it opens and filtered; each answers 200 with its rows."""
    url = f"/admin/{page}/"
    responses = [admin_client.get(url), admin_client.get(url, params)]
    for resp in responses:
        assert resp.status_code == 200
        assert resp.context["cl"].result_list, resp.request
    return responses


@pytest.mark.parametrize("page", sorted(PAGES))
def test_a_page_load_costs_the_same_at_three_times_the_rows_on_sqlite(admin_client, page):
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's instruction count; PostgreSQL's rows read are checked below")
    rows = Rows()
    rows.add(page, 1, SMALL)
    _loads(admin_client, page, PAGES[page])  # (the session and the templates warmed)
    small = vm_steps(lambda: _loads(admin_client, page, PAGES[page]), every=100)
    rows.add(page, SMALL + 1, LARGE - SMALL)
    large = vm_steps(lambda: _loads(admin_client, page, PAGES[page]), every=100)
    # the old lists ran 2.2–3× the instructions at the larger size (each whole-table statement grew threefold)
    assert large <= small * 1.05 + 5, (small, large)


def _rows_read(plan: dict, table: str) -> int:
    """The rows a plan's nodes read from `table`: those they returned and those their filter removed."""
    read = 0
    if plan.get("Relation Name") == table:
        read += (plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0)) * plan.get("Actual Loops", 1)
    return read + sum(_rows_read(p, table) for p in plan.get("Plans", ()))


@pytest.mark.parametrize("page", sorted(PAGES))
def test_no_statement_of_a_page_load_reads_the_whole_table_on_postgresql(admin_client, page):
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's rows read; SQLite's instruction count is checked above")
    table = _table(page)
    rows = Rows()
    rows.add(page, 1, LARGE)
    with connection.cursor() as cur:
        cur.execute(f'ANALYZE "{table}"')  # (statistics outlive the test's rollback: this table's only)
    found = statements_on(table, lambda: _loads(admin_client, page, PAGES[page]))
    assert found
    with connection.cursor() as cur:
        cur.execute("SET enable_seqscan = off")
        try:
            for sql, params in found:
                cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
                plan = cur.fetchone()[0]
                plan = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
                assert _rows_read(plan, table) <= ROWS_READ_BOUND, (sql, json.dumps(plan, indent=1)[:4000])
        finally:
            cur.execute("RESET enable_seqscan")


def test_a_long_list_says_more_than_and_pages_on(admin_client):
    rows = Rows()
    rows.add("channels_app/message", 1, 2500)
    first = admin_client.get("/admin/channels_app/message/").content.decode()
    assert "more than 1,000 messages" in first and "?p=11" in first  # the pages counted, and one past them
    eleventh = admin_client.get("/admin/channels_app/message/", {"p": 11})
    assert eleventh.status_code == 200 and len(eleventh.context["cl"].result_list) == 100
    page = eleventh.content.decode()
    assert "more than 2,000 messages" in page and "?p=21" in page
    last = admin_client.get("/admin/channels_app/message/", {"p": 25})
    assert last.status_code == 200 and "2500 messages" in last.content.decode()  # counted to its end: exact
    small = admin_client.get("/admin/channels_app/message/", {"q": "m 1234"})
    assert "1 result" in small.content.decode()  # a smaller result is counted exactly


def test_the_event_types_the_code_appends_are_offered_without_reading_the_log(admin_client):
    rows = Rows()
    rows.add("channels_app/event", 1, 10)
    found = {}
    statements_on("channels_app_event", lambda: found.update(resp=admin_client.get("/admin/channels_app/event/")))
    spec = next(f for f in found["resp"].context["cl"].filter_specs if f.title == "type")
    offered = {c["display"] for c in spec.choices(found["resp"].context["cl"])}
    # the hub's and cron's types, none of which the log holds, and the one it does
    assert {"turn.completed", "compaction.completed", "cron.run.completed", "turn.delta"} <= offered
    # and a type typed into the URL filters too, offered while chosen
    resp = admin_client.get("/admin/channels_app/event/", {"type": "plugin.custom"})
    assert resp.status_code == 200 and not resp.context["cl"].result_list
    assert "plugin.custom" in resp.content.decode()


def test_dates_filter_by_range_and_created_at_sorts_by_id(admin_client):
    rows = Rows()
    rows.add("channels_app/event", 1, 5)
    Event.objects.filter(pk=Event.objects.order_by("id").first().pk).update(
        created_at=timezone.now() - timedelta(days=400))
    today = admin_client.get("/admin/channels_app/event/").content.decode()
    assert "Past 7 days" in today and "This year" in today
    since = (timezone.now() - timedelta(days=7)).isoformat(sep=" ")
    resp = admin_client.get("/admin/channels_app/event/", {"created_at__gte": since})
    assert resp.status_code == 200 and len(resp.context["cl"].result_list) == 4
    # "created at" (the fifth column) sorts by id, handed out in the same order
    cl = admin_client.get("/admin/channels_app/event/", {"o": "4"}).context["cl"]
    assert [e.pk for e in cl.result_list] == sorted(e.pk for e in cl.result_list)
    assert cl.queryset.query.order_by[0] in ("id", "pk")


@pytest.mark.parametrize("who, status", [("signed-in user who is not staff", 302), ("staff without permissions", 403)])
@pytest.mark.parametrize("page", sorted(PAGES))
def test_only_staff_with_the_view_permission_see_a_list(db, page, who, status):
    client = Client()
    client.force_login(User.objects.create_user("someone", password="x", is_staff=who.startswith("staff")))
    resp = client.get(f"/admin/{page}/")
    assert resp.status_code == status
    if status == 302:
        assert "/admin/login/" in resp["Location"]
    # and the view permission alone is enough to read it
    app, model = page.split("/")
    user = User.objects.create_user("viewer", password="x", is_staff=True)
    user.user_permissions.add(Permission.objects.get(content_type__app_label=app, codename=f"view_{model}"))
    client.force_login(user)
    assert client.get(f"/admin/{page}/").status_code == 200


@pytest.mark.parametrize("page", sorted(PAGES))
def test_a_page_past_any_the_list_counts_to_is_no_page_not_an_error(admin_client, page):
    """?p= beyond the furthest page a bounded list counts to (its LIMIT would overflow the database's integer)
    is a page that does not exist, as in Django's own lists: the list says so (?e=1), it does not fail."""
    rows = Rows()
    rows.add(page, 1, 3)
    for p in ("99999999999999999999", "1000001", "-1", "0", "abc"):
        resp = admin_client.get(f"/admin/{page}/", {"p": p})
        assert resp.status_code in (200, 302), (p, resp.status_code)
        if resp.status_code == 302:
            assert resp["Location"].endswith("?e=1"), (p, resp["Location"])


def test_a_list_sorts_only_by_the_columns_an_index_serves_whatever_the_url_asks(admin_client):
    """?o= naming a column outside sortable_by (the event list's type, its second column: ?o=1) is ignored:
    Django would sort every event by it; the list keeps its own order (newest first)."""
    Rows().add("channels_app/event", 0, 3)
    seen = statements_on("channels_app_event", lambda: admin_client.get("/admin/channels_app/event/", {"o": "1"}))
    listed = [sql for sql, _ in seen if "ORDER BY" in sql and "COUNT(" not in sql.upper()]
    assert listed and all('"channels_app_event"."type"' not in sql.split("ORDER BY")[1] for sql in listed), listed
    cl = admin_client.get("/admin/channels_app/event/", {"o": "0"}).context["cl"]  # the id, ascending: sortable
    assert [e.pk for e in cl.result_list] == sorted(e.pk for e in cl.result_list)
