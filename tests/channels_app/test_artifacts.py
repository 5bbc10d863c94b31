"""A turn's artifacts are files of its conversation: announced pending, stored, announced finished, listed
on the receipt, downloadable through /v1/files by the conversation's owner alone; a pending one is finished
later (channels_app.artifacts)."""
from __future__ import annotations

import base64
import json

import pytest
from django.test import Client

from channels_app import artifacts
from channels_app.models import Event, File, Receipt, ToolCall, Turn
from tests.conftest import OPERATOR_KEY
from tests.support.http import body_bytes, parse_sse
from tests.support.toolboxes import tools_toml  # noqa: F401 - a fixture

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _setup(tools_toml, settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "ugent_files": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path / "files")}}}
    settings.UGENT_WORKSPACE = str(tmp_path / "workspace")
    (tmp_path / "workspace" / "out").mkdir(parents=True)
    (tmp_path / "workspace" / "out" / "chart.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 24)
    (tmp_path / "secret.txt").write_text("outside the workspace")
    tools_toml('[tools]\nenabled = ["testing"]\n')


def chat(who, text, *, stream=True, conversation_id="c-art", **extra):
    body = {"messages": [{"role": "user", "content": text}], "stream": stream, "conversation_id": conversation_id,
            **{k: v for k, v in who.items() if k != "key"}, **extra}
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=who["key"])


def download(who, url):
    return Client().get(url, {k: v for k, v in who.items() if k != "key"}, HTTP_X_API_KEY=who["key"])


def named(frames, event):
    return [f["data"][event.replace(".", "_")] for f in frames if f["event"] == event]


def test_a_tools_file_is_announced_pending_then_finished_and_downloads_for_the_owner_alone(tcast):
    frames = parse_sse(body_bytes(chat(tcast.alice, "script:call=make_file|answer=made")))
    order = [f["event"] for f in frames if f["event"] in ("ugent.artifacts_pending", "ugent.artifacts")]
    assert order == ["ugent.artifacts_pending", "ugent.artifacts"]
    [pending] = named(frames, "ugent.artifacts_pending")
    [[ready]] = named(frames, "ugent.artifacts")
    assert [a["artifact_id"] for a in pending][0] == ready["artifact_id"]
    f = File.objects.get(file_id=ready["id"])
    assert (f.conversation.external_id, f.actor.key, f.filename, f.size) == ("c-art", "web:alice", "report.txt", 5)
    got = download(tcast.alice, ready["url"])
    assert got.status_code == 200 and got.content == b"hello" and got["Content-Type"].startswith("text/plain")
    for other in (tcast.bob, tcast.carol, {"key": tcast.keys["outsider"]}):
        resp = download(other, ready["url"])
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "file_not_found"
    assert download({"key": OPERATOR_KEY}, ready["url"]).status_code == 200  # the operator itself
    # the engine and the tool's record see the stored entry, never the bytes
    call = ToolCall.objects.get()
    assert "content_base64" not in json.dumps(call.result) and call.result["artifacts"][0]["id"] == ready["id"]
    receipt = Receipt.objects.get()
    assert receipt.files[0] == ready and receipt.files[1]["name"] == "big.bin" and receipt.files[1]["pending"]


def test_the_non_stream_answer_lists_each_artifact_once_as_it_last_stood(tcast):
    body = chat(tcast.alice, "script:call=make_file|answer=made", stream=False).json()
    names = [(a["name"], bool(a.get("pending"))) for a in body["ugent_artifacts"]]
    assert names == [("report.txt", False), ("big.bin", True)]


def test_a_workspace_path_is_copied_and_a_path_out_of_it_is_refused(tcast):
    frames = parse_sse(body_bytes(chat(tcast.alice, 'script:call=file_at{"path": "out/chart.png"}|answer=ok')))
    [[ready]] = named(frames, "ugent.artifacts")
    assert ready["mime"] == "image/png" and download(tcast.alice, ready["url"]).content.startswith(b"\x89PNG")
    before = File.objects.count()
    for path in ("../secret.txt", "/etc/passwd", "out/missing.png"):
        frames = parse_sse(body_bytes(chat(tcast.alice, f'script:call=file_at{{"path": "{path}"}}|answer=ok')))
        [[entry]] = named(frames, "ugent.artifacts")
        assert "error" in entry and "id" not in entry and "url" not in entry, entry
    assert File.objects.count() == before


def test_a_link_elsewhere_is_passed_on_and_stores_nothing(tcast):
    frames = parse_sse(body_bytes(chat(tcast.alice, "script:call=link_file|answer=ok")))
    [[entry]] = named(frames, "ugent.artifacts")
    assert entry["url"] == "https://example.test/far.pdf" and "id" not in entry
    assert File.objects.count() == 0


def test_a_file_past_the_size_limit_is_refused_and_stores_nothing(tcast, settings):
    settings.UGENT_FILES_MAX_BYTES = 3
    frames = parse_sse(body_bytes(chat(tcast.alice, "script:call=make_file|answer=ok")))
    [[entry]] = named(frames, "ugent.artifacts")
    assert entry["name"] == "report.txt" and "UGENT_FILES_MAX_BYTES" in entry["error"]
    assert File.objects.count() == 0


def test_a_pending_artifact_finished_after_the_turn_updates_the_receipt_and_the_log(tcast):
    body = chat(tcast.alice, "script:call=make_file|answer=made", stream=False).json()
    turn_id = body["ugent_turn_id"]
    entry = artifacts.artifact_finish(turn_id=turn_id, artifact_id="big-1", content=b"\x00\x01\x02")
    assert entry["name"] == "big.bin" and entry["bytes"] == 3 and "pending" not in entry
    receipt = Receipt.objects.get()
    assert receipt.files[1] == entry and Turn.objects.get().artifacts == receipt.files
    last = Event.objects.filter(type="ugent.artifacts").order_by("-id").first()
    assert last.data["artifacts"] == [entry]
    assert download(tcast.alice, entry["url"]).content == b"\x00\x01\x02"
    assert download(tcast.bob, entry["url"]).status_code == 404
    # once only: a second finish, or one for an artifact never announced, stores nothing
    files = File.objects.count()
    assert artifacts.artifact_finish(turn_id=turn_id, artifact_id="big-1", content=b"again") is None
    assert artifacts.artifact_finish(turn_id=turn_id, artifact_id="nope", content=b"x") is None
    assert File.objects.count() == files


def test_a_pending_artifact_finished_while_the_turn_runs_is_listed_finished_at_its_end(tcast):
    from tests.support import toolboxes
    seen = {}

    def finish_now(ctx):
        # a tool that finishes its own pending file before the turn ends (the turn is running)
        seen["entry"] = artifacts.artifact_finish(turn_id=ctx.turn.turn_id, artifact_id="big-1", content=b"late")
    toolboxes.AFTER_MAKE_FILE = finish_now
    try:
        body = chat(tcast.alice, "script:call=make_file|call=finish_pending|answer=made", stream=False).json()
    finally:
        toolboxes.AFTER_MAKE_FILE = None
    assert seen["entry"] is not None
    receipt = Receipt.objects.get()
    assert receipt.files[1] == seen["entry"] and not receipt.files[1].get("pending")
    assert [a["name"] for a in body["ugent_artifacts"]] == ["report.txt", "big.bin"]
    assert not any(a.get("pending") for a in body["ugent_artifacts"])


def test_bad_base64_is_an_error_entry_not_a_failed_turn(tcast):
    result = {"artifacts": [{"name": "x.bin", "content_base64": "%%%"},
                            {"name": "ok.txt", "content_base64": base64.b64encode(b"ok").decode()}]}
    turn = Turn.objects.get(turn_id=chat(tcast.alice, "hi", stream=False).json()["ugent_turn_id"])
    emitted = []
    shown, entries = artifacts.artifacts_take(turn=turn, result=result, emit=emitted.extend)
    assert entries[0]["error"] == "content_base64 is not base64" and entries[1]["bytes"] == 2
    assert [t for t, _d, _a in emitted] == ["ugent.artifacts_pending", "ugent.artifacts"]
    assert shown["artifacts"] == entries


def test_a_delegated_tasks_file_is_stored_once_and_reaches_the_turns_receipt(tcast, tools_toml):
    tools_toml('[tools]\nenabled = ["testing", "delegation"]\n')
    task = json.dumps({"task": "script:call=make_file"})  # no "|": the outer script would split it
    body = chat(tcast.alice, f"script:call=delegate_research{task}|answer=top", stream=False).json()
    [stored] = File.objects.all()
    names = [(a["name"], a.get("id")) for a in body["ugent_artifacts"]]
    assert names == [("report.txt", stored.file_id), ("big.bin", None)]
    ready = Event.objects.filter(type="ugent.artifacts")
    assert [a["id"] for e in ready for a in e.data["artifacts"]] == [stored.file_id]  # announced once
    assert [a["name"] for a in Receipt.objects.get().files] == ["report.txt", "big.bin"]


def test_a_pending_artifact_that_never_arrives_is_listed_failed_once_its_wait_is_over(tcast, settings):
    import datetime as dt

    from django.utils import timezone
    settings.UGENT_ARTIFACT_PENDING_SECS = 600
    body = chat(tcast.alice, "script:call=make_file|answer=made", stream=False).json()
    turn_id, now = body["ugent_turn_id"], timezone.now()
    events = Event.objects.count()
    # not yet: inside its wait, or while the turn still runs, nothing changes
    assert artifacts.artifacts_expire_pending(now=now + dt.timedelta(seconds=590)) == 0
    Turn.objects.update(state="running")
    assert artifacts.artifacts_expire_pending(now=now + dt.timedelta(seconds=610)) == 0
    Turn.objects.update(state="completed")
    assert Receipt.objects.get().files[1]["pending"] and Event.objects.count() == events
    # past it: listed failed in the turn, the receipt and the log, once
    assert artifacts.artifacts_expire_pending(now=now + dt.timedelta(seconds=610)) == 1
    receipt = Receipt.objects.get()
    failed = {"artifact_id": "big-1", "name": "big.bin", "error": "the file did not arrive within 600 s"}
    assert receipt.files[1] == failed and receipt.files[0]["url"].startswith("/v1/files/")
    assert Turn.objects.get().artifacts == receipt.files
    last = Event.objects.filter(type="ugent.artifacts").order_by("-id").first()
    assert last.data == {"turn_id": turn_id, "artifacts": [failed]}
    assert artifacts.artifacts_expire_pending(now=now + dt.timedelta(seconds=7200)) == 0
    assert Event.objects.count() == events + 1
    # and it cannot arrive now: a late finish stores nothing
    files = File.objects.count()
    assert artifacts.artifact_finish(turn_id=turn_id, artifact_id="big-1", content=b"late") is None
    assert File.objects.count() == files and Receipt.objects.get().files[1] == failed
    # an announcement older than the job's window (a day past its wait) is not read again by each run
    Turn.objects.update(artifacts=[{**failed, "pending": True}])
    assert artifacts.artifacts_expire_pending(now=now + dt.timedelta(seconds=600 + 86400 + 60)) == 0


def test_a_pending_artifact_finished_in_time_is_not_expired(tcast, settings):
    import datetime as dt

    from django.utils import timezone
    body = chat(tcast.alice, "script:call=make_file|answer=made", stream=False).json()
    entry = artifacts.artifact_finish(turn_id=body["ugent_turn_id"], artifact_id="big-1", content=b"ok")
    later = timezone.now() + dt.timedelta(seconds=settings.UGENT_ARTIFACT_PENDING_SECS + 60)
    assert artifacts.artifacts_expire_pending(now=later) == 0
    assert Receipt.objects.get().files[1] == entry


def test_beat_runs_the_pending_artifacts_expiry():
    from django_celery_beat.models import PeriodicTask

    from channels_app import files
    from ugent_site.celery import app
    files.files_prune_schedule_ensure()
    task = PeriodicTask.objects.get(name=files.ARTIFACTS_EXPIRY_TASK_NAME)
    assert task.enabled and task.task == "channels_app.tasks.expire_pending_artifacts"
    assert task.task in app.tasks
