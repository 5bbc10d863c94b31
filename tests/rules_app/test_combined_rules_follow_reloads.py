"""The rules a process enforces are the holder's current ones after every reload. The file's rules combined
with the admin's were cached under id(the file's rule set); two reloads between two messages could build the
new set at the address of a freed one, and the old combination came back: rules a process no longer had
(or lacked) were enforced until the next reload. (Found by a review; 2 stale of 200 before the fix.)"""
from __future__ import annotations

from rules_app.runtime import runtime
from tests.rules_app.conftest import site  # noqa: F401


def rule(name: str, text: str) -> str:
    return f'[[rules]]\nname = "{name}"\ndecision = "Ignore"\nmatch = {{ field = "text", equals = "{text}" }}\n'


def test_the_combined_rules_follow_the_holder_through_reloads_between_messages(site, settings):  # noqa: F811
    settings.UGENT_RULES_WATCH = False
    site.rules(rule("r0", "x0"))
    runtime.watch = False
    holder = runtime.ensure()
    stale = []
    for i in range(1, 200):
        runtime.ruleset()  # a message
        site.write(rule(f"r{i}a", f"a{i}"))
        holder.reload_once()
        site.write(rule(f"r{i}", f"x{i}"))
        holder.reload_once()
        got = [r.name for r in runtime.ruleset().rules]
        if got != [r.name for r in holder.ruleset.rules]:
            stale.append((i, got))
    assert stale == []
