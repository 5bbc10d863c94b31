"""The tool loop's cost (issue #13, item 6): a turn whose engine calls a no-op tool 5 times, one call per
step, beside a plain turn that streams the same tokens without tools, in one run.

In-process, on a scratch SQLite database: the chat endpoint through Django's AsyncClient on one event
loop (bench/scratch.py's LoopClient), the scripted engine (tests/support/scripted.py) and the tests'
`testing` toolbox (its `noop` tool), turns run eagerly.
Both cases are measured in interleaved rounds so both see the same machine. Also a plain turn with the
tools offered but not called, so offering them is measured on its own.

Usage: python bench/tool_loop.py [--turns 300] [--rounds 5]
Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from scratch import LoopClient, scratch_install  # noqa: E402

scratch_install("ugent-tools-", '[tools]\nenabled = ["testing"]\n')

from bridge_throughput import django_ready  # noqa: E402

CALLS = 5
TOOLS = "script:" + "|".join(f"call=noop|answer=w{i}" for i in range(CALLS))
PLAIN = "script:answer=" + " ".join(f"w{i}" for i in range(CALLS))


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(p / 100 * (len(values) - 1)))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=300, help="turns per case")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    django_ready()
    import tests.support.toolboxes  # noqa: F401 - registers the `testing` hub toolbox (noop)
    from channels_app.models import ApiKey, Caller, ToolCall
    from plugins_app.agent.models import AgentProfile
    AgentProfile.objects.filter(name="scripted").update(is_default=True)
    caller = Caller.objects.create(name="bench", role="operator")
    key = ApiKey(caller=caller)
    key.set_key("ugk_bench_tools")
    key.save()
    client = LoopClient(headers={"x-api-key": "ugk_bench_tools"})
    seq = [0]

    def turn(text: str, tools_off: bool = False) -> float:
        seq[0] += 1
        body = {"messages": [{"role": "user", "content": text}], "conversation_id": f"b-{seq[0]}", "user": "u"}
        if tools_off:
            body["ugent_denied_tools"] = ["*"]
        t0 = time.perf_counter()
        r = client.post("/v1/chat/completions", data=json.dumps(body), content_type="application/json")
        took = time.perf_counter() - t0
        assert r.status_code == 200, r.content[:300]
        return took

    cases = {"plain, no tools (denied *)": (PLAIN, True), "plain, tools offered": (PLAIN, False),
             f"{CALLS} no-op tool calls": (TOOLS, False)}
    for text, off in cases.values():  # warm-up
        for _ in range(10):
            turn(text, off)
    lat = {name: [] for name in cases}
    wall = {name: 0.0 for name in cases}
    per_round = max(1, args.turns // args.rounds)
    calls_before = ToolCall.objects.count()
    for rnd in range(args.rounds):
        for name, (text, off) in cases.items():
            t0 = time.perf_counter()
            lat[name] += [turn(text, off) for _ in range(per_round)]
            wall[name] += time.perf_counter() - t0
        print(f"  round {rnd + 1}/{args.rounds}", file=sys.stderr, flush=True)
    recorded = ToolCall.objects.count() - calls_before
    base = "plain, no tools (denied *)"
    print(f"tool loop, in-process (SQLite, eager turns), {per_round * args.rounds} turns per case, "
          f"{args.rounds} interleaved rounds")
    print(f"{'case':<30}{'p50 ms':>9}{'p99 ms':>9}{'turns/s':>9}{'p50 vs plain':>14}")
    b50 = statistics.median(lat[base]) * 1000
    for name in cases:
        p50 = statistics.median(lat[name]) * 1000
        print(f"{name:<30}{p50:>9.2f}{pct(lat[name], 99) * 1000:>9.2f}{len(lat[name]) / wall[name]:>9.1f}"
              f"{p50 / b50:>13.2f}x")
    tools50 = statistics.median(lat[f"{CALLS} no-op tool calls"]) * 1000
    print(f"\neach tool call adds {(tools50 - b50) / CALLS:.2f} ms at p50 (a step: the call recorded, two tool "
          f"events, the engine called again); {recorded} calls recorded for "
          f"{per_round * args.rounds * CALLS} made")


if __name__ == "__main__":
    main()
