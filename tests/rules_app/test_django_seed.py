"""Every example of the rule engine spec, through the one message path (the chat API for web)."""
from __future__ import annotations

import logging

import pytest

from channels_app.models import Event, Message, Receipt, Turn
from rules_app import engine
from tests.rules_app.conftest import answer, submit
from tests.support.http import chat

QUICK_START = """
# Drop obvious spam before it reaches the agent.
[[rules]]
name = "ignore-spam"
priority = 100
decision = "Ignore"
match = { field = "text", contains_any = ["unsubscribe", "you won the lottery"] }

[[rules]]
name = "default"
priority = 0
decision = "PassToDefaultAgent"
match = { always = true }
"""

CHANNEL_FILTER = """
[[rules]]
name = "channel-allowlist"
priority = 200
decision = "Ignore"

[rules.match]
not = { any_of = [
  { field = "channel", equals = "slack" },
  { field = "channel", equals = "discord" },
] }
"""

VIP = """
[[rules]]
name = "vip-through"
priority = 300
decision = "PassToDefaultAgent"

[rules.match]
all_of = [
  { field = "channel", equals = "slack" },
  { field = "user_id", equals = "U12345678" },
]

[[rules]]
name = "slack-closed"
priority = 200
decision = "Ignore"
match = { field = "channel", equals = "slack" }
"""

GROUPS = """
[[rules]]
name = "groups-need-a-trigger"
priority = 150
decision = "Ignore"

[rules.match]
all_of = [
  { field = "source_type", equals = "group" },
  { not = { any_of = [
    { field = "text", starts_with = "/ask" },
    { field = "text", contains_any = ["#agent"] },
  ] } },
]
"""

VOICE = """
[[rules]]
name = "no-spoken-payments"
priority = 150
decision = "Ignore"

[rules.match]
all_of = [
  { field = "input_mode", equals = "voice" },
  { field = "text", contains_any = ["transfer", "payment"] },
]
"""

DECISIONS = """
[[rules]]
name = "digest"
priority = 50
match = { field = "text", starts_with = "digest" }

[rules.decision.StartWorkflow]
workflow = "digest"         # a cron job with rule_trigger = true
inject_context = true       # optional, default false

[[rules]]
name = "remember"
priority = 40
match = { field = "text", starts_with = "remember this" }

[rules.decision.RunNativeAction]
action = "extract_memory"   # or compact_conversation; neither takes params

[[rules]]
name = "compact"
priority = 30
match = { field = "text", equals = "compact please" }

[rules.decision.RunNativeAction]
action = "compact_conversation"
"""


def echo(text, history=0):
    return f"echo: {text} (history={history})"


# --- Quick Start ---------------------------------------------------------------------------

def test_spam_is_ignored_and_answered_with_its_receipt_and_events(site, tcast):
    site.rules(QUICK_START)
    resp = chat(tcast.alice, "Please UNSUBSCRIBE me", conversation_id="c1")
    assert answer(resp) == "rule engine: message ignored"
    receipt = Receipt.objects.get()
    assert receipt.state == "refused" and receipt.answer == "rule engine: message ignored"
    turn = Turn.objects.get()
    assert turn.state == "refused" and resp["x-ugent-turn-id"] == turn.turn_id
    types = list(Event.objects.filter(turn=turn).order_by("id").values_list("type", flat=True))
    assert types == ["ugent.user_message", "turn.delta", "turn.completed"]
    done = Event.objects.get(turn=turn, type="turn.completed")
    assert done.data["decided_by"] == "ignore-spam" and done.data["state"] == "refused"
    assert list(Message.objects.filter(turn=turn).order_by("id").values_list("role", "content")) == [
        ("user", "Please UNSUBSCRIBE me"), ("assistant", "rule engine: message ignored")]


def test_spam_ignored_in_a_stream_too(site, tcast):
    from tests.support.http import answer_text, body_bytes, parse_sse
    site.rules(QUICK_START)
    resp = chat(tcast.alice, "you won the lottery!", stream=True)
    frames = parse_sse(body_bytes(resp))
    assert answer_text(frames) == "rule engine: message ignored"
    assert frames[-1]["data"] == "[DONE]"


def test_other_messages_reach_the_agent(site, tcast):
    site.rules(QUICK_START)
    assert answer(chat(tcast.alice, "hello there")) == echo("hello there")
    assert Receipt.objects.get().state == "completed"


# --- Channel filtering ---------------------------------------------------------------------

def test_channel_allowlist_ignores_the_web_workspace(site, tcast):
    site.rules(CHANNEL_FILTER)
    assert answer(chat(tcast.alice, "hi")) == "rule engine: message ignored"


def test_channel_allowlist_lets_slack_and_discord_through_and_ignores_line(site, tcast):
    site.rules(CHANNEL_FILTER)
    assert submit("hi", channel="slack").stopped is None
    assert submit("hi", channel="discord").stopped is None
    stop = submit("hi", channel="line").stopped
    assert stop.answer == "rule engine: message ignored" and stop.decided_by == "channel-allowlist"
    assert Receipt.objects.filter(state="refused").count() == 1


# --- Per-user VIP routing ------------------------------------------------------------------

def test_vip_passes_and_everyone_else_on_slack_is_ignored(site, tcast):
    site.rules(VIP)
    assert submit("hi", user_id="U12345678").stopped is None
    assert submit("hi", user_id="u12345678", conversation_id="C2").stopped is None  # equals ignores case
    stop = submit("hi", user_id="U99", conversation_id="C3").stopped
    assert stop.decided_by == "slack-closed"
    assert answer(chat(tcast.alice, "web is not slack")) == echo("web is not slack")


# --- Boolean logic -------------------------------------------------------------------------

@pytest.mark.parametrize("text,source_type,ignored", [
    ("what is the weather", "group", True),
    ("/ask what is the weather", "group", False),
    ("/ASK upper case", "group", False),
    ("hey #Agent help", "group", False),
    ("what is the weather", "user", False),
    ("what is the weather", "room", False),
])
def test_groups_need_a_trigger(site, tcast, text, source_type, ignored):
    site.rules(GROUPS)
    stop = submit(text, channel="line", source_type=source_type).stopped
    assert (stop is not None) == ignored
    if ignored:
        assert stop.answer == "rule engine: message ignored"


# --- Voice ---------------------------------------------------------------------------------

def test_spoken_payments_are_ignored_typed_ones_are_not(site, tcast):
    site.rules(VOICE)
    assert answer(chat(tcast.alice, "make a Payment", ugent_input_mode="voice")) == "rule engine: message ignored"
    assert answer(chat(tcast.bob, "make a payment")) == echo("make a payment")
    assert answer(chat(tcast.carol, "read my mail", ugent_input_mode="voice")) == echo("read my mail")


# --- StartWorkflow -------------------------------------------------------------------------

def test_start_workflow_without_cron_says_cron_is_not_running(site, tcast, no_cron):
    site.rules(DECISIONS)
    resp = chat(tcast.alice, "digest my week")
    assert answer(resp) == "Workflow 'digest' could not start: cron is not running here."
    assert Receipt.objects.get().state == "completed"


def test_start_workflow_calls_cron_with_the_sender_context(site, tcast, fake_cron):
    fake_cron.jobs["digest"] = None
    site.rules(DECISIONS)
    assert answer(chat(tcast.alice, "Digest please", ugent_disable_memory_write=True)) == \
        "Started workflow 'digest'. Its result goes to the workflow's destinations."
    [call] = fake_cron.calls
    assert call["workflow"] == "digest" and call["inject_context"] is True
    assert call["text"] == "Digest please" and call["actor"] == "web:alice"
    assert call["limits"]["disable_memory_write"] is True


def test_start_workflow_refused_when_the_job_opted_out_after_load(site, tcast, fake_cron):
    fake_cron.jobs["digest"] = None
    site.rules(DECISIONS)
    assert answer(chat(tcast.alice, "digest")).startswith("Started workflow 'digest'")
    fake_cron.jobs["digest"] = "the job is disabled"
    assert answer(chat(tcast.bob, "digest")) == "Workflow 'digest' could not start: the job is disabled."
    assert len(fake_cron.calls) == 1


def test_a_workflow_that_is_not_a_rule_triggered_job_is_dropped_as_it_loads(site, tcast, fake_cron, rules_log):
    site.rules(DECISIONS.replace('workflow = "digest"', 'workflow = "nightly"'))
    assert answer(chat(tcast.alice, "digest")) == echo("digest")
    assert ("rule dropped (rule=digest, reason=workflow 'nightly' is not a cron job with rule_trigger = true)"
            in rules_log.messages)
    assert not fake_cron.calls
    assert answer(chat(tcast.bob, "remember this: tea")) == engine.MEMORY_BACKEND_NEEDED  # the rest loaded


def test_a_crashing_cron_start_answers_could_not_start(site, tcast, fake_cron):
    fake_cron.jobs["digest"] = None

    def boom(**kw):
        raise RuntimeError("broker down")
    fake_cron.workflow_start = boom
    site.rules(DECISIONS)
    assert answer(chat(tcast.alice, "digest")) == \
        "Workflow 'digest' could not start: it failed to start; the log says why."
    assert Receipt.objects.get().state == "completed"


# --- RunNativeAction -----------------------------------------------------------------------

def test_extract_memory_needs_a_memory_backend(site, tcast):
    site.rules(DECISIONS)
    assert answer(chat(tcast.alice, "remember this: I like tea")) == \
        "Saving to memory needs the sqlite_fts or lance_embedded memory backend."


def test_extract_memory_refusals_in_the_spec_order(site, tcast):
    site.rules(DECISIONS)
    anonymous = {"key": tcast.keys["app"]}
    # memory writes off comes first, even for a sender who is not identified
    assert answer(chat(anonymous, "remember this", ugent_disable_memory_write=True)) == \
        "Memory writes are off for this conversation."
    assert answer(chat(tcast.alice, "remember this", ugent_input_mode="voice")) == \
        "Memory writes are off for this conversation."
    assert answer(chat(anonymous, "remember this")) == \
        "Memory cannot be saved for a sender who is not identified."
    assert answer(chat(tcast.carol, "remember this")) == \
        "Saving to memory needs the sqlite_fts or lance_embedded memory backend."


def test_extract_memory_whose_extraction_fails_says_so_and_logs(site, tcast, rules_log, monkeypatch):
    from plugins_app.agent.memory import services as memory

    def broken(text):
        raise RuntimeError("extractor broke")
    monkeypatch.setattr(memory, "extract_facts", broken)
    site.config('[memory]\nbackend = "sqlite_fts"\n')
    site.rules(DECISIONS)
    assert answer(chat(tcast.alice, "remember this")) == "Saving to memory failed; the agent's log says why."
    assert any("extract_memory failed" in m for m in rules_log.messages)


def test_voice_memory_write_false_covers_a_conversation_that_had_voice(site, tcast):
    site.config("[voice]\nmemory_write = false\n")
    site.rules(DECISIONS)
    chat(tcast.alice, "spoken hello", conversation_id="v1", ugent_input_mode="voice")
    assert answer(chat(tcast.alice, "remember this", conversation_id="v1")) == \
        "Memory writes are off for this conversation."
    assert answer(chat(tcast.alice, "remember this", conversation_id="typed")) == engine.MEMORY_BACKEND_NEEDED


def test_compact_on_the_first_message_has_nothing_to_compact(site, tcast):
    site.rules(DECISIONS)
    assert answer(chat(tcast.alice, "compact please", conversation_id="k1")) == "There is nothing to compact yet."
    assert not Message.objects.filter(hidden=True).exists()


def test_compact_hides_older_messages_keeps_the_last_exchanges_and_stores_a_summary(site, tcast, settings):
    settings.UGENT_COMPACT_KEEP_EXCHANGES = 2
    site.rules(DECISIONS)
    for i in range(5):
        chat(tcast.alice, f"question {i}. with more words", conversation_id="k1")
    resp = chat(tcast.alice, "COMPACT PLEASE", conversation_id="k1")
    assert answer(resp) == ("Compacted the conversation: 6 earlier messages summarised; "
                            "the last 2 exchanges kept as they are.")
    hidden = list(Message.objects.filter(hidden=True).order_by("id").values_list("content", flat=True))
    assert hidden[0] == "question 0. with more words" and len(hidden) == 6
    summary = Message.objects.get(role="system")
    assert summary.content.splitlines()[0] == "Summary of the earlier conversation (6 messages compacted):"
    # the hub's compaction, on the conversation's activity stream like every other
    event = Event.objects.get(type="compaction.completed")
    assert event.data["trigger"] == "rule" and event.data["hidden"] == 6 and event.data["kept"] == 2
    assert event.data["summary_message_id"] == summary.pk and event.data["summarizer"] == "ugent-extractive"
    assert "- user: question 0." in summary.content
    visible_users = list(Message.objects.filter(hidden=False, role="user").order_by("id")
                         .values_list("content", flat=True))  # (in id order: PostgreSQL's own is a row's place)
    assert visible_users == ["question 3. with more words", "question 4. with more words", "COMPACT PLEASE"]
    # the next message's history no longer holds the hidden ones: the summary stands in for them
    # (1 summary + the 6 visible messages)
    assert answer(chat(tcast.alice, "after", conversation_id="k1")) == echo("after", history=7)
    from tests.support.scripted import CALLS
    assert CALLS[-1]["messages"][0] == ("system", summary.content)


def test_compact_with_too_little_history_has_nothing_to_compact(site, tcast):
    site.rules(DECISIONS)
    chat(tcast.alice, "one", conversation_id="k2")
    assert answer(chat(tcast.alice, "compact please", conversation_id="k2")) == "There is nothing to compact yet."


# --- Rules refused as they load ------------------------------------------------------------

def test_bad_action_and_action_params_are_dropped_the_rest_loads(site, tcast, rules_log):
    site.rules(QUICK_START + """
[[rules]]
name = "bad-action"
match = { always = true }
priority = 500
[rules.decision.RunNativeAction]
action = "memory_compaction"

[[rules]]
name = "with-params"
match = { always = true }
priority = 400
[rules.decision.RunNativeAction]
action = "compact_conversation"
params = { keep = 2 }
""")
    assert answer(chat(tcast.alice, "hello")) == echo("hello")
    assert answer(chat(tcast.bob, "unsubscribe")) == "rule engine: message ignored"
    assert ("rule dropped (rule=bad-action, reason=unknown native action 'memory_compaction'; the actions are "
            "compact_conversation and extract_memory)") in rules_log.messages
    assert any(m.startswith("rule dropped (rule=with-params, reason=") for m in rules_log.messages)
    drops = [r for r in rules_log.records if r.getMessage().startswith("rule dropped")]
    assert all(r.levelno == logging.ERROR for r in drops)


@pytest.mark.parametrize("broken", [
    # a key in the wrong table: decision after the [rules.match] header
    '[[rules]]\nname = "x"\n[rules.match]\nfield = "text"\nequals = "a"\ndecision = "Ignore"\n',
    '[[rules]]\nname = "x"\ndecision = "Ignore"\nmatch = { field = "text", matches = "a" }\n',
    '[[rules]]\nname = "x"\ndecision = "Ignore"\nmatch = { always = true }\n'
    '[[rules]]\nname = "x"\ndecision = "Ignore"\nmatch = { always = true }\n',
    'this is not toml',
])
def test_a_refused_file_fails_open(site, tcast, rules_log, broken):
    site.rules(QUICK_START + "\n" + broken if broken != "this is not toml" else broken)
    assert answer(chat(tcast.alice, "unsubscribe")) == echo("unsubscribe")
    failed = [r for r in rules_log.records
              if r.getMessage().startswith("failed to load rule set — starting with empty rules (fail-open)")]
    assert failed and failed[0].levelno == logging.ERROR


def test_wrong_table_error_says_missing_field(site, tcast, rules_log):
    site.rules('[[rules]]\nname = "x"\n[rules.match]\nfield = "text"\nequals = "a"\ndecision = "Ignore"\n')
    chat(tcast.alice, "a")
    assert any("missing field `decision`" in m for m in rules_log.messages)


def test_enabled_false_leaves_a_rule_live(site, tcast):
    site.rules(QUICK_START.replace('name = "ignore-spam"', 'name = "ignore-spam"\nenabled = false'))
    assert answer(chat(tcast.alice, "unsubscribe")) == "rule engine: message ignored"


def test_on_error_closed_refuses_every_message(site, tcast, rules_log):
    site.config('[rules]\non_error = "closed"\n')
    site.rules("not toml at all")
    resp = chat(tcast.alice, "hello")
    assert answer(resp) == engine.CLOSED_ANSWER
    assert Receipt.objects.get().state == "refused"
    assert any(m.startswith(engine.LOG_FAILED_LOAD_CLOSED) for m in rules_log.messages)


# --- Where rules come from -----------------------------------------------------------------

def test_untrusted_workspace_file_is_skipped_with_a_warning_until_approved(site, tcast, rules_log):
    site.rules(QUICK_START, trusted=False)
    assert answer(chat(tcast.alice, "unsubscribe")) == echo("unsubscribe")
    assert any("not trusted yet" in m and "python manage.py firewall workspace approve" in m
               for m in rules_log.messages)
    site.approve()
    site.reset()
    assert answer(chat(tcast.bob, "unsubscribe")) == "rule engine: message ignored"


def test_dot_ugent_and_home_locations(site, tcast):
    site.write(QUICK_START, where=site.home / ".ugent")
    site.reset()
    assert answer(chat(tcast.alice, "unsubscribe")) == "rule engine: message ignored"  # home needs no trust
    site.approve()
    site.write(QUICK_START.replace("unsubscribe", "zzz"), where=site.ws / ".ugent")
    site.reset()
    assert answer(chat(tcast.bob, "unsubscribe")) == echo("unsubscribe")
    assert answer(chat(tcast.bob, "zzz", conversation_id="z")) == "rule engine: message ignored"


def test_rules_file_from_ugent_toml_is_relative_to_the_workspace(site, tcast, tmp_path):
    site.approve()
    site.write(QUICK_START, name="conf/my-rules.toml")
    site.config('[rules]\nfile = "conf/my-rules.toml"\n')
    site.write(QUICK_START.replace("unsubscribe", "never-this"))  # a discovered one is not used
    site.reset()
    assert answer(chat(tcast.alice, "unsubscribe")) == "rule engine: message ignored"


def test_no_file_means_no_rule_engine(site, tcast, rules_log):
    assert answer(chat(tcast.alice, "unsubscribe")) == echo("unsubscribe")
    assert "rule engine watch disabled" in rules_log.messages
