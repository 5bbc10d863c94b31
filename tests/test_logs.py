"""The daemon's log lines: one per API request, one per turn end, an upstream failure named; repeats
throttled; no secret in any line; JSON lines with UGENT_LOG_FORMAT=json."""
from __future__ import annotations

import io
import json
import logging

import pytest
from django.test import Client

from channels_app.models import Turn
from plugins_app.agent.models import AgentProfile
from tests.conftest import APP_KEY, OPERATOR_KEY
from tests.fakes.upstream import Script, run_stub_upstream
from ugent_common import loglevel, logs

pytestmark = pytest.mark.django_db(transaction=True)


def chat(key, text, **extra):
    body = {"messages": [{"role": "user", "content": text}], **extra}
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=key)


class Captured(logging.Handler):
    """The records of the named loggers, held on the loggers themselves (pytest caplog's root handler can be
    swapped out under a test when Celery first sets up its logging)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def captured(monkeypatch):
    handler = Captured()
    for name in ("ugent.requests", "ugent.turns", "ugent.plugins"):
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "level", logging.INFO)
        logger.addHandler(handler)
    handler.set_level = lambda level, logger=None: None
    yield handler
    for name in ("ugent.requests", "ugent.turns", "ugent.plugins"):
        logging.getLogger(name).removeHandler(handler)


def records(captured, name):
    return [r for r in captured.records if r.name == name]


def test_each_api_request_has_one_line_with_its_method_path_status_ms_caller_actor_and_turn(tcast, captured):
    captured.set_level(logging.INFO, logger="ugent.requests")
    resp = chat(tcast.keys["app"], "hello", federation_issuer="example-crm", federation_subject="carol")
    turn = Turn.objects.get()
    Client().get("/v1/models", HTTP_X_API_KEY=tcast.keys["operator"])
    Client().get("/v1/models")
    lines = records(captured, "ugent.requests")
    assert len(lines) == 3
    first, models, refused = lines
    assert (first.method, first.path, first.status, first.caller, first.turn) == (
        "POST", "/v1/chat/completions", resp.status_code, "crm", turn.turn_id)
    assert first.actor == turn.actor.key and isinstance(first.ms, float)
    assert first.getMessage().startswith("request (method=POST, path=/v1/chat/completions, status=200, ms=")
    assert (models.caller, models.status, models.actor, models.turn) == ("workspace", 200, "-", "-")
    assert (refused.caller, refused.status) == ("-", 401)


def test_a_turn_end_has_one_line_with_turn_model_state_ms_ttft_and_tokens(tcast, captured):
    captured.set_level(logging.INFO, logger="ugent.turns")
    chat(tcast.keys["operator"], "script:answer=a few words here", user="alice")
    turn = Turn.objects.get()
    [line] = [r for r in records(captured, "ugent.turns") if r.getMessage().startswith("turn ended")]
    assert (line.turn, line.model, line.state, line.tokens) == (turn.turn_id, "scripted", "completed",
                                                                turn.total_tokens)
    assert line.ms >= 0 and line.ttft_ms is not None and line.ttft_ms == turn.ttft_ms
    assert f"turn ended (turn={turn.turn_id}, model=scripted, state=completed, ms=" in line.getMessage()


def test_an_upstream_failure_names_the_turn_the_model_and_the_reason(tcast, captured):
    with run_stub_upstream(script=Script(status=500, error_message="the model server fell over")) as url:
        AgentProfile.objects.create(name="up", provider="openai-compatible",
                                    config={"base_url": str(url), "model": "m"})
        chat(tcast.keys["operator"], "hello", model="up")
    turn = Turn.objects.get()
    [line] = [r for r in records(captured, "ugent.turns") if r.getMessage().startswith("upstream failed")]
    assert (line.turn, line.model) == (turn.turn_id, "up") and "the model server fell over" in line.reason
    assert line.levelno == logging.WARNING


def test_a_repeating_warning_is_logged_once_then_every_five_minutes_with_its_count():
    book = logs.Repeats()
    assert book.seen("k", now=0.0) == (True, 0)
    assert [book.seen("k", now=t)[0] for t in (1.0, 100.0, 299.0)] == [False, False, False]
    assert book.seen("k", now=300.0) == (True, 3)
    assert book.seen("k", now=301.0) == (False, 1)
    assert book.seen("other", now=301.0) == (True, 0)
    assert logs.repeat_suffix(3) == " (repeated 3 times in the last 5 minutes)"


def test_the_repeat_filter_holds_back_identical_warnings_and_counts_them(monkeypatch):
    clock = iter([0.0, 1.0, 2.0, 400.0])
    monkeypatch.setattr(logs.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(logs.RepeatFilter())
    logger = logging.getLogger("ugent.test.repeats")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for _ in range(4):
            logger.warning("plugin %s: environment not set: %s", "tg", "TOKEN")
    finally:
        logger.removeHandler(handler)
    assert out.getvalue().splitlines() == [
        "plugin tg: environment not set: TOKEN",
        "plugin tg: environment not set: TOKEN (repeated 2 times in the last 5 minutes)"]


def test_the_plugin_runtimes_environment_warning_is_not_repeated_every_tick(tcast, captured, tmp_path, monkeypatch):
    from plugins_app.channel.models import Plugin
    from plugins_app.channel.runtime import PluginRuntime
    monkeypatch.setattr(logs, "_call_sites", logs.Repeats())
    Plugin.objects.create(plugin_id="tg-main", kind="channel-echo", command="python",
                          args=["-m", "plugins_app.channel.workers.echo"], env_refs=["NOT_SET_ANYWHERE"])
    rt = PluginRuntime(run_dir=tmp_path / "r", pid_dir=tmp_path / "p", log_dir=tmp_path / "l",
                       state_dir=tmp_path / "s", environ={})
    captured.set_level(logging.WARNING, logger="ugent.plugins")
    try:
        for _ in range(20):  # twenty supervisor ticks, ten seconds at the default 0.5 s
            rt.desired()
    finally:
        rt.shutdown()
    said = [r.getMessage() for r in captured.records if "environment not set" in r.getMessage()]
    assert said == ["plugin tg-main: environment not set: NOT_SET_ANYWHERE"]


def test_no_secret_reaches_a_log_line(settings, monkeypatch):
    settings.UGENT_LLM_API_KEY = "upstream-secret-value-123"
    logs.secret_add("plugin-token-abcdef")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(logs.RedactSecrets())
    logger = logging.getLogger("ugent.test.secrets")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("upstream said: bad key %s", "upstream-secret-value-123")
        logger.warning("caller key %s and %s", OPERATOR_KEY, APP_KEY)
        logger.warning("header Authorization: Bearer abcdefghijklmnop, openai sk-abcdefghijklmnopqrstuv")
        logger.warning("worker env %s", {"TOKEN": "plugin-token-abcdef"}, extra={"reason": "plugin-token-abcdef"})
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    for secret in ("upstream-secret-value-123", OPERATOR_KEY, APP_KEY, "abcdefghijklmnop",
                   "sk-abcdefghijklmnopqrstuv", "plugin-token-abcdef"):
        assert secret not in text
    assert text.count("[redacted]") == 6


def test_json_lines_carry_the_fields_of_the_request_line():
    import logging.config
    config = logs.logging_config(fmt="json", level="INFO", loggers={})
    formatter = logging.config.DictConfigurator(config).configure_custom(dict(config["formatters"]["json"]))
    record = logging.LogRecord("ugent.requests", logging.INFO, __file__, 1, "request (method=%s)", ("GET",), None)
    record.method, record.status = "GET", 200
    line = json.loads(formatter.format(record))
    assert line["message"] == "request (method=GET)" and line["method"] == "GET" and line["status"] == 200
    assert line["level"] == "INFO" and line["logger"] == "ugent.requests" and "time" in line


def test_an_upstream_error_that_echoes_the_profiles_key_is_logged_without_it(tcast):
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(logs.RedactSecrets())
    logger = logging.getLogger("ugent.turns")
    logger.addHandler(handler)
    try:
        with run_stub_upstream(script=Script(status=401, error_message="Incorrect API key: plainkey-0123456789")) as url:
            AgentProfile.objects.create(name="up", provider="openai-compatible",
                                        config={"base_url": str(url), "model": "m", "api_key": "plainkey-0123456789"})
            chat(tcast.keys["operator"], "hello", model="up")
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert "upstream failed (turn=" in text and "Incorrect API key: [redacted]" in text
    assert "plainkey-0123456789" not in text


def test_repeats_forget_drops_every_count_so_the_next_line_is_new(caplog):
    import logging
    log = logging.getLogger("ugent.test.forget")
    handler_filter = logs.RepeatFilter(window=3600.0)  # a repeat is held back for an hour
    log.addFilter(handler_filter)
    try:
        with caplog.at_level(logging.WARNING, logger="ugent.test.forget"):
            log.warning("disk full")
            log.warning("disk full")
            logs.repeats_forget()
            log.warning("disk full")
            assert logs.warn_repeating(log, "gone %s", "away")
            assert not logs.warn_repeating(log, "gone %s", "away")
            logs.repeats_forget()
            assert logs.warn_repeating(log, "gone %s", "away")
    finally:
        log.removeFilter(handler_filter)
    # the second "disk full" was held back; after the counts were dropped, each line is new again
    assert [r.getMessage() for r in caplog.records] == ["disk full", "disk full", "gone away", "gone away"]


def test_a_log_level_in_any_case_configures_logging(tmp_path):
    """UGENT_LOG_LEVEL=debug broke every command ("Unable to configure root logger")."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DJANGO_", "PYTEST", "UGENT_")) and k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(UGENT_VAR_DIR=str(tmp_path / "var"), UGENT_LOG_LEVEL="debug", UGENT_LOG_FORMAT="JSON")
    out = subprocess.run([sys.executable, "manage.py", "check"], cwd=Path(__file__).resolve().parent.parent,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    config = logs.logging_config(fmt="JSON", level="debug", loggers={})
    assert config["root"]["level"] == "DEBUG" and config["handlers"]["console"]["formatter"] == "json"


@pytest.mark.parametrize("fmt, level, message", [
    ("bogus", "INFO", "UGENT_LOG_FORMAT='bogus' is not one of plain, json"),
    ("plain", "verbose", "UGENT_LOG_LEVEL='VERBOSE' is not one of CRITICAL, FATAL, ERROR, WARN, WARNING, INFO, "
                         "DEBUG, NOTSET (in any case)"),
])
def test_an_unknown_log_format_or_level_is_refused_naming_it(fmt, level, message):
    """UGENT_LOG_FORMAT=bogus gave plain lines without a word."""
    from django.core.exceptions import ImproperlyConfigured
    with pytest.raises(ImproperlyConfigured) as err:
        logs.logging_config(fmt=fmt, level=level, loggers={})
    assert str(err.value) == message


def _env_without_ugent(tmp_path, **extra):
    import os
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DJANGO_", "PYTEST", "UGENT_")) and k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(UGENT_VAR_DIR=str(tmp_path / "var"), **extra)
    return env


@pytest.mark.parametrize("level, expected", [("WARN", "WARN"), ("fatal", "FATAL"), ("NotSet", "NOTSET"),
                                             ("warning", "WARNING"), ("", "INFO"), ("  ", "INFO")])
def test_every_level_name_logging_knows_is_accepted_and_empty_is_info(level, expected):
    """WARN, FATAL and NOTSET started the daemon before UGENT_LOG_LEVEL was checked (logging knows them),
    and a set-but-empty value meant the default."""
    assert loglevel.log_level_name(level) == expected
    assert logs.logging_config(fmt="", level=level, loggers={})["root"]["level"] == expected
    assert logs.logging_config(fmt=" ", level=level, loggers={})["handlers"]["console"]["formatter"] == "plain"


def test_the_daemon_starts_with_warn_and_an_empty_log_format(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    env = _env_without_ugent(tmp_path, UGENT_LOG_LEVEL="WARN", UGENT_LOG_FORMAT="")
    out = subprocess.run([sys.executable, "manage.py", "check"], cwd=Path(__file__).resolve().parent.parent,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


_WORKER_LEVEL = """
import logging, sys
from plugins_app.channel.sdk.worker import ChannelWorker
class Probe(ChannelWorker):
    def __init__(self, **kwargs):
        print(logging.getLevelName(logging.getLogger().level)); sys.exit(0)
Probe.main()
"""


@pytest.mark.parametrize("level, expected", [("warn", "WARNING"), ("FATAL", "CRITICAL"), ("", "INFO"),
                                             ("debug", "DEBUG")])
def test_the_worker_sdk_takes_the_same_level_names_as_the_daemon(tmp_path, level, expected):
    """One rule for both (ugent_common.loglevel.log_level_name): a value the daemon takes, a worker takes."""
    import subprocess
    import sys
    from pathlib import Path
    out = subprocess.run([sys.executable, "-c", _WORKER_LEVEL], cwd=Path(__file__).resolve().parent.parent,
                         env=_env_without_ugent(tmp_path, UGENT_LOG_LEVEL=level), capture_output=True, text=True,
                         timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, expected), out.stderr


def test_the_worker_sdk_refuses_an_unknown_level_naming_it(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    out = subprocess.run([sys.executable, "-c", _WORKER_LEVEL], cwd=Path(__file__).resolve().parent.parent,
                         env=_env_without_ugent(tmp_path, UGENT_LOG_LEVEL="verbose"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "UGENT_LOG_LEVEL='VERBOSE' is not one of" in out.stderr, out.stderr


def test_a_plain_line_escapes_control_characters_a_client_sent_so_it_cannot_forge_a_line():
    # before the user fields refused them, user="eve\n… INFO ugent.requests request (… actor=web:admin)" wrote a
    # second line that read as the daemon's own: the plain formatter is the defense below the validation
    import logging.config
    config = logs.logging_config(fmt="plain", level="INFO", loggers={})
    formatter = logging.config.DictConfigurator(config).configure_formatter(dict(config["formatters"]["plain"]))
    forged = "eve\n2026-12-07 08:00:00,000 INFO ugent.requests request (status=200, actor=web:admin)\x1b[2K\r"
    record = logging.LogRecord("ugent.requests", logging.INFO, __file__, 1, "request (actor=%s)", (forged,), None)
    line = formatter.format(record)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line.endswith("request (actor=eve\\n2026-12-07 08:00:00,000 INFO ugent.requests request "
                         "(status=200, actor=web:admin)\\x1b[2K\\r)")
    try:
        raise ValueError("boom")
    except ValueError:
        import sys
        record = logging.LogRecord("ugent.x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert formatter.format(record).count("\n") >= 2  # a traceback keeps its lines


def test_the_request_line_escapes_a_control_character_that_reaches_it(tcast, captured):
    # the request log line as the daemon writes it, through the configured plain formatter
    import logging.config
    from django.test import RequestFactory
    from django.http import HttpResponse
    from ugent_site.middleware import request_report
    config = logs.logging_config(fmt="plain", level="INFO", loggers={})
    formatter = logging.config.DictConfigurator(config).configure_formatter(dict(config["formatters"]["plain"]))
    request = RequestFactory().get("/v1/models")
    request.ugent_actor = "web:eve\nINFO ugent.requests request (actor=web:admin)"
    request_report(request, HttpResponse(), 0.0)
    line = formatter.format(records(captured, "ugent.requests")[-1])
    assert "\n" not in line and "actor=web:eve\\nINFO ugent.requests" in line
