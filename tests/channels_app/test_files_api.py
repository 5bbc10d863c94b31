"""POST /v1/files and GET /v1/files/{id}: ownership and the permission matrix, every refusal, 413, sniffing,
ranges and ETags, retention, the status section, and file parts of a chat turn reaching the engine."""
from __future__ import annotations

import datetime as dt
import io
import json
import wave
import zlib

import pytest
from django.test import Client
from django.utils import timezone

from tests.conftest import OPERATOR_KEY
from tests.support.memory import memory_config  # noqa: F401 - a fixture

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _files_dir(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "ugent_files": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path / "files")}}}
    return tmp_path / "files"


def png_bytes() -> bytes:
    def chunk(kind, data):
        return (len(data).to_bytes(4, "big") + kind + data
                + zlib.crc32(kind + data).to_bytes(4, "big"))
    ihdr = (1).to_bytes(4, "big") + (1).to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00"))
            + chunk(b"IEND", b""))


def wav_bytes(seconds: float = 0.5) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x10\x00" * int(16000 * seconds))
    return out.getvalue()


def upload(who, data: bytes, name="note.txt", conversation_id="c-files", **fields):
    f = io.BytesIO(data)
    f.name = name
    body = {"file": f, **({"conversation_id": conversation_id} if conversation_id is not None else {})}
    body.update({k: v for k, v in who.items() if k != "key"})
    body.update(fields)
    headers = {"HTTP_X_API_KEY": who["key"]} if who.get("key") else {}
    return Client().post("/v1/files", data=body, **headers)


def download(who, file_id, **headers):
    params = {k: v for k, v in who.items() if k != "key"}
    if who.get("key"):
        headers["HTTP_X_API_KEY"] = who["key"]
    return Client().get(f"/v1/files/{file_id}", params, **headers)


def send(who, content, conversation_id="c-files", **extra):
    body = {"messages": [{"role": "user", "content": content}], "conversation_id": conversation_id}
    body.update({k: v for k, v in who.items() if k != "key"})
    body.update(extra)
    return Client().post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                         HTTP_X_API_KEY=who["key"])


def error(resp):
    return resp.json()["error"]


# --- upload ------------------------------------------------------------------

def test_an_upload_answers_the_file_object_and_its_first_upload_owns_the_conversation(tcast):
    from channels_app.models import Conversation, File
    resp = upload(tcast.alice, b"hello files", name="hello.txt")
    assert resp.status_code == 200, resp.content
    body = resp.json()
    assert body["object"] == "file" and body["id"].startswith("file-")
    assert body["bytes"] == 11 and body["filename"] == "hello.txt" and body["purpose"] == "user_data"
    assert body["mime"] == "text/plain" and body["url"] == f"/v1/files/{body['id']}"
    assert isinstance(body["created_at"], int)
    conv = Conversation.objects.get(external_id="c-files")
    assert conv.owner.key == "web:alice"
    assert File.objects.get(file_id=body["id"]).conversation == conv


def test_an_upload_into_someone_elses_conversation_is_refused_and_stores_nothing(tcast, _files_dir):
    from channels_app.models import File
    assert send(tcast.alice, "mine").status_code == 200
    before = sorted(p.name for p in _files_dir.glob("*")) if _files_dir.exists() else []
    resp = upload(tcast.bob, b"intruder", name="x.txt")
    assert resp.status_code == 403
    assert error(resp)["message"] == "This conversation belongs to another user."
    assert error(resp)["code"] == "conversation_not_owned"
    assert File.objects.count() == 0
    after = sorted(p.name for p in _files_dir.glob("*")) if _files_dir.exists() else []
    assert after == before


def test_a_file_then_a_message_keeps_the_uploader_the_owner(tcast):
    assert upload(tcast.carol, b"first", conversation_id="c-carol").status_code == 200
    assert send(tcast.alice, "hi", conversation_id="c-carol").status_code == 403
    assert send(tcast.carol, "hi", conversation_id="c-carol").status_code == 200


def test_an_application_naming_a_plain_user_is_refused_as_for_a_turn(tcast):
    from channels_app.models import Conversation, File
    resp = upload({"key": tcast.keys["app"], "user": "alice"}, b"x")
    assert resp.status_code == 403
    assert error(resp)["message"] == ("An application key may name only federated users of the issuers it "
                                      "lists (federation_issuer with federation_subject).")
    assert File.objects.count() == 0 and not Conversation.objects.exists()


@pytest.mark.parametrize("who, status", [({}, 401), ({"key": "ugk_wrong"}, 401)])
def test_an_upload_needs_a_key(tcast, who, status):
    from channels_app.models import File
    assert upload(who, b"x").status_code == status
    assert File.objects.count() == 0


def test_refusals_name_what_is_wrong_and_change_nothing(tcast):
    from channels_app.models import Conversation, File
    no_conv = upload(tcast.alice, b"x", conversation_id=None)
    assert no_conv.status_code == 400 and error(no_conv)["param"] == "conversation_id"
    empty = upload(tcast.alice, b"")
    assert empty.status_code == 400 and error(empty)["message"] == "file: The submitted file is empty."
    no_file = Client().post("/v1/files", data={"conversation_id": "c-files"}, HTTP_X_API_KEY=OPERATOR_KEY)
    assert no_file.status_code == 400 and error(no_file)["message"] == "file: No file was submitted."
    purpose = upload(tcast.alice, b"x", purpose="fine-tune")
    assert purpose.status_code == 400 and error(purpose)["param"] == "purpose"
    half = upload({"key": tcast.keys["app"]}, b"x",
                  federation_issuer="example-crm")
    assert half.status_code == 400
    assert error(half)["message"] == "federation_issuer and federation_subject go together."
    json_body = Client().post("/v1/files", data=json.dumps({"conversation_id": "c"}), content_type="application/json",
                              HTTP_X_API_KEY=OPERATOR_KEY)
    assert json_body.status_code == 415
    garbage = Client().post("/v1/files", data=b"--x\r\nnot multipart", content_type="multipart/form-data; boundary=x",
                            HTTP_X_API_KEY=OPERATOR_KEY)
    assert garbage.status_code == 400
    assert File.objects.count() == 0 and not Conversation.objects.exists()


def test_a_file_past_the_limit_is_a_413_and_stores_nothing(tcast, settings):
    from channels_app.models import Conversation, File
    settings.UGENT_FILES_MAX_BYTES = 1000
    resp = upload(tcast.alice, b"a" * 1001)
    assert resp.status_code == 413
    assert error(resp)["message"] == ("The file is larger than this daemon takes: at most 1000 bytes "
                                      "(UGENT_FILES_MAX_BYTES).")
    assert upload(tcast.alice, b"a" * 1000).status_code == 200  # the limit itself is taken
    big = upload(tcast.alice, b"a" * 200_000)  # refused by its Content-Length, before the body is parsed
    assert big.status_code == 413
    assert File.objects.count() == 1 and Conversation.objects.count() == 1


def test_the_type_is_sniffed_from_the_bytes_and_the_clients_name_kept(tcast):
    png = upload(tcast.alice, png_bytes(), name="picture.txt").json()
    assert png["mime"] == "image/png" and png["filename"] == "picture.txt"
    wav = upload(tcast.alice, wav_bytes(), name="voice.bin").json()
    assert wav["mime"] == "audio/wav"
    blob = upload(tcast.alice, bytes(range(256)) * 4, name="image.png").json()
    assert blob["mime"] == "application/octet-stream"
    resp = download(tcast.alice, png["id"])
    assert resp["Content-Type"] == "image/png"
    assert "picture.txt" in resp["Content-Disposition"]


# --- download: who ------------------------------------------------------------

def test_the_permission_matrix_of_a_download(tcast):
    fid = upload(tcast.alice, b"alice's file").json()["id"]
    carol_fid = upload(tcast.carol, b"carol's file", conversation_id="c-carol").json()["id"]
    assert download(tcast.alice, fid).status_code == 200  # the owner
    assert download({"key": OPERATOR_KEY}, fid).status_code == 200  # the operator itself
    assert download({"key": OPERATOR_KEY}, carol_fid).status_code == 200
    assert download(tcast.carol, carol_fid).status_code == 200  # a federated owner through the application
    for who in (tcast.bob, tcast.carol, {"key": tcast.keys["app"]}, {"key": tcast.keys["outsider"]}):
        resp = download(who, fid)
        assert resp.status_code == 404, who
        assert error(resp)["message"] == "No such file." and error(resp)["code"] == "file_not_found"
    assert download({"key": tcast.keys["app"]}, carol_fid).status_code == 404  # its anonymous user is not carol
    assert download(tcast.alice, "file-doesnotexist").json() == download(tcast.bob, fid).json()
    assert download({}, fid).status_code == 401
    assert download({"key": "ugk_wrong"}, fid).status_code == 401
    assert download({"key": tcast.keys["app"], "user": "alice"}, fid).status_code == 403



@pytest.mark.parametrize("path_id", ["%00", "a%00b", "a%0Ab", "%ED%A0%80", "x" * 65, "a.b", "a%20b"])
def test_an_id_no_file_could_have_is_a_404_as_a_missing_file(tcast, path_id):
    # a NUL reached the query: a 404 on SQLite, PostgreSQL's "cannot contain NUL" as a 500
    resp = Client().get(f"/v1/files/{path_id}", {"user": "alice"}, HTTP_X_API_KEY=OPERATOR_KEY)
    assert resp.status_code == 404 and error(resp)["code"] == "file_not_found", resp.content
    assert error(resp) == error(download(tcast.alice, "file-doesnotexist"))

# --- download: ranges and validators --------------------------------------------

DATA = bytes(range(100))


@pytest.fixture
def stored(tcast):
    return upload(tcast.alice, DATA, name="bytes.bin").json()["id"]


def ranged(tcast, fid, header):
    return download(tcast.alice, fid, HTTP_RANGE=header)


def test_a_whole_download_says_it_takes_ranges(tcast, stored):
    resp = download(tcast.alice, stored)
    assert resp.status_code == 200 and resp.content == DATA
    assert resp["Accept-Ranges"] == "bytes" and resp["Content-Length"] == "100"
    assert resp["ETag"].startswith('"') and "Content-Range" not in resp


@pytest.mark.parametrize("header, start, end", [
    ("bytes=0-0", 0, 0),  # the first byte
    ("bytes=0-9", 0, 9),
    ("bytes=10-", 10, 99),  # open
    ("bytes=-10", 90, 99),  # suffix
    ("bytes=-500", 0, 99),  # a suffix longer than the file: all of it
    ("bytes=95-500", 95, 99),  # a last byte past the end is cut to it
    ("bytes=99-99", 99, 99),  # the last byte
    ("BYTES = 5 - 6", 5, 6),
])
def test_one_range_is_a_206_with_its_content_range(tcast, stored, header, start, end):
    resp = ranged(tcast, stored, header)
    assert resp.status_code == 206, header
    assert resp.content == DATA[start:end + 1]
    assert resp["Content-Range"] == f"bytes {start}-{end}/100"
    assert resp["Content-Length"] == str(end - start + 1)


@pytest.mark.parametrize("header", ["bytes=100-", "bytes=100-200", "bytes=5000-", "bytes=-0"])
def test_a_range_past_the_end_is_a_416_naming_the_size(tcast, stored, header):
    resp = ranged(tcast, stored, header)
    assert resp.status_code == 416, header
    assert resp["Content-Range"] == "bytes */100"
    assert error(resp)["message"] == "The range starts past the end of the file (100 bytes)."


@pytest.mark.parametrize("header", ["bytes=0-1,5-6", "bytes=9-3", "bytes=abc", "items=0-5", "bytes=-", "bytes",
                                    "bytes=1-2-3", "bytes=" + "9" * 300])
def test_ranges_it_does_not_serve_get_the_whole_file(tcast, stored, header):
    resp = ranged(tcast, stored, header)
    assert resp.status_code == 200, header
    assert resp.content == DATA and "Content-Range" not in resp


def test_the_etag_answers_304_and_if_range_guards_a_range(tcast, stored):
    tag = download(tcast.alice, stored)["ETag"]
    same = download(tcast.alice, stored, HTTP_IF_NONE_MATCH=tag)
    assert same.status_code == 304 and same.content == b"" and same["ETag"] == tag
    assert download(tcast.alice, stored, HTTP_IF_NONE_MATCH=f'"other", W/{tag}').status_code == 304
    assert download(tcast.alice, stored, HTTP_IF_NONE_MATCH="*").status_code == 304
    assert download(tcast.alice, stored, HTTP_IF_NONE_MATCH='"other"').status_code == 200
    assert download(tcast.bob, stored, HTTP_IF_NONE_MATCH=tag).status_code == 404  # no hint for another user
    assert download(tcast.alice, stored, HTTP_RANGE="bytes=0-1", HTTP_IF_RANGE=tag).status_code == 206
    assert download(tcast.alice, stored, HTTP_RANGE="bytes=0-1", HTTP_IF_RANGE='"old"').status_code == 200


def test_an_empty_range_of_an_empty_file_cannot_be_satisfied():
    from channels_app.files import range_parse
    assert range_parse("bytes=0-", 0).unsatisfiable
    assert range_parse("bytes=-5", 0).unsatisfiable
    assert range_parse(None, 0).whole


# --- retention -------------------------------------------------------------------

def test_an_expired_file_is_a_404_and_the_job_deletes_its_bytes_and_row(tcast, _files_dir):
    from channels_app import tasks
    from channels_app.models import File
    old = upload(tcast.alice, b"old").json()["id"]
    kept = upload(tcast.alice, b"kept").json()["id"]
    File.objects.filter(file_id=old).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    old_name = File.objects.get(file_id=old).storage_name
    assert (_files_dir / old_name).exists()
    assert download(tcast.alice, old).status_code == 404  # before the job runs
    assert tasks.prune_files.delay() is not None  # eager in tests: the task runs the service
    assert not File.objects.filter(file_id=old).exists()
    assert not (_files_dir / old_name).exists()
    assert download(tcast.alice, kept).content == b"kept"
    assert tasks.prune_files.apply().result == 0  # a second run finds nothing


def test_the_expiry_follows_the_media_ttl(tcast, settings):
    settings.UGENT_PLUGIN_MEDIA_TTL_SECS = 120
    body = upload(tcast.alice, b"x").json()
    assert body["expires_at"] - body["created_at"] in (119, 120, 121)


def test_beat_schedules_the_retention_job(tcast):
    from django_celery_beat.models import PeriodicTask
    from channels_app.tasks import _retention_schedule
    _retention_schedule()
    _retention_schedule()  # idempotent
    task = PeriodicTask.objects.get(task="channels_app.tasks.prune_files")
    assert task.enabled and task.interval.every > 0


def test_a_file_part_of_an_expired_file_is_refused(tcast):
    from channels_app.models import File
    fid = upload(tcast.alice, b"x").json()["id"]
    File.objects.filter(file_id=fid).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    resp = send(tcast.alice, [{"type": "file", "file": {"file_id": fid}}])
    assert resp.status_code == 400 and error(resp)["code"] == "file_not_found"


# --- status ----------------------------------------------------------------------

def test_status_reports_files(tcast, settings):
    upload(tcast.alice, b"12345")
    upload(tcast.alice, b"123")
    files = Client().get("/v1/ugent/status", HTTP_X_API_KEY=OPERATOR_KEY).json()["status"]["files"]
    assert files["count"] == 2 and files["bytes"] == 8
    assert files["retention_secs"] == settings.UGENT_PLUGIN_MEDIA_TTL_SECS
    assert files["max_bytes"] == settings.UGENT_FILES_MAX_BYTES
    assert files["storage"] == "FileSystemStorage"


# --- file parts of a chat turn ---------------------------------------------------------

def test_a_file_part_reaches_a_text_engine_as_its_text(tcast):
    from tests.support.scripted import CALLS
    fid = upload(tcast.alice, b"The launch code is 4711.", name="secret.txt").json()["id"]
    CALLS.clear()
    resp = send(tcast.alice, [{"type": "text", "text": "what is the code?"},
                              {"type": "file", "file": {"file_id": fid}}])
    assert resp.status_code == 200, resp.content
    last = CALLS[-1]["messages"][-1][1]
    assert "[file 'secret.txt' (text/plain, 24 bytes)]" in last and "The launch code is 4711." in last
    assert last.endswith("what is the code?")


def docx_bytes(text: str) -> bytes:
    import docx
    d = docx.Document()
    d.add_paragraph(text)
    out = io.BytesIO()
    d.save(out)
    return out.getvalue()


def pdf_bytes(text: str) -> bytes:
    """A one-page PDF showing `text`, with a correct cross-reference table."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 4 0 R >> >> "
            b"/Contents 5 0 R >>", b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
            b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return bytes(out)


@pytest.mark.parametrize("make, name, mime", [(pdf_bytes, "report.pdf", "application/pdf"),
                                              (docx_bytes, "memo.docx", "officedocument")])
def test_pdf_and_docx_parts_reach_a_text_engine_as_their_text(tcast, make, name, mime):
    from tests.support.scripted import CALLS
    body = upload(tcast.alice, make("Quarterly figures rose"), name=name).json()
    assert mime in body["mime"]
    CALLS.clear()
    assert send(tcast.alice, [{"type": "text", "text": "summarise"},
                              {"type": "file", "file": {"file_id": body["id"]}}]).status_code == 200
    assert "Quarterly figures rose" in CALLS[-1]["messages"][-1][1]


def test_a_file_that_holds_no_text_is_named_for_a_text_engine(tcast):
    from tests.support.scripted import CALLS
    fid = upload(tcast.alice, png_bytes(), name="p.png").json()["id"]
    CALLS.clear()
    assert send(tcast.alice, [{"type": "image_url", "image_url": {"url": f"/v1/files/{fid}"}},
                              {"type": "text", "text": "see"}]).status_code == 200
    assert "(no text can be read from this kind of file)" in CALLS[-1]["messages"][-1][1]


def _multimodal_profile(name="mm"):
    """A profile whose engine takes images and audio itself (the scripted engine, multimodal); the last
    message of each of its calls is kept in the list returned."""
    from ovos_plugin_manager.templates.agents import MultimodalChatEngine
    from plugins_app.agent.engines.registry import register_engine
    from plugins_app.agent.models import AgentProfile
    from tests.support.scripted import ScriptedEngine
    class Seen(list):
        calls: list

    seen = Seen()
    seen.calls = []

    class Multimodal(ScriptedEngine, MultimodalChatEngine):
        def stream_events(self, messages, **kwargs):
            seen.append(messages[-1])
            seen.calls.append(list(messages))
            return super().stream_events(messages, **kwargs)

    register_engine("scripted-mm", Multimodal)
    AgentProfile.objects.create(name=name, provider="scripted-mm")
    return seen


def test_a_multimodal_engine_gets_the_bytes(tcast):
    import base64
    seen = _multimodal_profile()
    png, wav = png_bytes(), wav_bytes(0.1)
    pid = upload(tcast.alice, png, name="p.png").json()["id"]
    wid = upload(tcast.alice, wav, name="v.wav").json()["id"]
    tid = upload(tcast.alice, b"plain words", name="t.txt").json()["id"]
    resp = send(tcast.alice, [{"type": "text", "text": "look and listen"},
                              {"type": "image_url", "image_url": {"file_id": pid}},
                              {"type": "input_audio", "input_audio": {"file_id": wid}},
                              {"type": "file", "file": {"file_id": tid}}], model="mm")
    assert resp.status_code == 200, resp.content
    last = seen[-1]
    assert last.content == "look and listen"
    assert [base64.b64decode(x) for x in last.image_content] == [png]
    assert [base64.b64decode(x) for x in last.audio_content] == [wav]
    assert [base64.b64decode(x) for x in last.file_content] == [b"plain words"]


def test_a_multimodal_engine_gets_every_message_as_a_multimodal_one(tcast):
    """Seed 001: MultimodalChatEngine is the contract over MultimodalAgentMessage. The history, the system
    text and a turn with no file come as MultimodalAgentMessages (empty media lists) too."""
    from ovos_plugin_manager.templates.agents import MultimodalAgentMessage
    seen = _multimodal_profile()
    assert send(tcast.alice, "first words", model="mm", conversation_id="c-mm").status_code == 200
    assert send(tcast.alice, "second words", model="mm", conversation_id="c-mm").status_code == 200
    messages = seen.calls[-1]
    assert [m.content for m in messages if m.role == "user"][-2:] == ["first words", "second words"]
    assert len(messages) >= 3 and all(isinstance(m, MultimodalAgentMessage) for m in messages), messages
    assert all(m.image_content == [] for m in messages)


def test_a_multimodal_engine_gets_the_bytes_when_memory_recalls_too(tcast, memory_config):
    """Recall puts the user's facts before the message; the message itself stays the turn's own, files and
    all (seed 001: a MultimodalChatEngine's media must survive)."""
    import base64
    from plugins_app.agent.memory import services
    from tests.support.scripted import CALLS
    memory_config.backend("sqlite_fts")
    services.fact_save(actor_key="web:alice", text="User likes green tea.")
    seen = _multimodal_profile()
    png = png_bytes()
    pid = upload(tcast.alice, png, name="p.png").json()["id"]
    resp = send(tcast.alice, [{"type": "text", "text": "which tea do I like"},
                              {"type": "image_url", "image_url": {"file_id": pid}}], model="mm")
    assert resp.status_code == 200, resp.content
    last = seen[-1]
    assert last.content == "which tea do I like"
    assert [base64.b64decode(x) for x in last.image_content] == [png]
    assert any("green tea" in text for _role, text in CALLS[-1]["messages"][:-1])  # and the fact was recalled


def test_a_file_part_of_another_conversation_or_user_is_refused_and_runs_nothing(tcast):
    from channels_app.models import Receipt
    from tests.support.scripted import CALLS
    bobs = upload(tcast.bob, b"bob's", conversation_id="c-bob").json()["id"]
    other_conv = upload(tcast.alice, b"elsewhere", conversation_id="c-other").json()["id"]
    send(tcast.alice, "start")
    CALLS.clear()
    receipts = Receipt.objects.count()
    for fid in (bobs, other_conv, "file-missing"):
        resp = send(tcast.alice, [{"type": "text", "text": "x"}, {"type": "file", "file": {"file_id": fid}}])
        assert resp.status_code == 400, fid
        assert error(resp)["message"] == (f"No such file in this conversation: {fid}. A file part names a file "
                                          "uploaded to the same conversation by the same user (POST /v1/files).")
    assert CALLS == [] and Receipt.objects.count() == receipts


@pytest.mark.parametrize("part", [{"type": "file", "file": {}}, {"type": "file", "file": "x"},
                                  {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "video"},
                                  # PostgreSQL cannot compare either: a lone surrogate was a 500 there
                                  {"type": "file", "file": {"file_id": "\ud800"}},
                                  {"type": "file", "file": {"file_id": "a\x00b"}}])
def test_a_part_that_names_no_uploaded_file_is_a_400(tcast, part):
    resp = send(tcast.alice, [part])
    assert resp.status_code == 400
    assert "this daemon reads text and file parts only." in error(resp)["message"]


def test_a_repeat_with_other_files_is_a_content_mismatch(tcast):
    a = upload(tcast.alice, b"a").json()["id"]
    b = upload(tcast.alice, b"b").json()["id"]
    first = send(tcast.alice, [{"type": "file", "file": {"file_id": a}}], client_message_id="m1")
    assert first.status_code == 200
    again = send(tcast.alice, [{"type": "file", "file": {"file_id": a}}], client_message_id="m1")
    assert again.status_code == 409 and error(again)["code"] == "DuplicateProcessed"
    other = send(tcast.alice, [{"type": "file", "file": {"file_id": b}}], client_message_id="m1")
    assert other.status_code == 409 and error(other)["code"] == "DuplicateContentMismatch"


# --- admin -----------------------------------------------------------------------------

def test_the_admin_lists_files_read_only(tcast, admin_client):
    from channels_app.models import File
    fid = upload(tcast.alice, b"listed", name="listed.txt").json()["id"]
    upload(tcast.bob, png_bytes(), name="other.png", conversation_id="c-bob")
    page = admin_client.get("/admin/channels_app/file/", {"q": "listed"}).content.decode()
    assert fid in page and "other.png" not in page
    assert "listed.txt" in admin_client.get("/admin/channels_app/file/", {"mime__exact": "text/plain"}).content.decode()
    pk = File.objects.get(file_id=fid).pk
    assert admin_client.get("/admin/channels_app/file/add/").status_code == 403
    assert admin_client.post(f"/admin/channels_app/file/{pk}/change/", {"filename": "renamed"}).status_code == 403
    assert admin_client.post(f"/admin/channels_app/file/{pk}/delete/", {"post": "yes"}).status_code == 403
    assert File.objects.get(pk=pk).filename == "listed.txt"


def test_a_file_whose_bytes_are_gone_is_a_404_not_a_failure(tcast, _files_dir):
    from channels_app.models import File
    from tests.support.scripted import CALLS
    fid = upload(tcast.alice, b"soon gone", name="gone.txt").json()["id"]
    (_files_dir / File.objects.get(file_id=fid).storage_name).unlink()
    resp = download(tcast.alice, fid)
    assert resp.status_code == 404 and error(resp)["message"] == "No such file."
    CALLS.clear()
    chat = send(tcast.alice, [{"type": "text", "text": "read it"}, {"type": "file", "file": {"file_id": fid}}])
    assert chat.status_code == 200
    assert "(its bytes are gone: retention deleted them)" in CALLS[-1]["messages"][-1][1]


def test_head_answers_the_headers_of_a_download(tcast, stored):
    resp = Client().head(f"/v1/files/{stored}", {"user": "alice"}, HTTP_X_API_KEY=OPERATOR_KEY, HTTP_RANGE="bytes=0-9")
    assert resp.status_code == 206 and resp["Content-Range"] == "bytes 0-9/100"
    assert resp["Accept-Ranges"] == "bytes"


def test_the_s3_option_loads_django_storages_s3_backend_with_its_settings(tmp_path):
    """No bucket to reach here: the backend loads, with the bucket, endpoint and prefix from the env."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PYTEST"))}
    env.update(UGENT_VAR_DIR=str(tmp_path), UGENT_FILES_STORAGE="s3", UGENT_FILES_S3_BUCKET="ugent-test",
               UGENT_FILES_S3_ENDPOINT_URL="http://127.0.0.1:9", UGENT_FILES_S3_ACCESS_KEY_ID="AKIDTEST",
               UGENT_FILES_S3_SECRET_ACCESS_KEY="secret", UGENT_FILES_S3_PREFIX="files-here")
    code = ("import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'ugent_site.settings'); django.setup();"
            "from django.core.files.storage import storages; s = storages['ugent_files'];"
            "print(type(s).__name__, s.bucket_name, s.location, s.endpoint_url, s.default_acl, s.querystring_auth)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["S3Storage", "ugent-test", "files-here", "http://127.0.0.1:9", "None", "False"]


# --- voice messages: what can hear them (channels_app/voice.py) ----------------------------------

def test_a_voice_message_nothing_can_hear_is_answered_with_why_without_a_model_call(tcast):
    from channels_app import voice
    from channels_app.models import Receipt, Turn
    from tests.support.scripted import CALLS
    wid = upload(tcast.alice, wav_bytes(0.1), name="v.wav").json()["id"]
    CALLS.clear()
    resp = send(tcast.alice, [{"type": "input_audio", "input_audio": {"file_id": wid}}], ugent_input_mode="voice")
    assert resp.status_code == 200, resp.content
    turn = Turn.objects.get()
    expected = voice.UNHEARD_ANSWER.format(model=turn.model)
    assert turn.model and resp.json()["choices"][0]["message"]["content"] == expected
    assert CALLS == []  # no model call
    receipt = Receipt.objects.get()
    assert (receipt.state, receipt.reason, receipt.answer) == ("refused", voice.UNHEARD_REASON, expected)
    # words of its own are what the turn reads (as a transcript's would be): the model is called
    resp = send(tcast.alice, [{"type": "text", "text": "hello there"},
                              {"type": "input_audio", "input_audio": {"file_id": wid}}], ugent_input_mode="voice")
    assert resp.status_code == 200 and len(CALLS) == 1
    # and a recording sent as a typed message is only a file: the model is called
    send(tcast.alice, [{"type": "input_audio", "input_audio": {"file_id": wid}}])
    assert len(CALLS) == 2


def test_a_voice_message_reaches_a_model_that_takes_audio(tcast):
    import base64
    seen = _multimodal_profile()
    wav = wav_bytes(0.1)
    wid = upload(tcast.alice, wav, name="v.wav").json()["id"]
    resp = send(tcast.alice, [{"type": "input_audio", "input_audio": {"file_id": wid}}], ugent_input_mode="voice",
                model="mm")
    assert resp.status_code == 200, resp.content
    assert [base64.b64decode(x) for x in seen[-1].audio_content] == [wav]


def test_status_says_which_models_can_hear_a_voice_message(tcast):
    def voice_input():
        r = Client().get("/v1/ugent/status", HTTP_X_API_KEY=tcast.keys["operator"])
        assert r.status_code == 200
        return r.json()["status"]["media"]["voice"]["input"]
    assert voice_input() == {"available": False, "reason": "no_engine", "transcription": False,
                             "dictation": False, "native_models": []}
    from plugins_app.agent.models import AgentProfile
    AgentProfile.objects.create(name="gone", provider="not-installed")  # hears nothing, breaks nothing
    _multimodal_profile("listener")
    assert voice_input() == {"available": True, "transcription": False, "dictation": False,
                             "native_models": ["listener"]}
