"""Headless Chromium walks the control room of a real daemon (rundaemon, embedded): log in, see the styled
index with its health board, stop a running turn from the admin, see the rules file's load error.

Screenshots are kept in var/test-artifacts/admin-walk/. Chromium missing is a failure, not a skip:
scripts/ensure-chromium.sh installs it (`make test` runs it).
"""
from __future__ import annotations

import re
import shutil
import threading
import time

import httpx
import pytest

from tests.support.daemon import ROOT, Daemon
from tests.support.workers import PASS

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = ROOT / "var" / "test-artifacts" / PASS / "admin-walk"  # (the two passes run at once)
# a TOML syntax error on line 3: the inline table is never closed
BROKEN_RULES = '[[rules]]\nname = "ignore-a"\nmatch = { field = "text", equals = "a"\ndecision = "Ignore"\n'
SLOW = "script:slow=0.25|answer=" + " ".join(f"w{i}" for i in range(400))  # ~100 s unless stopped


def wait_for(predicate, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path, servers=False, extra_env={"UGENT_RULES_POLL_INTERVAL": "0.5"})
    d.prepare()  # the scripted profile is the default
    ws = tmp_path / "workspace"
    (ws / "rules.toml").write_text(BROKEN_RULES)
    d.manage("shell", "-c", "from rules_app.services import workspace_trust_approve;"
                            f"workspace_trust_approve(path={str(ws)!r})")
    d.spawn()
    try:
        yield d
    finally:
        d.close()


def test_an_operator_walks_the_control_room_in_chromium(daemon, tmp_path):
    assert shutil.which(CHROMIUM), "chromium is not installed at /usr/bin/chromium: run scripts/ensure-chromium.sh"
    from playwright.sync_api import sync_playwright
    d = daemon
    log = (tmp_path / "daemon.log").read_text()
    assert f"Admin: http://127.0.0.1:{d.port}/admin/" in log
    assert "No admin account yet. Create one with:\n  python manage.py createsuperuser" in log
    d.manage("shell", "-c", "from django.contrib.auth import get_user_model as U;"
             "U().objects.create_superuser('ops', 'ops@example.com', 'walk-the-room')")
    # the stylesheet the daemon itself serves (WhiteNoise), under its plain and its hashed name
    assert httpx.get(d.base + "/static/admin/css/base.css").status_code == 200

    # a turn that runs long enough to be stopped from the admin
    answers = {}
    chat = threading.Thread(target=lambda: answers.update(resp=httpx.post(
        d.base + "/v1/chat/completions", headers={"x-api-key": d.key}, timeout=150,
        json={"messages": [{"role": "user", "content": SLOW}], "user": "alice", "conversation_id": "c-walk"})))
    chat.start()
    turn_pk, turn_id = wait_for(lambda: (d.sql("SELECT id, turn_id FROM channels_app_turn WHERE state = 'running'")
                                         or [None])[0], "the turn to run")

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(d.base + "/admin/")
            assert "/admin/login/" in page.url
            page.fill("#id_username", "ops")
            page.fill("#id_password", "walk-the-room")
            page.click("input[type=submit]")
            page.wait_for_selector("#health-board")

            # styled: the admin's stylesheet loaded (hashed by collectstatic) and applied
            hrefs = page.eval_on_selector_all("link[rel=stylesheet]", "els => els.map(e => e.getAttribute('href'))")
            base_css = next(h for h in hrefs if "/admin/css/base" in h)
            assert re.fullmatch(r"/static/admin/css/base\.[0-9a-f]{12}\.css", base_css), hrefs
            assert httpx.get(d.base + base_css).status_code == 200
            header_bg = page.eval_on_selector("#header", "e => getComputedStyle(e).backgroundColor")
            assert header_bg not in ("rgba(0, 0, 0, 0)", "transparent"), header_bg
            assert page.inner_text("#site-name") == "UGENT control room"

            # the board: the running turn, and the rules file's load error with its line and column
            turns = page.locator('[data-card="turns"]')
            assert turns.locator('[data-figure="running"]').inner_text() == "1"
            rules = page.locator('[data-card="rules-in-force"]')
            error = rules.locator("[data-load-error]").inner_text()
            assert re.match(r"line 3, column \d+: ", error), error
            assert "rules.toml" in rules.inner_text()
            page.screenshot(path=str(ARTIFACTS / "1-health-board.png"), full_page=True)

            # stop the running turn from its page
            turns.locator(f"a:has-text('{turn_id}')").click()
            page.wait_for_selector("#turn-stop")
            page.screenshot(path=str(ARTIFACTS / "2-running-turn.png"), full_page=True)
            page.click("#turn-stop")
            page.wait_for_selector(".messagelist")
            assert f"Asked turn {turn_id} to stop (by admin:ops)" in page.inner_text(".messagelist")
            page.screenshot(path=str(ARTIFACTS / "3-turn-stopped.png"), full_page=True)
            wait_for(lambda: d.sql("SELECT state FROM channels_app_turn WHERE id = ?", (turn_pk,)) == [("cancelled",)],
                     "the turn to end cancelled")
            assert d.sql("SELECT stop_requested_by FROM channels_app_turn WHERE id = ?", (turn_pk,)) == [("admin:ops",)]
            page.reload()
            assert "cancelled" in page.inner_text("#content")

            # the rules file's load error, from the board's link to the rule set list
            page.goto(d.base + "/admin/")
            page.locator('[data-card="rules-in-force"] [data-figure="last-load"] a').click()
            page.wait_for_selector("#result_list")
            assert "source=file" in page.url
            listed = page.inner_text("#result_list")
            assert "line 3, column" in listed or "failed" in listed
            page.screenshot(path=str(ARTIFACTS / "4-rule-file-error.png"), full_page=True)
        finally:
            browser.close()
    chat.join(timeout=60)
    assert "resp" in answers, "the stopped turn's request never ended"
    for name in ("1-health-board.png", "2-running-turn.png", "3-turn-stopped.png", "4-rule-file-error.png"):
        assert (ARTIFACTS / name).stat().st_size > 10_000
