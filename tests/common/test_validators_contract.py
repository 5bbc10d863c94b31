"""The four config-file validators speak one style: `<source>: <where>: <what>`, `where` the path.

Each is fed a wrong type, an unknown key and a missing required field. rules.toml and
routing.toml ignore keys they do not know (the rule engine seed: "keys the engine does not know
are ignored, so enabled = false leaves a rule live"), so for them the unknown key must load;
cron.toml and plugins.toml are strict and refuse it.
"""
import re

import pytest

from cron_app.tomlio import CronConfigError, parse_cron_toml
from plugins_app.channel.tomlio import PluginsFileError, plugins_parse
from rules_app.engine import RuleSetError, parse_rules
from rules_app.routing import RoutingError, parse_routing

pytestmark = pytest.mark.mode_free  # no database, Redis or run mode

LINE = re.compile(r"^(?:(?P<source>[\w.<>]+\.toml|<\w+>): )?(?P<where>[^:]+): (?P<what>.+)$")

RULE = '[[rules]]\nname = "ok"\ndecision = "Ignore"\nmatch = { always = true }\n'
ROUTE = '[[routes]]\nname = "ok"\nmatch = { always = true }\n'
JOB = "[[jobs]]\nid = 'ok'\n[[jobs.tasks]]\nid = 't'\nprompt = 'p'\n"
PLUGIN = 'schema_version = 1\n[[plugins]]\nid = "ok"\nkind = "channel-x"\ncommand = "w"\n'


def rules(text):
    return parse_rules(text, source="rules.toml", log=False)


def routing(text):
    return parse_routing(text, source="routing.toml")


def cron(text):
    return parse_cron_toml(text)


def plugins(text):
    return plugins_parse(text, source="plugins.toml")


REFUSED = [
    # wrong type
    (rules, RuleSetError, RULE + '[[rules]]\nname = "b"\npriority = "1"\ndecision = "Ignore"\nmatch = { always = true }\n',
     "rules[1] (b).priority", "expected an integer, found string"),
    (rules, RuleSetError, RULE + '[[rules]]\nname = "b"\ndecision = "Ignore"\n'
                                 'match = { any_of = [ { always = true }, { field = "text", equals = 3 } ] }\n',
     "rules[1] (b).match.any_of[1].equals", "expected a string, found integer"),
    (routing, RoutingError, ROUTE + '[[routes]]\nname = "b"\nmatch = { always = true }\ntags = "x"\n',
     "routes[1] (b).tags", "expected an array of strings, found string"),
    (cron, CronConfigError, JOB + "[[jobs]]\nid = 'b'\nmax_concurrent_runs = '2'\n",
     "jobs[1] (b).max_concurrent_runs", "expected an integer, found string"),
    (plugins, PluginsFileError, PLUGIN + '[plugins.limits]\nheartbeat_secs = "30"\n',
     "plugins[0] (ok).limits.heartbeat_secs", "expected a number, found string"),
    # unknown key (strict files only)
    (cron, CronConfigError, JOB + "[[jobs.destinations]]\nchannel = 's'\nconversation = 'c'\nthread = 't'\n",
     "jobs[0] (ok).destinations[0].thread", "unknown field"),
    (plugins, PluginsFileError, PLUGIN + "[plugins.routing]\nworkspaces = '/w'\n",
     "plugins[0] (ok).routing.workspaces", "unknown field"),
    # missing required field: reported at the table that lacks it
    (rules, RuleSetError, RULE + '[[rules]]\nname = "b"\nmatch = { always = true }\n',
     "rules[1] (b)", "missing field `decision`"),
    (rules, RuleSetError, RULE + '[[rules]]\nname = "b"\nmatch = { always = true }\n[rules.decision.StartWorkflow]\n',
     "rules[1] (b).decision.StartWorkflow", "missing field `workflow`"),
    (routing, RoutingError, ROUTE + '[[routes]]\nname = "b"\nmatch = { always = true }\nrewrite = [ { pattern = "a" } ]\n',
     "routes[1] (b).rewrite[0]", "missing field `replace`"),
    (cron, CronConfigError, JOB + "[[jobs.tasks]]\nid = 'u'\n",
     "jobs[0] (ok).tasks[1] (u)", "missing field `prompt`"),
    (plugins, PluginsFileError, PLUGIN + '[[plugins]]\nid = "two"\n',
     "plugins[1] (two)", "missing field `kind`"),
    (plugins, PluginsFileError, PLUGIN + '[[plugins]]\nid = "two"\nkind = "channel-x"\n',
     "plugins[1] (two).command", "must be set: 'channel-x' is not a kind UGENT ships or an installed package registers"),
]


@pytest.mark.parametrize("parse, error, text, where, what", REFUSED,
                         ids=[f"{r[0].__name__}:{r[3]}" for r in REFUSED])
def test_a_refusal_reads_where_then_what(parse, error, text, where, what):
    with pytest.raises(error) as exc:
        parse(text)
    line = LINE.match(str(exc.value))
    assert line, str(exc.value)
    assert (line["where"], line["what"]) == (where, what)


def test_the_lenient_files_ignore_an_unknown_key_as_the_seed_says():
    result = rules(RULE.replace('name = "ok"', 'name = "ok"\nenabled = false'))
    assert [r.name for r in result.rules] == ["ok"]
    assert len(routing(ROUTE + 'colour = "red"\n')) == 1


@pytest.mark.parametrize("parse, text", [
    (cron, "[[jobs]]\nid = 'a'\nenabled = 1\n"),
    (plugins, PLUGIN.replace('command = "w"', 'command = "w"\nenabled = 0')),
    (rules, '[[rules]]\nname = "x"\ndecision = "Ignore"\nmatch = { always = 1 }\n'),
])
def test_an_integer_is_not_read_as_a_boolean(parse, text):
    with pytest.raises(ValueError if parse in (cron, plugins) else RuleSetError) as exc:
        parse(text)
    assert str(exc.value).endswith("expected a boolean, found integer")


def test_a_toml_error_keeps_its_line_and_column():
    with pytest.raises(RuleSetError) as exc:
        rules('[[rules]]\nname = "x\n')
    assert "(at line 2, column" in str(exc.value)
