"""Memory's services and recall, the same behaviour over each durable backend (and backend none)."""
from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from django.utils import timezone

from plugins_app.agent.memory import recall_preview, services
from plugins_app.agent.memory.backends import keywords, rrf
from plugins_app.agent.memory.conf import memory_conf
from plugins_app.agent.memory.models import MemoryFact, MemorySettings
from plugins_app.agent.memory.tools import MemoryToolBox
from tests.support.memory import BACKENDS, memory_config  # noqa: F401

pytestmark = pytest.mark.django_db
ALICE, BOB = "web:alice", "web:bob"


@pytest.fixture(params=BACKENDS)
def backend(request, memory_config):  # noqa: F811
    memory_config.backend(request.param)
    return request.param


def save(actor, text, tier="contextual", **kw):
    return services.fact_save(actor_key=actor, text=text, tier=tier, **kw)[0]


def texts(actor, text):
    return [f["text"] for f in recall_preview(actor_key=actor, text=text)["facts"]]


def test_a_saved_fact_is_recalled_for_a_text_about_it_and_not_for_another(backend):
    save(ALICE, "User likes green tea.")
    found = recall_preview(actor_key=ALICE, text="Which tea do I like?")
    assert found["backend"] == backend
    assert [f["text"] for f in found["facts"]] == ["User likes green tea."]
    assert found["facts"][0]["tier"] == "contextual" and found["tokens_est"] > 0
    assert texts(ALICE, "the weather on mars") == []


def test_bob_never_recalls_alices_facts(backend):
    save(ALICE, "User likes green tea.")
    save(ALICE, "User's name is Alice.", tier="core")
    assert texts(BOB, "Which tea do I like?") == []
    assert recall_preview(actor_key=BOB, text="what is my name")["facts"] == []


def test_core_facts_are_recalled_whatever_the_text(backend):
    save(ALICE, "User's name is Alice.", tier="core")
    assert texts(ALICE, "the weather on mars") == ["User's name is Alice."]


def test_an_expired_ephemeral_fact_is_not_recalled(backend):
    fact = save(ALICE, "User needs green tea tonight.", tier="ephemeral")
    assert fact.expires_at is not None
    assert texts(ALICE, "Which tea do I need?") == ["User needs green tea tonight."]
    MemoryFact.objects.filter(pk=fact.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert texts(ALICE, "Which tea do I need?") == []


def test_a_fact_whose_text_changed_is_found_by_its_new_words_only(backend):
    fact = save(ALICE, "User likes green tea.")
    fact.text = "User plays the cello."
    fact.save(update_fields=["text", "updated_at"])
    services.fact_edited(fact=fact, changed=["text"])
    # the index follows the row (SQLite's triggers; PostgreSQL's generated tsvector column)
    assert texts(ALICE, "Which instrument, the cello?") == ["User plays the cello."]
    assert texts(ALICE, "Which tea do I like?") == []


def test_the_newest_core_facts_are_recalled_up_to_max_hits(memory_config):  # noqa: F811
    memory_config.backend("sqlite_fts", max_hits=2)
    oldest, middle, newest = (save(ALICE, f"User's {w} is known.", tier="core") for w in ("age", "job", "town"))
    MemoryFact.objects.filter(pk=oldest.pk).update(updated_at=timezone.now() - timedelta(days=3))
    MemoryFact.objects.filter(pk=middle.pk).update(updated_at=timezone.now() - timedelta(days=2))
    assert [f["id"] for f in recall_preview(actor_key=ALICE, text="the weather on mars")["facts"]] == \
        [newest.pk, middle.pk]
    services.fact_pin(actor_key=ALICE, fact_id=oldest.pk)  # a pinned fact comes before them
    assert [f["id"] for f in recall_preview(actor_key=ALICE, text="the weather on mars")["facts"]] == \
        [oldest.pk, newest.pk]


def test_a_duplicate_is_merged_not_stored_twice(backend):
    first, created = services.fact_save(actor_key=ALICE, text="User likes green tea.")
    again, created_again = services.fact_save(actor_key=ALICE, text="user likes  green TEA", tier="core")
    assert created and not created_again and again.pk == first.pk
    assert MemoryFact.objects.count() == 1
    assert again.seen_count == 2 and again.tier == "core" and again.last_seen_at is not None
    # the same words in another user's memory are that user's own fact
    assert services.fact_save(actor_key=BOB, text="User likes green tea.")[1]


def test_a_fact_is_counted_once_for_each_turn_it_is_stated_in(backend):
    first, created = services.fact_save(actor_key=ALICE, text="User likes green tea.", seen_in="t1")
    assert created and first.seen_count == 1 and first.last_seen_at is None
    # saved again from the same turn (a redelivered extraction): nothing counted, nothing touched
    again, created_again = services.fact_save(actor_key=ALICE, text="User likes green tea.", seen_in="t1")
    assert not created_again and again.seen_count == 1 and again.last_seen_at is None
    assert again.updated_at == first.updated_at
    # stated in another turn: seen once more, and only once however often that turn is saved again
    for _ in range(3):
        again, _ = services.fact_save(actor_key=ALICE, text="user likes green TEA", seen_in="t2")
    assert again.seen_count == 2 and again.last_seen_at is not None
    assert sorted(again.sightings.values_list("ref", flat=True)) == ["t1", "t2"]
    # a core tier given again still sticks, even from a turn already counted
    again, _ = services.fact_save(actor_key=ALICE, text="User likes green tea.", tier="core", seen_in="t2")
    assert again.tier == "core" and again.seen_count == 2
    # without a turn to name, every save counts (the tool, the admin)
    again, _ = services.fact_save(actor_key=ALICE, text="User likes green tea.")
    assert again.seen_count == 3
    # bob's sightings are his own fact's
    bobs, created = services.fact_save(actor_key=BOB, text="User likes green tea.", seen_in="t1")
    assert created and bobs.seen_count == 1


def test_a_sighting_whose_count_failed_is_not_kept(backend, monkeypatch):
    from django.db.models.query import QuerySet
    save(ALICE, "User likes green tea.", seen_in="t1")
    real = QuerySet.update

    def failing(self, **kw):
        if self.model is MemoryFact and "seen_count" in kw:
            raise RuntimeError("the database went away")
        return real(self, **kw)
    monkeypatch.setattr(QuerySet, "update", failing)
    with pytest.raises(RuntimeError):
        save(ALICE, "User likes green tea.", seen_in="t2")
    monkeypatch.setattr(QuerySet, "update", real)
    # the task runs again: t2 was never counted, so it counts now, once
    assert save(ALICE, "User likes green tea.", seen_in="t2").seen_count == 2


def test_an_ephemeral_facts_expiry_moves_only_when_it_is_stated_again(backend):
    fact = save(ALICE, "User needs green tea tonight.", tier="ephemeral", seen_in="t1")
    MemoryFact.objects.filter(pk=fact.pk).update(expires_at=fact.expires_at - timedelta(minutes=5))
    held = MemoryFact.objects.get(pk=fact.pk).expires_at
    assert save(ALICE, "User needs green tea tonight.", tier="ephemeral", seen_in="t1").expires_at == held
    assert save(ALICE, "User needs green tea tonight.", tier="ephemeral", seen_in="t2").expires_at > held


@pytest.mark.django_db(transaction=True)  # the task opens fresh connections, as in a worker
def test_the_after_turn_extraction_run_twice_counts_its_turn_once(backend):
    from plugins_app.tasks import memory_extract_turn
    if backend == "none":
        assert memory_extract_turn.run("web:alice", "my name is Alice", "t1") == 0
        assert not MemoryFact.objects.exists()
        return
    services.fact_save(actor_key=ALICE, text="User's name is Alice.", tier="core", seen_in="t0")
    assert memory_extract_turn.run(ALICE, "my name is Alice. I like green tea.", "t1") == 1
    assert memory_extract_turn.run(ALICE, "my name is Alice. I like green tea.", "t1") == 0  # redelivered
    counts = dict(MemoryFact.objects.values_list("text", "seen_count"))
    assert counts == {"User's name is Alice.": 2, "User likes green tea.": 1}


@pytest.mark.django_db(transaction=True)
def test_workers_saving_one_fact_at_once_count_each_turn_once(memory_config):  # noqa: F811
    import threading
    from django.db import connection
    memory_config.backend("sqlite_fts")
    services.fact_save(actor_key=ALICE, text="User likes green tea.", seen_in="t0")
    refs = ["t1"] * 4 + ["t2", "t3", "t4", "t5"]  # one turn's task delivered four times, and four other turns
    start, errors = threading.Barrier(len(refs)), []

    def save_from(ref):
        try:
            start.wait()
            services.fact_save(actor_key=ALICE, text="User likes green tea.", seen_in=ref)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=save_from, args=(ref,)) for ref in refs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    fact = MemoryFact.objects.get(actor_key=ALICE)
    assert fact.seen_count == 6  # t0, t1 once, t2..t5
    assert sorted(fact.sightings.values_list("ref", flat=True)) == ["t0", "t1", "t2", "t3", "t4", "t5"]


def test_extraction_names_the_turn_of_each_text(backend):
    if backend == "none":
        pytest.skip("nothing durable is saved")
    said = ["my name is Alice", "I like green tea", "my name is Alice"]
    with pytest.raises(ValueError):
        services.facts_extract_save(actor_key=ALICE, texts=said, source="conversation", seen_in=["t1"])
    assert services.facts_extract_save(actor_key=ALICE, texts=said, source="conversation",
                                       seen_in=["t1", "t2", "t3"]) == 2
    # read again with one more exchange: only the new one counts
    assert services.facts_extract_save(actor_key=ALICE, texts=said + ["I like green tea"], source="conversation",
                                       seen_in=["t1", "t2", "t3", "t4"]) == 0
    counts = dict(MemoryFact.objects.values_list("text", "seen_count"))
    assert counts == {"User's name is Alice.": 2, "User likes green tea.": 2}


def test_extraction_counts_only_new_facts(backend):
    said = ["my name is Alice", "I like green tea. What time is it?"]
    assert services.facts_extract_save(actor_key=ALICE, texts=said, source="conversation", source_ref="c1") == 2
    assert services.facts_extract_save(actor_key=ALICE, texts=said, source="conversation", source_ref="c1") == 0
    rows = list(MemoryFact.objects.order_by("id").values_list("text", "tier", "source", "source_ref"))
    assert rows == [("User's name is Alice.", "core", "conversation", "c1"),
                    ("User likes green tea.", "contextual", "conversation", "c1")]


def test_pinned_facts_come_first_and_archival_ones_last(memory_config):  # noqa: F811
    memory_config.backend("sqlite_fts")
    archival = save(ALICE, "User liked black tea in 2019.", tier="archival")
    contextual = save(ALICE, "User likes green tea.")
    pinned = save(ALICE, "User drinks tea without sugar.")
    services.fact_pin(actor_key=ALICE, fact_id=pinned.pk)
    assert [f["id"] for f in recall_preview(actor_key=ALICE, text="tea")["facts"]] == \
        [pinned.pk, contextual.pk, archival.pk]


def test_recall_keeps_to_max_hits_and_the_token_budget(memory_config):  # noqa: F811
    memory_config.backend("sqlite_fts", max_hits=3)
    for i in range(6):
        save(ALICE, f"User likes tea number {i}.")
    assert len(texts(ALICE, "tea")) == 3
    memory_config.backend("sqlite_fts", max_injected_tokens_est=40)
    found = recall_preview(actor_key=ALICE, text="tea")
    assert 0 < len(found["facts"]) < 6 and found["tokens_est"] <= 40


def test_several_keyword_queries_are_fused_by_reciprocal_rank(memory_config):  # noqa: F811
    memory_config.backend("sqlite_fts")
    both = save(ALICE, "User drinks green tea every morning.")
    one = save(ALICE, "User paints the fence green.")
    prefix_only = save(ALICE, "User collects teapots.")
    ranked = [f["id"] for f in recall_preview(actor_key=ALICE, text="green tea")["facts"]]
    # both words (three queries agree) first; one word; "teapots" by no query ("tea" is too short to prefix)
    assert ranked == [both.pk, one.pk] and prefix_only.pk not in ranked
    assert rrf([[1, 2], [2, 3]])[0][0] == 2  # found by both queries beats first in one
    assert keywords("What is my favourite TEA, please?") == ["favourite", "tea"]


def test_a_word_prefix_finds_what_the_exact_word_does_not_and_ranks_below_it(memory_config):  # noqa: F811
    memory_config.backend("sqlite_fts")
    plural = save(ALICE, "User collects teapots.")
    exact = save(ALICE, "User broke a teapot.")
    save(BOB, "User sells teapots.")
    assert [f["id"] for f in recall_preview(actor_key=ALICE, text="teapot")["facts"]] == [exact.pk, plural.pk]


def test_a_user_with_no_facts_recalls_nothing_whatever_others_hold(memory_config):  # noqa: F811
    memory_config.backend("sqlite_fts")
    save(ALICE, "User likes green tea.", tier="core")
    assert recall_preview(actor_key=BOB, text="green tea") == {"backend": "sqlite_fts", "facts": [], "tokens_est": 0}


def test_with_backend_none_nothing_is_recalled_or_saved(memory_config):  # noqa: F811
    MemoryFact.objects.create(actor_key=ALICE, text="User likes tea.", normalized="user likes tea", tier="core")
    assert recall_preview(actor_key=ALICE, text="tea") == {"backend": None, "facts": [], "tokens_est": 0}
    with pytest.raises(services.MemoryUnavailable):
        services.facts_extract_save(actor_key=ALICE, texts=["I like tea"], source="turn")


def test_a_memory_section_that_cannot_be_used_is_logged_and_runs_none(memory_config, caplog):  # noqa: F811
    memory_config.write('[memory]\nbackend = "lancedb"\n')
    with caplog.at_level(logging.ERROR, logger="ugent.memory"):
        assert memory_conf().backend == "none"
    assert any(m.startswith("ugent.toml: memory.backend") for m in caplog.messages)


def test_the_admin_shows_the_turns_a_fact_was_seen_in(backend, admin_client):
    for ref in ("t1", "t2", "t1"):
        fact = save(ALICE, "User likes green tea.", seen_in=ref)
    page = admin_client.get(f"/admin/plugins_app/memoryfact/{fact.pk}/change/").content.decode()
    assert "t2, t1" in page and ">2<" in page.replace(" ", "").replace("\n", "")


def test_the_admins_settings_override_ugent_toml(memory_config):  # noqa: F811
    memory_config.backend("sqlite_fts", max_hits=5)
    services.memory_settings_save(row=MemorySettings(backend="none", recall_cadence="every_call"))
    conf = memory_conf()
    assert (conf.backend, conf.recall_cadence, conf.max_hits) == ("none", "every_call", 5)
    services.memory_settings_save(row=MemorySettings(backend=""))
    assert memory_conf().backend == "sqlite_fts"


# --- the memory_control tool ---------------------------------------------------------------

def test_memory_control_lists_pins_and_forgets_only_the_users_own_facts(backend):
    mine = save(ALICE, "User likes green tea.")
    theirs = save(BOB, "User likes coffee.")
    box = MemoryToolBox({"actor_key": ALICE})
    listed = box.call_tool("memory_control", {"action": "list"})
    assert [f.text for f in listed.facts] == ["User likes green tea."]
    assert box.call_tool("memory_control", {"action": "pin", "fact_id": mine.pk}).ok
    assert MemoryFact.objects.get(pk=mine.pk).pinned
    refused = box.call_tool("memory_control", {"action": "forget", "fact_id": theirs.pk})
    assert not refused.ok and refused.message == f"There is no saved fact {theirs.pk}."
    assert MemoryFact.objects.filter(pk=theirs.pk).exists()
    assert box.call_tool("memory_control", {"action": "forget", "fact_id": mine.pk}).message == \
        f"Forgot fact {mine.pk}."
    assert not MemoryFact.objects.filter(pk=mine.pk).exists()


def many_facts(actor: str, n: int, *, pinned: int = 0) -> list[MemoryFact]:
    """`n` facts of `actor`, the oldest `pinned` of them pinned, each updated a minute after the one before."""
    start = timezone.now() - timedelta(days=30)
    return MemoryFact.objects.bulk_create([MemoryFact(
        actor_key=actor, text=f"User fact number {i}.", normalized=f"user fact number {i}", pinned=i < pinned,
        updated_at=start + timedelta(minutes=i), created_at=start) for i in range(n)])


def test_memory_control_lists_the_pinned_facts_first_then_the_newest_up_to_its_limit(memory_config):  # noqa: F811
    from plugins_app.agent.memory.tools import LIST_LIMIT
    memory_config.backend("sqlite_fts")
    many_facts(ALICE, LIST_LIMIT + 20, pinned=3)
    many_facts(BOB, 5, pinned=5)
    listed = MemoryToolBox({"actor_key": ALICE}).call_tool("memory_control", {"action": "list"}).facts
    want = [2, 1, 0] + list(range(LIST_LIMIT + 19, 22, -1))  # pinned newest first, then the rest newest first
    assert [f.text for f in listed] == [f"User fact number {i}." for i in want]
    assert [f.pinned for f in listed] == [True] * 3 + [False] * (LIST_LIMIT - 3)
    found = MemoryToolBox({"actor_key": ALICE}).call_tool("memory_control", {"action": "list", "query": "number 1"})
    assert {f.text for f in found.facts} == {f"User fact number {i}." for i in range(LIST_LIMIT + 20)
                                             if "1" in str(i)}  # each word
    assert [f.pinned for f in found.facts][:1] == [True]  # "number 1" is pinned; it comes first


def test_memory_controls_list_does_not_sort_all_of_a_users_facts(memory_config):  # noqa: F811
    from django.db import connection

    from plugins_app.agent.memory.tools import LIST_LIMIT
    from tests.support.plans import vm_steps
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's instruction count")
    memory_config.backend("sqlite_fts")
    many_facts("web:few", LIST_LIMIT + 10, pinned=2)
    many_facts("web:many", 3000, pinned=2)
    steps = {actor: vm_steps(lambda actor=actor: MemoryToolBox({"actor_key": actor}).call_tool(
        "memory_control", {"action": "list"}), every=10) for actor in ("web:few", "web:many")}
    # sorting every fact to put the pinned first cost about 40x more for the user with 3,000
    assert steps["web:many"] <= steps["web:few"] * 1.2, steps


def test_no_memory_control_tool_for_a_turn_kept_out_of_memory_or_without_a_backend(memory_config):  # noqa: F811
    memory_config.backend("sqlite_fts")
    assert [t.name for t in MemoryToolBox({"actor_key": ALICE}).discover_tools()] == ["memory_control"]
    assert MemoryToolBox({"actor_key": ALICE, "disable_memory_write": True}).discover_tools() == []
    assert MemoryToolBox({}).discover_tools() == []
    memory_config.write("[web.auth]\n")  # no [memory]
    assert MemoryToolBox({"actor_key": ALICE}).discover_tools() == []


def test_a_prefix_is_searched_only_for_a_word_the_user_holds_fewer_times_than_the_candidates(memory_config,
                                                                                           monkeypatch):  # noqa: F811
    from plugins_app.agent.memory.backends import FtsBackend
    memory_config.backend("sqlite_fts", max_hits=1)  # candidates: max(2 hits, CANDIDATES)
    monkeypatch.setattr(FtsBackend, "CANDIDATES", 2)
    searched = []  # for each search: whether a candidate matched a prefix (teapot itself matches teap*)
    real = FtsBackend.rankings
    monkeypatch.setattr(FtsBackend, "rankings", staticmethod(
        lambda arms, found: searched.append(any(bits >> len([a for a in arms if a[2] == 1]) for _, bits in found))
        or real(arms, found)))
    save(ALICE, "User broke a teapot.")
    save(BOB, "User sells a teapot.")
    save(BOB, "User sells another teapot.")  # bob's count is not alice's
    texts(ALICE, "teapot")
    assert searched[-1]  # one teapot of alice's: its forms are searched too (teap*)
    save(ALICE, "User mended the teapot.")
    assert texts(ALICE, "teapot")
    assert not searched[-1]  # two fill the candidates


def test_a_fact_dropped_after_the_limit_lets_the_next_live_one_in(memory_config, monkeypatch):  # noqa: F811
    from plugins_app.agent.memory.backends import FtsBackend
    memory_config.backend("sqlite_fts", max_hits=1)
    monkeypatch.setattr(FtsBackend, "CANDIDATES", 2)
    for text in ("User needs green tea tonight.", "User needs more green tea tomorrow."):
        fact = save(ALICE, text, tier="ephemeral")
        MemoryFact.objects.filter(pk=fact.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    save(ALICE, "User likes tea.")
    # both expired facts rank first (both words) and fill the two candidates: the statement runs again with
    # the expiry checked before its limit
    assert texts(ALICE, "green tea") == ["User likes tea."]


def test_the_full_text_index_follows_a_fact_moved_edited_and_deleted(memory_config):  # noqa: F811
    from django.db import connection

    from plugins_app.agent.memory.backends import owner_tag
    memory_config.backend("sqlite_fts")
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's owner-tagged full-text table")

    def held(actor, word):
        with connection.cursor() as cur:
            cur.execute("SELECT doc FROM plugins_app_memoryfact_fts_vocab WHERE term = %s", [owner_tag(actor) + word])
            found = cur.fetchone()
        return found[0] if found else 0

    fact = save(ALICE, "User drinks Café au lait.")
    assert held(ALICE, "cafe") == 1 and held(BOB, "cafe") == 0  # folded as SQLite's tokenizer would
    MemoryFact.objects.filter(pk=fact.pk).update(actor_key=BOB)
    assert held(ALICE, "cafe") == 0 and held(BOB, "cafe") == 1
    assert texts(ALICE, "cafe") == [] and texts(BOB, "café") == ["User drinks Café au lait."]
    MemoryFact.objects.filter(pk=fact.pk).update(text="User drinks tea.")
    assert held(BOB, "cafe") == 0 and held(BOB, "tea") == 1  # the contentless delete took the old terms
    MemoryFact.objects.filter(pk=fact.pk).delete()
    assert held(BOB, "tea") == 0 and texts(BOB, "tea") == []


def test_a_fact_holding_a_rarer_word_of_the_users_ranks_first(memory_config):  # noqa: F811
    memory_config.backend("sqlite_fts", max_hits=1)
    save(ALICE, "User buys jam.")
    for text in ("User drinks tea.", "User brews tea at noon.", "User orders tea online.", "User spilt tea."):
        save(ALICE, text)
    for n in range(6):
        save(BOB, f"User makes jam batch {n}.")  # bob's jam does not make alice's common
    # three-letter words: no prefixes, so only the words' weights put the older jam fact above the newer tea ones
    assert texts(ALICE, "tea jam") == ["User buys jam."]


def test_facts_holding_the_same_words_come_newest_first(memory_config):  # noqa: F811
    memory_config.backend("sqlite_fts", max_hits=1)
    save(ALICE, "User likes tea.")
    save(ALICE, "User likes tea with oat milk and honey in the mornings before work.")
    # the same weight: the newer fact, however long (bm25 put the shorter first)
    assert texts(ALICE, "tea") == ["User likes tea with oat milk and honey in the mornings before work."]


def test_the_weights_total_is_the_number_of_facts_the_index_holds(memory_config):  # noqa: F811
    from django.db import connection

    from plugins_app.agent.memory.backends import FtsBackend, fts5_varint
    memory_config.backend("sqlite_fts")
    assert fts5_varint(bytes([0x05])) == 5 and fts5_varint(bytes([0x82, 0x2C])) == 300
    assert fts5_varint(bytes([0x81, 0x80, 0x00])) == 16384 and fts5_varint(bytes([0xFF] * 8 + [0x01])) == 2 ** 64 - 255
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's full-text table")
    for n in range(130):  # past one byte of varint
        save(ALICE if n % 3 else BOB, f"User saved fact number {n} about tea.")
    MemoryFact.objects.filter(actor_key=BOB).first().delete()
    held, total = FtsBackend().counts(ALICE, ["tea", "coffee"])
    assert total == MemoryFact.objects.count() == 129
    assert held == {"tea": MemoryFact.objects.filter(actor_key=ALICE).count()}


def test_the_three_rankings_come_from_the_arms_each_candidate_matched():
    from plugins_app.agent.memory.backends import FtsBackend
    arms = [('"tea"', "tea", 1.0), ('"kettle"', "kettle", 1.0), ('"kett"*', "kettle", 0.5)]
    found = [(7, 0b011), (6, 0b110), (5, 0b100), (4, 0b001)]  # best first, with the arms each matched
    any_word, every_word, prefix = FtsBackend.rankings(arms, found)
    assert any_word == [7, 6, 4]  # 5 matched only the prefix: it holds neither word
    assert every_word == [7]
    assert prefix == [6, 5]
    one_word = [('"tea"', "tea", 1.0)]
    assert FtsBackend.rankings(one_word, [(3, 1), (2, 1)]) == [[3, 2]]  # no "every word" ranking for one word


def test_bob_never_recalls_alices_pinned_or_core_facts(backend):
    """The user's own pinned and core facts come whatever the text (on PostgreSQL from the search's own
    call): never another user's, whoever holds more."""
    for n in range(3):
        services.fact_pin(actor_key=ALICE, fact_id=save(ALICE, f"User's pinned tea note {n}.").pk)
        save(ALICE, f"User's core tea fact {n}.", tier="core")
    bob_pinned = save(BOB, "User's coffee is black.")
    services.fact_pin(actor_key=BOB, fact_id=bob_pinned.pk)
    save(BOB, "User's name is Bob.", tier="core")
    assert texts(BOB, "what tea notes and facts do I have?") == ["User's coffee is black.", "User's name is Bob."]
    assert set(texts(ALICE, "weather on mars")) == {f"User's {kind} {n}." for kind in ("pinned tea note", "core tea fact")
                                                    for n in range(3)}


def test_of_facts_tied_on_the_same_words_the_newest_are_recalled(memory_config):  # noqa: F811
    """More facts holding the words than the search reads (twice its candidates): the newest of them, as
    the tie-break orders them before the limit, not the oldest."""
    memory_config.backend("sqlite_fts", max_hits=5)
    for n in range(120):
        save(ALICE, f"User keeps tea tin {n}.")
    assert texts(ALICE, "tea tin") == [f"User keeps tea tin {n}." for n in range(119, 114, -1)]


def test_a_prefix_matches_the_terms_it_begins_and_not_the_next_one_up(memory_config):  # noqa: F811
    """"teas" searches its prefix "tea": "tea" and "teak" begin with it, "teb" (the range's upper end,
    the prefix with its last letter's successor) does not."""
    memory_config.backend("sqlite_fts")
    save(ALICE, "User wrote teb.")
    save(ALICE, "User likes green tea.")
    save(ALICE, "User owns a teak bench.")
    assert sorted(texts(ALICE, "teas?")) == ["User likes green tea.", "User owns a teak bench."]


# words of 6 letters, each its own prefix of 4 ("bcwa" for "bcward"), none a word of the facts below but one
ARM_WORDS = [f"{a}{b}ward" for a in "bcdfghjklmnp" for b in "bcdfghjklmnp" if a != b][:80]


def test_a_message_of_more_words_than_the_arms_searches_the_first_of_them_and_then_their_prefixes(
        memory_config):  # noqa: F811
    """Pasted identifiers (test names, code) split at their underscores into many words: the search looks
    for the first ARMS (63) of them, then as many of their prefixes, in order, as there is room for; the
    turn is answered either way (past 63, the arms' bits no longer fit a signed 64-bit integer)."""
    memory_config.backend("sqlite_fts")
    save(ALICE, f"User's test checks {ARM_WORDS[62]}.")  # the 63rd word
    save(ALICE, f"User's other test checks {ARM_WORDS[63]}.")  # the 64th: not searched
    save(ALICE, f"User's third test checks {ARM_WORDS[0][:4]}xy.")  # the first word's prefix: no room for it
    # twelve identifiers of six parts: 72 words (keywords() keeps twelve of a message's words)
    pasted = " ".join("_".join(ARM_WORDS[i * 6:i * 6 + 6]) for i in range(12))
    assert texts(ALICE, pasted) == [f"User's test checks {ARM_WORDS[62]}."]
    # 40 words (eight identifiers of five): room for 23 prefixes, the first 23 words'
    save(ALICE, f"User's prefix test checks {ARM_WORDS[22][:4]}xy.")
    save(ALICE, f"User's last prefix test checks {ARM_WORDS[23][:4]}xy.")
    pasted = " ".join("_".join(ARM_WORDS[i * 5:i * 5 + 5]) for i in range(8))
    assert texts(ALICE, pasted) == [f"User's prefix test checks {ARM_WORDS[22][:4]}xy.",
                                    f"User's third test checks {ARM_WORDS[0][:4]}xy."]
