"""The shipped proxy configuration (deploy/haproxy.cfg) streams each chunk as it comes.

HAProxy's default sends with MSG_MORE: a chunk smaller than a packet waits in the kernel for the next
one or for about 200 ms, so a chat stream's tokens and an event stream's events came through the
proxy in bursts, up to 200 ms late (bench/events_fanout.py --layout proxy: commit to client p50
153 ms against 19 ms with `option http-no-delay`). How late is a duration, measured in the bench, not
asserted here; this checks the setting the proxy reads, section by section, as HAProxy reads it."""
from __future__ import annotations

from pathlib import Path

CFG = Path(__file__).resolve().parents[1] / "deploy" / "haproxy.cfg"
SECTIONS = ("global", "defaults", "frontend", "backend", "listen")


def sections(text: str) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.split()[0] in SECTIONS and not raw[:1].isspace():
            out.append((line, []))
        elif out:
            out[-1][1].append(" ".join(line.split()))
    return out


def test_the_proxy_sends_each_chunk_at_once_in_every_http_section():
    parsed = sections(CFG.read_text())
    defaults = [body for head, body in parsed if head.startswith("defaults")]
    assert defaults and "option http-no-delay" in defaults[-1]
    proxies = [(head, body) for head, body in parsed if head.split()[0] in ("frontend", "backend", "listen")]
    assert proxies, "the frontend and backend sections"
    assert [head for head, body in proxies if "no option http-no-delay" in body] == []


def test_the_reader_finds_a_setting_turned_off_in_a_section():
    text = CFG.read_text().replace("    balance roundrobin", "    balance roundrobin\n    no option http-no-delay")
    proxies = [head for head, body in sections(text) if "no option http-no-delay" in body]
    assert proxies == ["backend ugent_web"]
