"""sqlite_fts on PostgreSQL: recall through the postings table (migration 0021) is the recall the GIN statement
gave, fact for fact and in the same order, and the postings follow every write at once."""
from __future__ import annotations

import itertools
import random
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from plugins_app.agent.memory import recall_preview, services
from plugins_app.agent.memory.backends import FtsBackend
from plugins_app.agent.memory.models import MemoryFact
from plugins_app.agent.memory.recall import recall
from tests.support.memory import gin_fts, memory_config, recall_through  # noqa: F401

pytestmark = pytest.mark.django_db
ALICE, BOB = "web:alice", "web:bob"
# words sharing prefixes (tea, teal, teapot...), forms PostgreSQL's parser reads its own way (a word it cuts in two,
# one it makes no word of, a digit form it reads as a number and a word, a letter it lower-cases differently),
# accents and another script
WORDS = ("tea teal teapot teapots teacher team garden gardener gardens café cafés cafe coffee cocoa piano pianist "
         "jazz bicycle bike running runner run ab cd ab²cd x² ² 0e5e İstanbul naïve straße 東京 東京タワー").split()


def texts(actor, text):
    return [f["text"] for f in recall_preview(actor_key=actor, text=text)["facts"]]


def postings(actor=None):
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM plugins_app_memoryposting" + (
            " WHERE actor = (SELECT id FROM plugins_app_memoryactor WHERE key = %s)" if actor else ""),
            [actor] if actor else [])
        return cur.fetchone()[0]


def test_recall_through_the_postings_is_the_gin_statements_recall(memory_config):  # noqa: F811
    if connection.vendor != "postgresql":
        pytest.skip("the GIN statement it is compared with is PostgreSQL's")
    memory_config.backend("sqlite_fts")
    rng = random.Random(21)
    facts = {ALICE: [], BOB: []}
    for n in range(420):
        actor = ALICE if n % 3 else BOB
        words = " ".join(rng.choices(WORDS, k=rng.randint(1, 5)))
        text = f"User {rng.choice(('likes', 'owns', 'needs'))} {words} #{n}."
        facts[actor].append(services.fact_save(actor_key=actor, text=text,
                                               tier="ephemeral" if n % 11 == 0 else "contextual")[0])
    past = timezone.now() - timedelta(seconds=1)
    MemoryFact.objects.filter(pk__in=[f.pk for f in facts[ALICE][::13] + facts[BOB][::13]]).update(expires_at=past)
    assert services.fact_forget(actor_key=ALICE, fact_id=facts[ALICE][5].pk)
    services.facts_delete(fact_ids=[f.pk for f in facts[ALICE][20:30]])  # the admin's delete
    MemoryFact.objects.filter(pk__in=[f.pk for f in facts[BOB][40:45]]).delete()
    for fact in facts[ALICE][50:70]:  # edited, as the admin saves it
        fact.text = f"User {' '.join(rng.choices(WORDS, k=3))} edited."
        fact.save()
        services.fact_edited(fact=fact, changed=["text"])
    MemoryFact.objects.filter(pk__in=[f.pk for f in facts[ALICE][70:80]]).update(actor_key=BOB)  # moved to bob
    # each user's pinned and core facts (recalled whatever the text, from the search's own call): never the other's
    pinned = [f.pk for f in facts[ALICE][100:104] + facts[BOB][60:63]]
    MemoryFact.objects.filter(pk__in=pinned).update(pinned=True)
    MemoryFact.objects.filter(pk__in=[f.pk for f in facts[ALICE][110:114] + facts[BOB][70:73]]).update(tier="core")
    with connection.cursor() as cur:
        cur.execute("ANALYZE plugins_app_memoryfact")  # the weights' total: the table's row estimate
    # what the stored text_tsv held, computed per row; the user's expired facts weigh as in the postings' counts
    before = gin_fts("to_tsvector('simple', f.text)", expired_counted=True)
    queries = [" ".join(rng.choices(WORDS + ["teap", "gard", "pian", "caf", "東"], k=rng.randint(1, 4)))
               for _ in range(120)] + ["tea", "the weather on mars", "²", "ab²cd teapot", "0e5e"]
    owner = dict(MemoryFact.objects.values_list("id", "actor_key"))
    expired = set(MemoryFact.objects.filter(expires_at__lte=timezone.now()).values_list("id", flat=True))
    assert len(expired) > 20
    found = 0
    for actor in (ALICE, BOB):
        for q in queries:
            now = [(f.id, f.score) for f in recall(actor_key=actor, text=q).facts]
            assert now == [(f.id, f.score) for f in recall_through(before, actor_key=actor, text=q).facts], q
            assert all(owner[fid] == actor for fid, _ in now)  # bob never recalls alice's facts, nor she his
            assert not {fid for fid, _ in now} & expired
            found += len(now)
            assert {fid for fid in pinned if owner[fid] == actor and fid not in expired} <= {fid for fid, _ in now}
    assert found > 1000  # the queries do recall


def test_the_postings_follow_every_write(memory_config):  # noqa: F811
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's postings table")
    memory_config.backend("sqlite_fts")
    fact = services.fact_save(actor_key=ALICE, text="User drinks green tea, green.")[0]
    assert postings(ALICE) == 4 and postings(BOB) == 0  # one row a distinct word
    MemoryFact.objects.filter(pk=fact.pk).update(actor_key=BOB)
    assert postings(ALICE) == 0 and postings(BOB) == 4
    assert texts(ALICE, "green tea") == [] and texts(BOB, "green tea") == ["User drinks green tea, green."]
    MemoryFact.objects.filter(pk=fact.pk).update(pinned=True, tier="core")  # nothing the postings hold
    assert postings(BOB) == 4
    MemoryFact.objects.filter(pk=fact.pk).update(text="User plays the cello.")
    assert postings(BOB) == 4 and texts(BOB, "green tea") == ["User plays the cello."]  # core: recalled anyway
    MemoryFact.objects.filter(pk=fact.pk).update(pinned=False, tier="contextual")
    assert texts(BOB, "green tea") == [] and texts(BOB, "cello") == ["User plays the cello."]
    MemoryFact.objects.filter(pk=fact.pk).delete()
    assert postings() == 0
    services.fact_save(actor_key=ALICE, text="User likes tea.")
    with connection.cursor() as cur:
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")  # (the sightings' deferred foreign key has checks pending)
        cur.execute("TRUNCATE plugins_app_memoryfact CASCADE")  # Django's flush
    assert postings() == 0


def test_a_fact_edited_or_deleted_in_the_admin_is_gone_from_recall_at_once(memory_config, admin_client):  # noqa: F811
    memory_config.backend("sqlite_fts")
    fact = services.fact_save(actor_key=ALICE, text="User likes green tea.")[0]
    kept = services.fact_save(actor_key=ALICE, text="User likes black tea.")[0]
    assert texts(ALICE, "green tea") == ["User likes green tea.", "User likes black tea."]
    page = admin_client.post(f"/admin/plugins_app/memoryfact/{fact.pk}/change/", {
        "actor_key": ALICE, "text": "User plays the cello.", "tier": "contextual", "source": "turn", "source_ref": "",
        "expires_at_0": "", "expires_at_1": ""})
    assert page.status_code == 302, page.content.decode()[:2000]
    assert texts(ALICE, "green tea") == ["User likes black tea."]
    assert texts(ALICE, "cello") == ["User plays the cello."]
    page = admin_client.post("/admin/plugins_app/memoryfact/", {
        "action": "delete_selected", "_selected_action": [fact.pk, kept.pk], "post": "yes"})
    assert page.status_code == 302
    assert texts(ALICE, "cello") == [] and texts(ALICE, "green tea") == []
    assert recall(actor_key=BOB, text="green tea cello").facts == []


def tea_facts(actor, n, *, expires_at=None):
    """`n` facts of `actor` holding "tea", saved in one statement (the postings' trigger runs for each row)."""
    return [f.pk for f in MemoryFact.objects.bulk_create(
        MemoryFact(actor_key=actor, text=f"User likes tea #{i}.", normalized=f"user likes tea #{i}.",
                   tier="ephemeral" if expires_at else "contextual", expires_at=expires_at)
        for i in (next(_numbers) for _ in range(n)))]


def test_recall_reads_in_one_statement_whose_text_is_the_same_for_every_message(memory_config):  # noqa: F811
    """PostgreSQL's recall is one statement, the same text whatever the words (they are its parameters), so the
    function it calls keeps its plan (migration 0023); before it, the user's own facts, the counts and a text
    per message."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's search function")
    memory_config.backend("sqlite_fts")
    tea_facts(ALICE, 3)
    seen = []

    def record(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        for text in ("tea", "green tea teapots", "café ab²cd 東京", "the weather on mars today"):
            recall(actor_key=ALICE, text=text)
    read = [sql for sql in seen if any(name in sql for name in (
        "plugins_app_memoryfact", "plugins_app_memoryposting", "plugins_app_memory_search"))]
    assert len(read) == 4 and len(set(read)) == 1, read  # one a recall, the user's own facts read in it


_numbers = itertools.count()


def test_another_users_postings_never_weigh_in_or_take_a_users_candidates(memory_config):  # noqa: F811
    """Each statement reads the user's own postings only (an actor key's id, not a hash of it that another key, which
    an API caller chooses, could share), and a posting of theirs that led to another's fact would show nothing."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's postings table")
    memory_config.backend("sqlite_fts")
    backend = FtsBackend()
    alice = tea_facts(ALICE, 8)
    mallory = tea_facts("web:mallory", 120)  # newer: each would come before alice's at an equal weight
    with connection.cursor() as cur:
        cur.execute("SELECT key, id FROM plugins_app_memoryactor WHERE key IN (%s, 'web:mallory')", [ALICE])
        ids = dict(cur.fetchall())
    assert len(set(ids.values())) == 2
    assert [fid for fid, _ in backend.search(actor_key=ALICE, text="tea", limit=50)] == alice[::-1]
    with connection.cursor() as cur:  # mallory's postings as alice's (what a shared hash of their keys made)
        cur.execute("UPDATE plugins_app_memoryposting SET actor = %s WHERE actor = %s",
                    [ids[ALICE], ids["web:mallory"]])
    # the candidates' owner is checked, before the limit when one was not hers: still all hers, and only hers
    assert [fid for fid, _ in backend.search(actor_key=ALICE, text="tea", limit=50)] == alice[::-1]
    assert set(mallory).isdisjoint(fid for fid, _ in backend.search(actor_key=ALICE, text="likes tea", limit=50))


def test_an_expired_fact_is_never_recalled_however_many_outrank_the_live_ones(memory_config):  # noqa: F811
    """The expiry is checked on the candidates' rows; when too few of them were live, before the limit."""
    memory_config.backend("sqlite_fts")
    live = tea_facts(ALICE, 10)
    past = timezone.now() - timedelta(seconds=1)
    expired = tea_facts(ALICE, 30, expires_at=past)  # among the best 100: dropped, the live ones come after
    found = [fid for fid, _ in FtsBackend().search(actor_key=ALICE, text="tea", limit=50)]
    assert found == live[::-1]
    expired += tea_facts(ALICE, 120, expires_at=past)  # the best 100 all expired: the statement runs again
    assert [fid for fid, _ in FtsBackend().search(actor_key=ALICE, text="tea", limit=50)] == live[::-1]
    assert [fid for fid, _ in FtsBackend().search(actor_key=ALICE, text="tea", limit=5)] == live[:4:-1]
    assert not set(expired) & {f.id for f in recall(actor_key=ALICE, text="tea teapot").facts}


@pytest.mark.django_db(transaction=True)
def test_two_transactions_saving_a_new_users_first_facts_at_once_both_commit_under_one_id(memory_config):  # noqa: F811
    """The postings' trigger gives a new actor key its id (unique): the second transaction waits for the first's
    commit and then takes the same id, rather than failing."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's postings table")
    import threading

    import psycopg
    memory_config.backend("sqlite_fts")
    params = connection.get_connection_params()
    insert = ("INSERT INTO plugins_app_memoryfact (created_at, updated_at, actor_key, text, normalized, tier, "
              "source, source_ref, pinned, seen_count) VALUES (now(), now(), 'web:newcomer', %s, %s, 'contextual', "
              "'turn', '', FALSE, 1)")
    with psycopg.connect(**params) as first, psycopg.connect(**params) as second:
        first.execute(insert, ["User likes tea.", "user likes tea."])  # in its transaction, not committed
        failed = []

        def save():
            try:
                second.execute(insert, ["User likes green tea.", "user likes green tea."])
                second.commit()
            except Exception as exc:  # noqa: BLE001 (the test's verdict)
                failed.append(exc)
        saver = threading.Thread(target=save)
        saver.start()
        saver.join(1)
        assert saver.is_alive(), failed  # waiting for the first's commit, on the key's unique index
        first.commit()
        saver.join(10)
        assert not saver.is_alive() and failed == []
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM plugins_app_memoryactor WHERE key = 'web:newcomer'")
        assert cur.fetchone()[0] == 1
    assert [f["text"] for f in recall_preview(actor_key="web:newcomer", text="green tea")["facts"]] == \
        ["User likes green tea.", "User likes tea."]


# words PostgreSQL's parser reads its own way, forms sharing prefixes, other scripts, a word of one letter
# repeated past the index's length, weighed so some are common and others rare (from the review's probe)
EDGE = ["tea", "teal", "teapot", "teapots", "team", "teas", "tease", "café", "cafe", "cafés", "caf", "naïve",
        "東京", "東京都", "москва", "москвы", "ελλάδα", "ab²cd", "0e5e", "2026", "12345", "x1y2", "snake_case_name",
        "e-mail", "don't", "z" * 2100, "q" * 300, "힣힣힣힣", "straße", "strasse", "ǆemal", "İstanbul", "été", "ete",
        "ℌello", "ﬁsh", "fish", "v1.2.3", "foo_bar", "ab", "abc", "abcd", "abcde", "abcdef", "日本語のテキスト"]


def test_the_search_function_is_0021s_statements_on_randomized_facts(memory_config, monkeypatch):  # noqa: F811
    """plugins_app_memory_search against migration 0021's two statements (postings_0021) on randomized facts of
    three users (expired, pinned, core ones among them), randomized messages, few candidates (so the prefixes'
    choice, the limit and the second, checked run all come into play): the same hits and scores, the same
    rows, and the same own facts as recall's _OWN_FACTS statement."""
    from plugins_app.agent.memory import recall as recall_module
    from tests.support.memory import postings_0021
    if connection.vendor != "postgresql":
        pytest.skip("the function is PostgreSQL's")
    memory_config.backend("sqlite_fts")
    monkeypatch.setattr(FtsBackend, "CANDIDATES", 5)
    rng = random.Random(16)
    vocab = EDGE + [f"w{c}{d}" for c in "abcdefgh" for d in "xyz"] + ["likes", "green", "market", "marked", "marker"]
    weights = [1.0 / (i + 1) ** 0.7 for i in range(len(vocab))]
    rng.shuffle(weights)
    now = timezone.now()
    facts = []
    for actor, n in ((ALICE, 200), (BOB, 40), ("web:carol", 3)):
        for i in range(n):
            r = rng.random()
            facts.append(MemoryFact(
                actor_key=actor, text=f"User {' '.join(rng.choices(vocab, weights, k=rng.randint(2, 8)))} {i}",
                normalized=f"{actor}{i}", tier=rng.choice(["core", "contextual", "archival", "ephemeral"]),
                pinned=rng.random() < 0.05,
                expires_at=now - timedelta(days=1) if r < 0.15 else now + timedelta(days=1) if r < 0.2 else None))
    MemoryFact.objects.bulk_create(facts)
    with connection.cursor() as cur:
        cur.execute("ANALYZE plugins_app_memoryfact")
    new, old = FtsBackend(), postings_0021()
    messages = ["", "the and of", "tea", "teapot", "teal tea", "caf café", "東京", "ab²cd", "snake_case_name", "z" * 2100]
    for _ in range(40):
        words = rng.choices(vocab, k=rng.randint(0, 9)) + [rng.choice(vocab)[:rng.randint(2, 6)]
                                                          for _ in range(rng.randint(0, 3))]
        words += rng.choices(["the", "what", "nonexistent", "tell", "me"], k=rng.randint(0, 2))
        rng.shuffle(words)
        messages.append(" ".join(words))
    found = 0
    for text in messages:
        for actor in (ALICE, BOB, "web:carol", "web:nobody"):
            for limit in (2, 24):
                rows_new, rows_old = {}, {}
                hits = new.search(actor_key=actor, text=text, limit=limit, rows=rows_new)
                assert hits == old.search(actor_key=actor, text=text, limit=limit, rows=rows_old), (actor, text)
                assert rows_new == rows_old
                assert set(MemoryFact.objects.filter(pk__in=[f for f, _ in hits]).values_list("actor_key", flat=True)) \
                    <= {actor}
                found += len(hits)
            t = timezone.now()
            own = recall_module.own_facts_of(new._search_pg(actor, new.terms(text), 50, want=12, now=t)[2])
            held, pinned, core, rows = recall_module.own_facts(actor, 12, t)
            assert own[:3] == (held, pinned, core)
            assert {k: (v.text, v.tier) for k, v in own[3].items()} == {k: (v.text, v.tier) for k, v in rows.items()}
    assert found > 300  # the messages do find facts


def test_the_users_own_facts_are_found_by_an_index_in_the_functions_kept_plan(memory_config):  # noqa: F811
    """The function's plan is generic (planned for any user): with statistics of few users, one holding most
    facts, the own facts' statement must still seek the index for the user, not scan the facts table (a user
    with no facts paid 5 ms for it at 100k facts). Its statements prepared as the function keeps them, and
    explained."""
    from importlib import import_module
    if connection.vendor != "postgresql":
        pytest.skip("the function is PostgreSQL's")
    search = import_module("plugins_app.migrations.0023_memory_search_function").SEARCH
    own = search[search.index("IF $10 > 0 THEN\n"):search.index("END IF;")]
    own = own[own.index("RETURN QUERY") + len("RETURN QUERY"):own.rindex(";")]
    with connection.cursor() as cur:
        cur.execute("INSERT INTO plugins_app_memoryfact (actor_key, text, normalized, tier, pinned, source, source_ref, "
                    "created_at, updated_at, seen_count) SELECT 'web:big', 'User likes tea ' || i, 'n' || i, "
                    "'contextual', false, 'turn', '', now(), now(), 1 FROM generate_series(1, 20000) i")
        for actor in ("web:alice", "web:bob", "web:carol"):
            for i in range(5):
                services.fact_save(actor_key=actor, text=f"User likes tea {i}.", tier="core" if i else "contextual")
        cur.execute("ANALYZE plugins_app_memoryfact")
        cur.execute("SET plan_cache_mode = force_generic_plan")
        try:
            cur.execute("PREPARE ugent_test_own (text, text[], text[], bigint[], bigint, bigint, boolean, "
                        "timestamptz, bigint, bigint) AS " + own)
            cur.execute("EXPLAIN EXECUTE ugent_test_own('web:nobody', '{}', '{}', '{}', 50, 50, false, now(), 100, 12)")
            plan = "\n".join(row[0] for row in cur.fetchall())
        finally:
            cur.execute("DEALLOCATE ugent_test_own")
            cur.execute("RESET plan_cache_mode")
    assert "$1" in plan  # the generic plan
    assert "Seq Scan" not in plan, plan
