"""`manage.py runweb`, servers mode's web process (ugent_site/webserver.py). Its shutdown under open requests
is tested against the real processes in tests/e2e/test_openai_client.py; here, what it refuses."""
from __future__ import annotations

import pytest

from tests.test_operator_key import manage

pytestmark = pytest.mark.mode_free


def test_runweb_refuses_embedded_mode_in_one_line(tmp_path):
    """Without REDIS_URL nothing would run the turns it accepts (they run in rundaemon's own process)."""
    out = manage(tmp_path, "runweb", "--port", "1")
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "CommandError: runweb is servers mode's web process and needs REDIS_URL; "
        "in embedded mode run: python manage.py rundaemon")
