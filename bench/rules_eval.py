"""The rule engine's cost: 10,000 rules against 100,000 generated messages.

Prints messages/s and per-message p50/p99 for the indexed evaluation
(rules_app/index.py) beside the linear engine it must agree with (every rule
tried in order; on at most 2,000 of the messages, as it is slow), the compile time,
and the cost of accepting a message on the one path (receipt, turn, events; no
rule engine, no agent), all measured in the same run on a scratch SQLite database.

Usage: python bench/rules_eval.py [--rules 10000] [--messages 100000] [--baseline 300]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = ["order", "refund", "digest", "remember", "spam", "lottery", "invoice", "hello", "agent", "help",
         "transfer", "payment", "status", "report", "ticket", "urgent", "weekly", "price", "ship", "cancel"]
CHANNELS = ["web", "slack", "discord", "line", "telegram", "email"]


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def make_rules(n: int, rng: random.Random) -> str:
    out = []
    for i in range(n):
        kind = rng.randrange(5)
        w = rng.choice(WORDS) + str(rng.randrange(1000))  # rarely matches, so most rules are tried
        if kind == 0:
            cond = f'{{ field = "text", contains_any = ["{w}", "{rng.choice(WORDS)}{i}"] }}'
        elif kind == 1:
            cond = f'{{ field = "text", starts_with = "{w}" }}'
        elif kind == 2:
            cond = (f'{{ all_of = [ {{ field = "channel", equals = "{rng.choice(CHANNELS)}" }}, '
                    f'{{ field = "user_id", equals = "U{i}" }} ] }}')
        elif kind == 3:
            cond = (f'{{ any_of = [ {{ field = "source_type", equals = "room{i}" }}, '
                    f'{{ not = {{ field = "conversation_id", starts_with = "c" }} }} ] }}')
        else:
            cond = f'{{ all_of = [ {{ field = "input_mode", equals = "voice" }}, {{ field = "text", contains_any = ["{w}"] }} ] }}'
        out.append(f'[[rules]]\nname = "r{i}"\npriority = {rng.randrange(100)}\ndecision = "Ignore"\nmatch = {cond}\n')
    out.append('[[rules]]\nname = "default"\npriority = -1\ndecision = "PassToDefaultAgent"\nmatch = { always = true }\n')
    return "\n".join(out)


def bench_rules(n_rules: int, n_messages: int):
    from rules_app.engine import MessageFacts, parse_rules
    rng = random.Random(7)
    text = make_rules(n_rules, rng)
    t0 = time.perf_counter()
    ruleset = parse_rules(text, source="bench", check=False, log=False).ruleset
    load_s = time.perf_counter() - t0
    messages = [MessageFacts(text=" ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 12))),
                        channel=rng.choice(CHANNELS), source_type=rng.choice(["user", "group", "room"]),
                        user_id=f"U{rng.randrange(20000)}", conversation_id=f"c{rng.randrange(500)}",
                        input_mode=rng.choice([None, None, "voice"])) for _ in range(n_messages)]
    t0 = time.perf_counter()
    type(ruleset)(ruleset.rules)  # sort + index again, alone: the compile step
    index_s = time.perf_counter() - t0
    indexed = _measure("indexed", ruleset.evaluate, messages)
    linear = _measure("linear", ruleset.evaluate_linear, messages[: max(1, min(n_messages // 10, 2000))])
    sample = messages[:300]
    assert [ruleset.evaluate(m) for m in sample] == [ruleset.evaluate_linear(m) for m in sample]
    return load_s, index_s, indexed, linear


def _measure(label, evaluate, messages):
    lat = []
    step = max(1, len(messages) // 5)
    t0 = time.perf_counter()
    for i, msg in enumerate(messages):
        s = time.perf_counter()
        evaluate(msg)
        lat.append(time.perf_counter() - s)
        if (i + 1) % step == 0:
            print(f"  {label}: evaluated {i + 1}/{len(messages)}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    return len(messages) / wall, pct(lat, 50) * 1e3, pct(lat, 99) * 1e3


def bench_path(n: int):
    tmp = tempfile.mkdtemp(prefix="ugent-rules-bench-")
    os.environ.update({"UGENT_VAR_DIR": tmp, "DJANGO_SETTINGS_MODULE": "ugent_site.settings",
                       "UGENT_WORKSPACE": tmp})
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("REDIS_URL", None)
    import django
    django.setup()
    from unittest import mock

    from django.core.management import call_command

    from channels_app import hooks, services
    from channels_app.models import Caller
    from plugins_app.agent.models import AgentProfile
    call_command("migrate", verbosity=0)
    for name in ("routing", "rules"):
        hooks.unregister(name)
    caller = Caller.objects.create(name="bench", role="operator")
    AgentProfile.objects.create(name="p", provider="scripted", is_default=True)
    actor = services.actor_resolve(caller=caller, user="u")
    lat = []
    with mock.patch("channels_app.tasks.run_turn.delay"):
        for i in range(n + 20):
            s = time.perf_counter()
            services.message_submit(inbound=services.Submission(actor=actor, caller=caller, text=f"hi {i}",
                                                                    conversation_id="c1"))
            if i >= 20:
                lat.append(time.perf_counter() - s)
    return pct(lat, 50) * 1e3, pct(lat, 99) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rules", type=int, default=10000)
    ap.add_argument("--messages", type=int, default=100000)
    ap.add_argument("--baseline", type=int, default=300)
    args = ap.parse_args()
    print(f"rule engine: {args.rules} rules, {args.messages} messages", flush=True)
    load_s, index_s, (rate, p50, p99), (lrate, l50, l99) = bench_rules(args.rules, args.messages)
    base50, base99 = bench_path(args.baseline)
    print(f"\nload + compile          {load_s * 1e3:10.1f} ms   (of which sort + index {index_s * 1e3:.1f} ms)")
    print(f"evaluate, indexed       {rate:10.0f} msgs/s   p50 {p50:.4f} ms   p99 {p99:.4f} ms")
    print(f"evaluate, linear        {lrate:10.0f} msgs/s   p50 {l50:.4f} ms   p99 {l99:.4f} ms")
    print(f"indexed / linear        {rate / lrate:10.1f}x throughput")
    print(f"accept on the one path  (no rules, no agent)   p50 {base50:.3f} ms   p99 {base99:.3f} ms")
    print(f"indexed rules / path    p50 {p50 / base50:.3f}x   p99 {p99 / base99:.3f}x")

if __name__ == "__main__":
    main()
