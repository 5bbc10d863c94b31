"""`manage.py rules test|status|import|export` and `manage.py firewall workspace approve|revoke|status`."""
from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from rules_app import engine
from rules_app.models import Rule, RuleSet, WorkspaceTrust

RULES = '''
[[rules]]
name = "ignore-spam"
priority = 100
decision = "Ignore"
match = { field = "text", contains_any = ["unsubscribe", "you won the lottery"] }

[[rules]]
name = "no-spoken-payments"
priority = 150
decision = "Ignore"
[rules.match]
all_of = [ { field = "input_mode", equals = "voice" }, { field = "text", contains_any = ["payment"] } ]

[[rules]]
name = "vip"
priority = 300
decision = "PassToDefaultAgent"
[rules.match]
all_of = [ { field = "channel", equals = "slack" }, { field = "user_id", equals = "U1" },
           { field = "conversation_id", equals = "C9" } ]

[[rules]]
name = "groups"
priority = 120
decision = "Ignore"
match = { field = "source_type", equals = "group" }

[[rules]]
name = "digest"
priority = 10
match = { field = "text", starts_with = "digest" }
[rules.decision.StartWorkflow]
workflow = "digest"
inject_context = true

[[rules]]
name = "remember"
match = { field = "text", starts_with = "remember" }
decision = { RunNativeAction = { action = "extract_memory" } }
'''


def run(*args) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


@pytest.fixture
def rules_file(tmp_path):
    path = tmp_path / "elsewhere.toml"
    path.write_text(RULES)
    return path


@pytest.mark.parametrize("args,line", [
    (["please Unsubscribe"], '[dry-run] matched rule "ignore-spam"'),
    (["hello"], '[dry-run] no rule matched for: "hello"'),
    (["a payment", "--input-mode", "voice"], '[dry-run] matched rule "no-spoken-payments"'),
    (["a payment"], '[dry-run] no rule matched for: "a payment"'),
    (["unsubscribe", "--channel", "slack", "--user-id", "U1", "--conversation-id", "C9"],
     '[dry-run] matched rule "vip"'),
    (["unsubscribe", "--channel", "slack", "--user-id", "U1"], '[dry-run] matched rule "ignore-spam"'),
    (["hi", "--source-type", "group"], '[dry-run] matched rule "groups"'),
    (["hi", "--source-type", ""], '[dry-run] no rule matched for: "hi"'),
])
def test_rules_test_with_a_file_tests_every_field(site, rules_file, no_cron, args, line):
    out, _ = run("rules", "test", *args, "--rules", str(rules_file))
    assert out.splitlines()[0] == line


def test_rules_test_uses_the_rules_in_force(site, no_cron):
    site.rules(RULES)
    assert run("rules", "test", "unsubscribe")[0].strip() == '[dry-run] matched rule "ignore-spam"'
    assert run("rules", "test", "hello")[0].strip() == '[dry-run] no rule matched for: "hello"'


def test_rules_test_explain_says_which_conditions_held(site, rules_file):
    out, _ = run("rules", "test", "unsubscribe", "--rules", str(rules_file), "--explain")
    assert 'rule "ignore-spam" decides: Ignore' in out
    assert '  [x] text contains any of ["unsubscribe", "you won the lottery"]' in out


def test_rules_test_with_a_broken_file_is_an_error(site, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[rules]]\nname = 'x'\n")
    with pytest.raises(CommandError, match="missing field `match`"):
        run("rules", "test", "x", "--rules", str(bad))


def test_rules_test_drops_what_the_daemon_drops(site, rules_file, fake_cron):
    out, _ = run("rules", "test", "digest", "--rules", str(rules_file))
    assert out.strip() == '[dry-run] no rule matched for: "digest"'
    fake_cron.jobs["digest"] = None
    out, _ = run("rules", "test", "digest", "--rules", str(rules_file))
    assert out.strip() == '[dry-run] matched rule "digest"'


def test_rules_status(site, no_cron):
    path = site.rules(RULES + '\n[[rules]]\nname = "bad"\nmatch = { always = true }\n'
                      'decision = { RunNativeAction = { action = "nope" } }\n')
    out, _ = run("rules", "status")
    assert "rules in force: 6" in out
    assert f"rules file: {path} (loaded, 6 rules, on_error = open)" in out
    assert "rule dropped (rule=bad, reason=unknown native action 'nope'" in out
    assert "last load error: -" in out


def test_rules_status_shows_the_load_error(site):
    site.rules("[[rules]]\nname = 'x'\n")
    out, _ = run("rules", "status")
    assert "rules in force: 0" in out and "(failed, 0 rules" in out and "missing field `match`" in out


def test_import_then_export_round_trips(site, rules_file, no_cron):
    out, _ = run("rules", "import", str(rules_file))
    assert out.strip() == "imported 6 rules into rule set 'admin'"
    rs = RuleSet.objects.get(name="admin")
    assert rs.source == "admin" and rs.rule_count == 6 and rs.version == 1
    exported, _ = run("rules", "export")
    original = engine.parse_rules(RULES, check=False)
    again = engine.parse_rules(exported, check=False)
    assert [(r.name, r.priority, r.decision, r.condition.describe()) for r in again.rules] == \
        [(r.name, r.priority, r.decision, r.condition.describe()) for r in original.rules]
    probe = engine.MessageFacts(text="a payment", input_mode="voice", channel="web")
    assert again.ruleset.evaluate(probe).rule.name == "no-spoken-payments"
    # importing again replaces the set
    run("rules", "import", str(rules_file))
    assert Rule.objects.filter(ruleset=rs).count() == 6


def test_import_refuses_a_broken_file_and_changes_nothing(site, rules_file, tmp_path):
    run("rules", "import", str(rules_file))
    bad = tmp_path / "dup.toml"
    bad.write_text('[[rules]]\nname = "a"\ndecision = "Ignore"\nmatch = { always = true }\n' * 2)
    with pytest.raises(CommandError, match="duplicate rule name `a`"):
        run("rules", "import", str(bad))
    assert Rule.objects.count() == 6


@pytest.mark.parametrize("empty", ["", "\n# the rules\n"], ids=["nothing", "comments-alone"])
def test_import_refuses_an_empty_file_and_changes_nothing(site, rules_file, tmp_path, empty):
    """A file caught half-way through a write must not empty the admin set; `rules = []` does that."""
    run("rules", "import", str(rules_file))
    f = tmp_path / "empty.toml"
    f.write_text(empty)
    with pytest.raises(CommandError, match="the file is empty; nothing was changed"):
        run("rules", "import", str(f))
    assert Rule.objects.count() == 6
    f.write_text("rules = []\n")
    assert run("rules", "import", str(f))[0].strip() == "imported 0 rules into rule set 'admin'"
    assert Rule.objects.count() == 0


def test_an_empty_set_exported_imports_back_as_empty(site, rules_file, tmp_path):
    """rules.md: the export "parses back to the same rules"; an empty set exported as a comment alone was
    refused by import as a file caught half-way through a write."""
    f = tmp_path / "none.toml"
    f.write_text("rules = []\n")
    run("rules", "import", str(f))
    exported, _ = run("rules", "export")
    assert "rules = []" in exported and not engine.parse_rules(exported, check=False).rules
    run("rules", "import", str(rules_file))
    f.write_text(exported)
    assert run("rules", "import", str(f))[0].strip() == "imported 0 rules into rule set 'admin'"
    assert Rule.objects.count() == 0


def test_import_skips_rules_the_engine_would_drop(site, tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('[[rules]]\nname = "ok"\ndecision = "Ignore"\nmatch = { always = true }\n'
                 '[[rules]]\nname = "bad"\nmatch = { always = true }\n'
                 'decision = { RunNativeAction = { action = "nope" } }\n')
    out, err = run("rules", "import", str(f))
    assert out.strip() == "imported 1 rules into rule set 'admin'"
    assert "rule skipped (rule=bad, reason=unknown native action 'nope'" in err


def test_import_into_the_file_set_is_refused(site):
    site.rules(RULES)
    from rules_app.runtime import runtime
    runtime.ruleset()
    with pytest.raises(CommandError, match="read-only"):
        run("rules", "import", str(site.ws / "rules.toml"), "--set", "rules.toml")


def test_export_the_file_set_and_an_unknown_set(site):
    site.rules(RULES)
    from rules_app.runtime import runtime
    runtime.ruleset()
    out, _ = run("rules", "export", "--set", "rules.toml")
    assert len(engine.parse_rules(out, check=False).rules) == 6
    with pytest.raises(CommandError, match="no rule set 'nope'"):
        run("rules", "export", "--set", "nope")


def test_export_escapes_strings(site):
    from rules_app import services
    rs = services.rule_set_admin_ensure()
    text = 'quote " back\\slash \u00e9 \U0001f600 tab\t del\x7f'
    services.rule_save(rule=Rule(ruleset=rs, name="odd name", decision="Ignore",
                                 condition={"field": "text", "equals": text}))
    out, _ = run("rules", "export")
    [rule] = engine.parse_rules(out, check=False).rules
    assert rule.name == "odd name" and rule.condition.value == text


def test_firewall_workspace_approve_revoke_status(site):
    key = str(site.ws.resolve())
    assert f"Workspace {key} is not trusted" in run("firewall", "workspace", "status")[0]
    assert run("firewall", "workspace", "approve")[0].startswith(f"Workspace {key} is trusted")
    assert WorkspaceTrust.objects.get().path == key
    assert f"Workspace {key} is trusted (approved" in run("firewall", "workspace", "status")[0]
    assert "no longer trusted" in run("firewall", "workspace", "revoke")[0]
    assert "was not trusted" in run("firewall", "workspace", "revoke")[0]
    assert "is not trusted" in run("firewall", "workspace", "status")[0]
    run("firewall", "workspace", "approve", "--workspace", str(site.home))
    assert WorkspaceTrust.objects.filter(path=str(site.home.resolve()), revoked_at=None).exists()


def test_firewall_before_the_first_migrate_says_to_migrate_in_one_line(tmp_path):
    """An operator following the docs may trust the workspace first: it was a "no such table" traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DJANGO_", "PYTEST", "UGENT_")) and k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(UGENT_VAR_DIR=str(tmp_path / "var"), UGENT_WORKSPACE=str(tmp_path / "ws"))
    out = subprocess.run([sys.executable, "manage.py", "firewall", "workspace", "approve"], env=env,
                         cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == ("CommandError: the database has no rules_app_workspacetrust table yet: "
                                  "run `python manage.py migrate` first")
