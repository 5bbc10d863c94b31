"""The admin works out of the box: static files served, hashed and compressed once collected; the daemon
says where the admin is and how to make its first account; "View site" leads somewhere; labels are words."""
from __future__ import annotations

import io

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_app_labels_read_as_words(admin_client):
    page = admin_client.get("/admin/").content.decode()
    for label in ("Conversations and turns", "Plugins and agent profiles", "Rules and routing",
                  "Cron jobs and workflows"):
        assert label in page
    assert "Channels_App" not in page and "Plugins_App" not in page


def test_view_site_leads_to_a_front_page_naming_the_api_and_the_admin(admin_client):
    page = admin_client.get("/admin/").content.decode()
    assert '<a href="/">View site</a>' in page
    front = Client().get("/")
    assert front.status_code == 200
    text = front.content.decode()
    assert "http://testserver/v1" in text and 'href="/admin/"' in text and "createsuperuser" in text


def test_the_front_page_shows_the_key_files_host_path_to_the_admins_staff_only(admin_client, settings):
    """The page answers anyone; a host path is for the operator (as the API's host paths are)."""
    path = str(settings.UGENT_WEB_API_KEY_FILE)
    anonymous = Client().get("/").content.decode()
    assert path not in anonymous and "signed in to the admin" in anonymous
    assert path in admin_client.get("/").content.decode()


def test_the_admin_stylesheet_is_served_before_any_collectstatic(client):
    resp = client.get("/static/admin/css/base.css")
    assert resp.status_code == 200
    assert b"--primary" in b"".join(resp.streaming_content)


def test_collectstatic_runs_at_start_only_when_the_files_changed(settings, tmp_path):
    from django.contrib.staticfiles.storage import staticfiles_storage
    from ugent_site import staticfiles
    settings.STATIC_ROOT = tmp_path / "static"
    from django.utils.functional import empty
    staticfiles_storage._wrapped = empty  # built again on the STATIC_ROOT of this test
    try:
        assert staticfiles.static_collect_if_changed() is True
        assert (tmp_path / "static" / "staticfiles.json").exists()
        assert (tmp_path / "static" / "admin" / "css" / "base.css.gz").exists()  # compressed
        hashed = staticfiles_storage.url("admin/css/base.css")
        assert hashed.startswith("/static/admin/css/base.") and hashed != "/static/admin/css/base.css"
        assert staticfiles.static_collect_if_changed() is False  # nothing changed: no second collect
        (tmp_path / "static" / staticfiles.STAMP_NAME).write_text("stale")
        assert staticfiles.static_collect_if_changed() is True
    finally:
        staticfiles_storage._wrapped = empty


def test_two_daemons_starting_at_once_on_one_static_root_collect_once(tmp_path):
    """Two embedded daemons on one checkout share its STATIC_ROOT: started together, one collects and the
    other waits for it and finds the files collected, instead of writing the same files beside it."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    go = tmp_path / "go"
    script = (
        "import os, sys, time, django; django.setup()\n"
        "from ugent_site.staticfiles import static_collect_if_changed\n"
        f"open(os.path.join({str(tmp_path)!r}, 'ready-' + sys.argv[1]), 'w').close()\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        "print('collected' if static_collect_if_changed() else 'found')\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST")},
           "DJANGO_SETTINGS_MODULE": "ugent_site.settings", "UGENT_STATIC_ROOT": str(tmp_path / "static"),
           "UGENT_VAR_DIR": str(tmp_path / "var"), "PYTHONPATH": str(root)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(n)], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in range(2)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{n}").exists() for n in range(2)):  # both have set Django up, and wait
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.05)
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(out.strip() for out, _ in outs) == ["collected", "found"], outs
    assert (tmp_path / "static" / "staticfiles.json").exists()


def test_the_daemon_prints_the_admin_url_and_until_an_account_exists_how_to_make_one(django_user_model):
    from ugent_site.management.commands.rundaemon import Command
    out = io.StringIO()
    Command(stdout=out).print_admin("0.0.0.0", 8787)
    assert out.getvalue() == ("Admin: http://127.0.0.1:8787/admin/\n"
                              "No admin account yet. Create one with:\n  python manage.py createsuperuser\n")
    django_user_model.objects.create_superuser("ops", "ops@example.com", "pw")
    out = io.StringIO()
    Command(stdout=out).print_admin("10.0.0.5", 9000)
    assert out.getvalue() == "Admin: http://10.0.0.5:9000/admin/\n"


def test_the_live_daemon_serves_the_admin_styled_in_either_run_mode(tmp_path):
    """Embedded: rundaemon (collected at start, hashed names). Servers: the uvicorn web process serves
    the same files whether or not collectstatic ran (the shared test STATIC_ROOT may hold a collect)."""
    import re

    import httpx

    from tests.support.daemon import Daemon
    d = Daemon(tmp_path).start()
    try:
        login = httpx.get(d.base + "/admin/login/")
        assert login.status_code == 200
        css = re.search(r'href="(/static/admin/css/base[^"]*\.css)"', login.text).group(1)
        for url in (css, "/static/admin/css/base.css"):
            resp = httpx.get(d.base + url, headers={"accept-encoding": "gzip"})
            assert resp.status_code == 200 and "--primary" in resp.text
        if not d.servers:
            assert re.fullmatch(r"/static/admin/css/base\.[0-9a-f]{12}\.css", css)
        assert httpx.get(d.base + "/").status_code == 200
    finally:
        d.close()
