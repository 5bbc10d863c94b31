"""The OVOS libraries' logger names each line after its caller, found without inspect.stack() (ugent_common/ovoslog.py)."""
from __future__ import annotations

import inspect

import pytest
from ovos_utils import log as ovos_log

from ugent_common import ovoslog

pytestmark = pytest.mark.mode_free  # no database, Redis or run mode


def _library_lookup():
    """ovos-utils' own _get_real_logger, from a fresh copy of its module (this process's LOG has ours)."""
    import importlib.util
    spec = importlib.util.find_spec("ovos_utils.log")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    return fresh.LOG


def _name_seen_by(log) -> str:
    def debug():  # in LOG.debug's place: the lookup's caller's caller is this function's caller
        return log._get_real_logger()
    return debug().name


def test_the_settings_installed_the_lookup_in_this_process():
    assert ovos_log.LOG.__dict__["_get_real_logger"].__func__ is ovoslog._get_real_logger
    assert ovoslog.caller_by_frame() is True  # a second call changes nothing
    assert ovos_log.LOG.__dict__["_get_real_logger"].__func__ is ovoslog._get_real_logger


def test_a_line_gets_the_logger_name_the_library_would_give_it():
    library = _library_lookup()
    assert library.__dict__["_get_real_logger"].__func__ is not ovoslog._get_real_logger
    theirs = _name_seen_by(library)
    ours = _name_seen_by(ovos_log.LOG)
    assert theirs.rsplit(":", 1)[0] == ours.rsplit(":", 1)[0] == f"OVOS - {__name__}:_name_seen_by"
    assert theirs.rsplit(":", 1)[1] == ours.rsplit(":", 1)[1]  # the same line: the call in _name_seen_by


def test_a_line_below_the_level_reads_no_source_and_a_line_above_it_is_written(monkeypatch, capsys):
    def no_stack(*_a, **_kw):
        raise AssertionError("inspect.stack() was called")
    monkeypatch.setattr(inspect, "stack", no_stack)
    monkeypatch.setattr(ovos_log.LOG, "level", "INFO")  # (OVOS_DEFAULT_LOG_LEVEL may say otherwise)
    ovos_log.LOG.debug("not written")
    ovos_log.LOG.warning("written by the test")
    out = capsys.readouterr().out
    assert "not written" not in out
    assert f"OVOS - {__name__}:test_a_line_below_the_level_reads_no_source_and_a_line_above_it_is_written:" in out
    assert "WARNING - written by the test" in out


@pytest.mark.parametrize("name", [None, "custom"])
def test_a_logger_named_by_the_caller_keeps_that_name_first(monkeypatch, name):
    monkeypatch.setattr(ovos_log.LOG, "name", name)
    got = _name_seen_by(ovos_log.LOG)
    assert got.startswith(f"{name} - " if name else f"{__name__}:")
