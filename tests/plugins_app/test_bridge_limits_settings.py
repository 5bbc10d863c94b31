"""The submit rate's settings: the supervisor's bridges take UGENT_PLUGIN_SUBMIT_RATE/_BURST, and a value no bridge
could start with stops the start in one line (ugent.E004), naming the setting."""
from __future__ import annotations

import tempfile

import pytest
from django.test import override_settings

from plugins_app.apps import plugin_submit_rate_check
from plugins_app.channel import conf
from plugins_app.channel.runtime import PluginRuntime


@pytest.mark.django_db  # (closing the runtime's bridges closes its database connections: close_old_connections)
def test_each_plugins_bridge_takes_the_submit_rate_of_the_settings():
    assert (conf.SUBMIT_RATE, conf.SUBMIT_BURST) == (50.0, 500)  # the documented defaults
    runtime = PluginRuntime(run_dir=tempfile.mkdtemp(prefix="ugb-"))
    try:
        runtime._ensure_bridge("rate-plugin")
        bucket = runtime.bridges["rate-plugin"].submits
        assert (bucket.rate, bucket.burst) == (50.0, 500)
    finally:
        runtime.close_bridges()


@pytest.mark.parametrize("rate, burst, says", [
    (-1.0, 500, "UGENT_PLUGIN_SUBMIT_RATE is -1.0"),
    (50.0, 0, "UGENT_PLUGIN_SUBMIT_BURST is 0"),
])
def test_a_submit_rate_no_bridge_could_take_stops_the_start_naming_the_setting(rate, burst, says):
    with override_settings(UGENT_PLUGIN_SUBMIT_RATE=rate, UGENT_PLUGIN_SUBMIT_BURST=burst):
        errors = plugin_submit_rate_check()
    assert [e.id for e in errors] == ["ugent.E004"] and says in errors[0].msg


@pytest.mark.parametrize("rate, burst", [(0.0, 0), (50.0, 500), (0.5, 1)])
def test_no_rate_or_a_rate_with_a_burst_passes(rate, burst):
    with override_settings(UGENT_PLUGIN_SUBMIT_RATE=rate, UGENT_PLUGIN_SUBMIT_BURST=burst):
        assert plugin_submit_rate_check() == []
