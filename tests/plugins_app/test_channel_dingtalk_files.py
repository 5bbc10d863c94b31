"""channel-dingtalk end to end, an answer's files: each uploaded with the old OAPI's ``media/upload`` and sent as a
part of its own (``sampleImageMsg`` with the media id as ``photoURL``, ``sampleFile``) through the robot OpenAPI,
to a one-to-one chat and to a group; journaled so a kill -9 sends no part twice; a file DingTalk does not take
becomes a note. The real supervisor runs the worker against the fake DingTalk on loopback."""
from __future__ import annotations

import os
import signal
import sys

import pytest

from plugins_app.channel.models import OutboundDelivery, Plugin
from tests.fakes.dingtalk import GROUP, STAFF, FakeDingTalk
from tests.plugins_app.conftest import enqueue_with_files, wait_until
from tests.plugins_app.test_channel_dingtalk import (PID, delivered, dingtalk_plugin, listening, session_plugin,
                                                     stream_plugin, streaming)

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")]

PNG = b"\x89PNG\r\n\x1a\n" + os.urandom(200)
PDF = b"%PDF-1.4 the report"


@pytest.fixture
def ding(monkeypatch):
    fake = FakeDingTalk().start()
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)
    yield fake
    fake.stop()


def enqueue(plugin: Plugin, text: str, *files: tuple[bytes, str, str], to: str = f"user:{STAFF}") -> OutboundDelivery:
    """A delivery to ``to`` carrying ``files`` ((data, content type, name)), stored on the host first."""
    return enqueue_with_files(plugin, channel="dingtalk", user_id=STAFF, external_id=to, text=text, files=files)


def sent(fake: FakeDingTalk, n: int, rt, timeout: float = 30) -> list[dict]:
    assert wait_until(lambda: len(fake.sent) >= n, timeout), (fake.sends(), rt.log(PID))
    return list(fake.sent)


def uploads_by_name(fake: FakeDingTalk) -> dict[str, tuple[str, dict]]:
    return {u["filename"]: (media_id, u) for media_id, u in fake.uploads.items()}


@pytest.mark.parametrize("to, path", [(f"user:{STAFF}", "/v1.0/robot/oToMessages/batchSend"),
                                      (f"group:{GROUP}", "/v1.0/robot/groupMessages/send")])
def test_an_image_and_a_file_are_uploaded_and_sent_after_the_text(tcast, ding, start_runtime, to, path):
    plugin = dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    enqueue(plugin, "your chart and report", (PNG, "image/png", "chart.png"), (PDF, "application/pdf", "report.pdf"),
            to=to)
    text, image, document = sent(ding, 3, rt)
    assert (text["msgKey"], text["param"]["text"]) == ("sampleMarkdown", "your chart and report")
    uploads = uploads_by_name(ding)
    chart_id, chart = uploads["chart.png"]
    report_id, report = uploads["report.pdf"]
    assert (chart["type"], chart["data"], chart["content_type"]) == ("image", PNG, "image/png")
    assert (report["type"], report["data"], report["content_type"]) == ("file", PDF, "application/pdf")
    assert (image["msgKey"], image["param"]) == ("sampleImageMsg", {"photoURL": chart_id})
    assert (document["msgKey"], document["param"]) == ("sampleFile", {"mediaId": report_id, "fileName": "report.pdf",
                                                                      "fileType": "pdf"})
    assert {m["to"] for m in ding.sent} == {to.partition(":")[2]}
    assert {c.path for c in ding.sends()} == {path}
    for call in ding.calls_to("/media/upload"):
        assert call.body["params"]["access_token"] in ding.tokens and call.body["fields"] == ["media"]
    assert wait_until(delivered, 15), rt.log(PID)
    assert OutboundDelivery.objects.get().channel_message_id == text["key"]


def test_stream_mode_a_mentions_answer_with_an_image_goes_to_the_group(tcast, ding, start_runtime):
    stream_plugin()
    rt = start_runtime()
    streaming(rt, ding)
    ding.stream_say("@机器人 script:answer=the chart", group=True)
    assert wait_until(delivered, 30), rt.log(PID)
    enqueue(Plugin.objects.get(), "here it is", (PNG, "image/png", "chart.png"), to=f"group:{GROUP}")
    _, text, image = sent(ding, 3, rt)
    [(media_id, _)] = ding.uploads.items()
    assert text["param"]["text"] == "here it is" and (image["msgKey"], image["param"]) == (
        "sampleImageMsg", {"photoURL": media_id})
    assert {m["to"] for m in ding.sent} == {GROUP}
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() == 2, 15), rt.log(PID)


def test_a_worker_killed_after_an_upload_and_after_a_send_sends_no_part_twice(tcast, ding, start_runtime):
    plugin = dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    # the text and the image reach DingTalk; the report is uploaded, and its send is in the air at the kill
    ding.hold_next(after=2)
    enqueue(plugin, "the files", (PNG, "image/png", "chart.png"), (PDF, "application/pdf", "report.pdf"))
    assert wait_until(ding.held.is_set, 30), rt.log(PID)
    first = rt.worker_pid(PID)
    assert [m["msgKey"] for m in ding.sent] == ["sampleMarkdown", "sampleImageMsg"]
    assert len(ding.calls_to("/media/upload")) == 2
    assert OutboundDelivery.objects.get().state == "in_flight"
    os.kill(first, signal.SIGKILL)
    assert wait_until(delivered, 45), rt.log(PID)
    assert rt.worker_pid(PID) not in (None, first)
    # each part once; the report's media id kept from before the kill: no second upload
    assert [m["msgKey"] for m in ding.sent] == ["sampleMarkdown", "sampleImageMsg", "sampleFile"]
    assert len(ding.calls_to("/media/upload")) == 2
    assert ding.sent[2]["param"]["mediaId"] == uploads_by_name(ding)["report.pdf"][0]


def test_a_file_dingtalk_does_not_take_becomes_a_note_and_the_rest_is_sent(tcast, ding, start_runtime):
    plugin = dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    # (a file over DingTalk's 20 MB is over what the host stores too: test_channel_dingtalk_parts covers it)
    enqueue(plugin, "the files", (b"plain words", "text/plain", "notes.txt"), (PNG, "image/png", "chart.png"))
    text, txt_note, image = sent(ding, 3, rt)
    assert text["param"]["text"] == "the files"
    assert txt_note["msgKey"] == "sampleMarkdown" and txt_note["param"]["text"] == (
        "[notes.txt was not sent: DingTalk's robot sends images (JPG, PNG, GIF, BMP), voice (AMR, WAV) and files of "
        "type doc, docx, xls, xlsx, ppt, pptx, zip, pdf, rar only, not txt]")
    assert image["msgKey"] == "sampleImageMsg"
    assert list(uploads_by_name(ding)) == ["chart.png"]  # the text file was not uploaded
    assert wait_until(delivered, 15), rt.log(PID)


def test_an_upload_or_a_send_dingtalk_refuses_becomes_a_note(tcast, ding, start_runtime):
    plugin = dingtalk_plugin()
    rt = start_runtime()
    listening(rt, ding)
    ding.upload_errcode = 40005
    enqueue(plugin, "first", (PDF, "application/pdf", "report.pdf"))
    text, note = sent(ding, 2, rt)
    assert note["param"]["text"] == "[report.pdf was not sent: DingTalk refused it (errcode 40005: 上传失败)]"
    assert wait_until(delivered, 15), rt.log(PID)
    ding.upload_errcode = None
    ding.refuse_msg_key = "sampleImageMsg"  # the upload taken, the message refused: its note goes instead
    enqueue(plugin, "second", (PNG, "image/png", "chart.png"))
    text, note = sent(ding, 4, rt)[2:]
    assert text["param"]["text"] == "second"
    assert note["param"]["text"] == ("[chart.png was not sent: DingTalk refused it (invalidParameter.msgParam.invalid: "
                                     "消息参数错误)]")
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() == 2, 15), rt.log(PID)
    assert Plugin.objects.get().state == "running"


def test_without_an_app_key_a_file_is_a_note_through_the_session_webhook(tcast, ding, start_runtime):
    session_plugin()
    rt = start_runtime()
    listening(rt, ding)
    ding.say("script:answer=here")
    assert wait_until(delivered, 30), rt.log(PID)
    plugin = Plugin.objects.get()
    enqueue(plugin, "the chart", (PNG, "image/png", "chart.png"))
    _, text, note = sent(ding, 3, rt)
    assert text["param"]["text"] == "the chart"
    assert note["param"]["text"] == ("[chart.png was not sent: the DingTalk worker has no app credentials "
                                     "(DINGTALK_APP_KEY), and a session webhook carries no files]")
    assert not ding.calls_to("/media/upload") and not ding.uploads
    assert [c.body["msgtype"] for c in ding.sends()] == ["markdown"] * 3
    assert wait_until(lambda: OutboundDelivery.objects.filter(state="delivered").count() == 2, 15), rt.log(PID)
