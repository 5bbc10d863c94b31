"""channel-weixin's parts on their own: the signatures and the safe-mode crypto against every weixin vector,
the server URL's answers (URL check, plaintext and safe mode, replays), normalisation of each message type,
splitting by bytes within WeChat's 5 messages, the access token's cache and refresh, the API client's answers
to WeChat's errcodes, media in and out, and the sent journal across a resumed delivery."""
from __future__ import annotations

import json
import time
import sys
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import pytest

from plugins_app.channel.sdk import Attachment, Delivery, DeliveryFailed, Media
from plugins_app.channel.sdk.wxcrypto import CryptoError, MsgCrypt, parse_xml
from plugins_app.channel.sdk.wxcrypto import signature as msg_signature
from plugins_app.channel.workers import installed_kinds
from plugins_app.channel.workers.weixin import (CUT_NOTE, ENV_REFS, MAX_MESSAGES, WeixinWorker, message_parts,
                                                normalise, upload_name, utf8_len)
from plugins_app.channel.workers.weixin.api import (TEXT_LIMIT_BYTES, AppRefused, RateLimited, Stopped,
                                                    UserUnreachable, WeixinApi, WeixinError)
from plugins_app.channel.workers.weixin.callback import SUCCESS, CallbackServer, signature
from tests.fakes.weixin import ACCOUNT, OTHER_USER, USER, FakeWeixin

DATA = Path(__file__).resolve().parents[1] / "data"
VECTORS = json.loads((DATA / "webhook-signature-vectors.json").read_text())["vectors"]
WEIXIN = [v for v in VECTORS if v["id"].startswith("weixin-mp-")]
AES = [v["id"] for v in WEIXIN if v["id"].startswith("weixin-mp-aes-")]


def vector(vector_id: str) -> tuple[dict, dict]:
    v = next(v for v in VECTORS if v["id"] == vector_id)
    return v["inputs"], v["expected"]


def test_every_weixin_vector_is_taken_by_one_of_the_tests():
    assert sorted(v["id"] for v in WEIXIN) == sorted(["weixin-mp-plain-signature", *AES])
    assert len(AES) == 2


# -- the signatures and the crypto: every vector -----------------------------------------------------

def test_the_plain_signature_vector_and_its_negative_case():
    i, e = vector("weixin-mp-plain-signature")
    assert signature(i["token"], i["timestamp"], i["nonce"]) == e["signature"]
    s = server([], token=i["token"], now=int(i["timestamp"]))
    query = {"signature": e["signature"], "timestamp": i["timestamp"], "nonce": i["nonce"], "echostr": "hello 42"}
    assert s.handle("GET", "/weixin/callback?" + urlencode(query), b"") == (200, "hello 42")
    for case in e["negative_cases"]:
        assert case["valid"] is False
        bad = {**query, "signature": case["signature"]}
        assert s.handle("GET", "/weixin/callback?" + urlencode(bad), b"") == (403, "")
    assert s.handle("GET", "/weixin/callback?" + urlencode({**query, "nonce": "test1"}), b"") == (403, "")
    assert s.handle("GET", "/weixin/callback?" + urlencode({**query, "signature": ""}), b"") == (403, "")
    assert s.handle("GET", "/weixin/callback", b"") == (403, "")
    assert s.handle("GET", "/elsewhere?" + urlencode(query), b"")[0] == 404


@pytest.mark.parametrize("vector_id", AES)
def test_safe_mode_encryption_with_the_vectors_fixed_random_gives_their_ciphertext(vector_id):
    i, e = vector(vector_id)
    crypto = MsgCrypt(i["token"], i["encoding_aes_key"], i["receiveid"])
    assert crypto.encrypt(i["plaintext"], random16=i["random16"].encode()) == e["encrypt"]
    assert crypto.decrypt(e["encrypt"]) == i["plaintext"]
    with pytest.raises(CryptoError):  # another account's AppID
        MsgCrypt(i["token"], i["encoding_aes_key"], "wx0000000000000000").decrypt(e["encrypt"])


@pytest.mark.parametrize("vector_id", AES)
def test_the_server_takes_a_vectors_ciphertext_in_safe_mode_and_refuses_it_altered(vector_id):
    i, e = vector(vector_id)
    i = {"timestamp": "1409304348", "nonce": "xxxxxx", **i}  # (the second vector names only the first's)
    records: list = []
    crypto = MsgCrypt(i["token"], i["encoding_aes_key"], i["receiveid"])
    s = server(records, token=i["token"], crypto=crypto, now=int(i["timestamp"]))
    params = {"signature": signature(i["token"], i["timestamp"], i["nonce"]), "timestamp": i["timestamp"],
              "nonce": i["nonce"], "openid": USER, "encrypt_type": "aes",
              "msg_signature": msg_signature(i["token"], i["timestamp"], i["nonce"], e["encrypt"])}
    body = f"<xml><ToUserName><![CDATA[{ACCOUNT}]]></ToUserName><Encrypt><![CDATA[{e['encrypt']}]]></Encrypt></xml>"
    target = "/weixin/callback?" + urlencode(params)
    if i["plaintext"].startswith("<xml>"):
        assert s.handle("POST", target, body.encode()) == (200, SUCCESS)
        assert records == [parse_xml(i["plaintext"])] and records[0]["MsgType"] == "video"
    else:  # not a message: answered, so WeChat does not call again, and nothing recorded
        assert s.handle("POST", target, body.encode()) == (200, SUCCESS) and records == []
    altered = body.replace(e["encrypt"][:8], "A" * 8).encode()
    assert s.handle("POST", target, altered) == (403, "")
    forged = "/weixin/callback?" + urlencode({**params, "msg_signature": "0" * 40})
    assert s.handle("POST", forged, body.encode()) == (403, "")
    assert len(records) <= 1


# -- the server URL ------------------------------------------------------------------------------------

fake = FakeWeixin()  # not started: its builders and crypto only
fake.callback_url = "http://127.0.0.1:9/weixin/callback"


NOW = 1733480000  # a fixed clock (2024-12-06), and the timestamps of the requests made for it


def server(records: list, *, token: str = fake.token, crypto: MsgCrypt | None = None, now: float | None = None,
           on_message=None, seen_path: str | None = None) -> CallbackServer:
    import time
    s = CallbackServer("127.0.0.1:0", "/weixin/callback", token, crypto, on_message or records.append,
                       clock=(lambda: now) if now is not None else time.time, seen_path=seen_path)
    s.httpd.server_close()
    return s


def target_of(message: dict, **kw) -> tuple[str, bytes]:
    url, body = fake.request(message, **kw)
    parts = urlsplit(url)
    return f"{parts.path}?{parts.query}", body


def test_a_plaintext_post_is_recorded_when_signed_and_answered_success():
    records: list = []
    s = server(records)
    message = fake.text("你好")
    target, body = target_of(message, safe=False)
    assert s.handle("POST", target, body) == (200, "success")
    assert records == [message]
    assert s.handle("POST", target, body) == (200, "success")  # WeChat calling again: the same request
    forged, _ = target_of(message, safe=False, signature="0" * 40)
    assert s.handle("POST", forged, body) == (403, "")
    other = fake.to_xml(fake.text("forged")).encode()
    assert s.handle("POST", target, other) == (403, "")  # a seen signature with another body
    assert s.handle("POST", target_of(fake.text("x"), safe=False)[0], None)[0] == 413
    entity = b'<!DOCTYPE x [<!ENTITY a "b">]><xml><Content>&a;</Content></xml>'
    assert s.handle("POST", target_of(fake.text("y"), safe=False)[0], entity) == (200, "success")
    assert len(records) == 2  # the message, and its repeat (the worker's MsgId check drops the repeat)


def test_a_url_checks_signature_from_an_access_log_cannot_sign_a_plaintext_post():
    records: list = []
    s = server(records, now=NOW)
    target, body = target_of(fake.text("forged by a log reader"), safe=False, timestamp=str(NOW))
    check = target.replace("&openid=", "&echostr=42&openid=")  # the GET's query: signature, timestamp, nonce
    assert s.handle("GET", check, b"") == (200, "42")
    assert s.handle("POST", target, body) == (403, "") and records == []


def test_the_signatures_seen_outlive_a_restart_of_the_worker(tmp_path):
    seen = str(tmp_path / "weixin-main.weixin-seen.log")
    records: list = []
    first = server(records, now=NOW, seen_path=seen)
    target, body = target_of(fake.text("the real one"), safe=False, timestamp=str(NOW))
    assert first.handle("POST", target, body) == (200, SUCCESS)
    check, _ = target_of(fake.text("unused"), safe=False, timestamp=str(NOW))
    assert first.handle("GET", check + "&echostr=7", b"") == (200, "7")
    first._seen.close()
    again = server(records, now=NOW + 60, seen_path=seen)  # the worker restarted within --max-age
    forged = fake.to_xml(fake.text("forged")).encode()
    assert again.handle("POST", target, forged) == (403, "")  # the POST's signature, another body
    assert again.handle("POST", check, forged) == (403, "")   # the GET's signature
    assert again.handle("POST", target, body) == (200, SUCCESS)  # WeChat calling again: the very same request
    assert [r["Content"] for r in records] == ["the real one", "the real one"]
    again._seen.close()
    later = server(records, now=NOW + 601, seen_path=seen)  # past twice --max-age: forgotten, and the file too
    assert later._seen.entries == {}
    later._seen.close()


def test_safe_mode_refuses_plaintext_and_plaintext_mode_refuses_ciphertext():
    records: list = []
    safe = server(records, crypto=fake.crypto)
    target, body = target_of(fake.text("plain"), safe=False)
    assert safe.handle("POST", target, body) == (403, "")
    target, body = target_of(fake.text("sealed"), safe=True)
    assert safe.handle("POST", target, body) == (200, "success")
    plain = server(records)
    assert plain.handle("POST", target, body) == (403, "")  # no EncodingAESKey to open it with
    other_app = MsgCrypt(fake.token, fake.encoding_aes_key, "wx0000000000000000")
    target, body = target_of(fake.text("another account"), safe=True, crypto=other_app)
    assert safe.handle("POST", target, body) == (403, "")
    assert [r["Content"] for r in records] == ["sealed"]


def test_a_request_whose_timestamp_is_old_or_no_number_is_refused():
    records: list = []
    target, body = target_of(fake.text("late"), safe=False, timestamp=str(NOW))
    for now in (NOW + 301, NOW - 301):
        assert server(records, now=now).handle("POST", target, body) == (403, "")
    s = server(records, now=NOW + 300)  # the edge itself is still in
    assert s.handle("POST", target, body) == (200, "success")
    target, body = target_of(fake.text("odd"), safe=False, timestamp="soon")
    assert s.handle("POST", target, body) == (403, "")
    lax = CallbackServer("127.0.0.1:0", "/weixin/callback", fake.token, None, records.append, max_age_secs=0)
    lax.httpd.server_close()
    target, body = target_of(fake.text("old"), safe=False, timestamp="1410685589")
    assert lax.handle("POST", target, body) == (200, "success")
    assert [r["Content"] for r in records] == ["late", "old"]


def test_a_message_that_cannot_be_recorded_is_answered_500_so_wechat_calls_again():
    def boom(message):
        raise OSError("disk full")
    s = server([], on_message=boom)
    target, body = target_of(fake.text("hello"), safe=False)
    assert s.handle("POST", target, body) == (500, "")


# -- normalisation ----------------------------------------------------------------------------------

def test_a_text_is_a_one_to_one_message_of_its_sender_keyed_by_msg_id():
    message = fake.text("  def f():\n      pass\n")
    msg = normalise(parse_xml(fake.to_xml(message)))
    assert (msg.channel, msg.conversation_id, msg.sender_id, msg.source_type) == ("weixin", USER, USER, "user")
    assert (msg.message_id, msg.text) == (message["MsgId"], "  def f():\n      pass\n")
    assert msg.metadata["account"] == ACCOUNT and msg.timestamp.endswith("Z")
    msg.validate()


def test_media_become_attachments_downloaded_from_media_get():
    base = "https://api.weixin.qq.com"
    image = normalise(fake.message("image", PicUrl="http://mmbiz.qpic.cn/x", MediaId="MID/1"), base_url=base)
    [att] = image.attachments
    assert (att.kind, att.content_type, att.channel_ref) == ("image", "image/jpeg", "MID/1")
    assert att.url == "https://api.weixin.qq.com/cgi-bin/media/get?media_id=MID%2F1"
    voice = normalise(fake.message("voice", MediaId="V1", Format="speex", Recognition="你好"), base_url=base)
    assert voice.text == "你好" and voice.attachments[0].content_type == "audio/speex"
    assert normalise(fake.message("voice", MediaId="V2", Format="amr")).text == ""
    for kind in ("video", "shortvideo"):
        msg = normalise(fake.message(kind, MediaId="VID", ThumbMediaId="THUMB"))
        assert (msg.attachments[0].kind, msg.metadata["thumb_media_id"]) == ("video", "THUMB")
        msg.validate()


def test_a_location_and_a_link_are_text_the_agent_reads():
    loc = normalise(fake.message("location", Location_X="23.134521", Location_Y="113.358803", Scale="20",
                                 Label="广州市天河区"))
    assert loc.text == "[location] 广州市天河区 (23.134521, 113.358803)"
    assert (loc.metadata["latitude"], loc.metadata["longitude"]) == ("23.134521", "113.358803")
    link = normalise(fake.message("link", Title="公众平台官网链接", Description="公众平台官网链接",
                                  Url="https://mp.weixin.qq.com"))
    assert link.text == "[link] 公众平台官网链接\n公众平台官网链接\nhttps://mp.weixin.qq.com"
    loc.validate(), link.validate()


@pytest.mark.parametrize("message", [
    fake.event("subscribe"), fake.event("unsubscribe"), fake.event("CLICK"),
    fake.message("text", Content="   "), fake.message("miniprogrampage", Title="x"),
    {k: v for k, v in fake.text("no id").items() if k != "MsgId"},
])
def test_what_is_not_a_persons_message_is_not_taken(message):
    assert normalise(message) is None


# -- splitting ------------------------------------------------------------------------------------------

def test_an_answer_is_split_at_2048_bytes_of_utf8_not_characters():
    assert TEXT_LIMIT_BYTES == 2048
    parts = message_parts("汉" * 1500)  # 4,500 bytes
    assert len(parts) == 3 and all(utf8_len(p) <= 2048 for p in parts) and utf8_len(parts[0]) > 2000
    assert "".join(parts) == "汉" * 1500
    assert message_parts("a" * 2048) == ["a" * 2048]
    assert message_parts("   ") == []


def test_an_answer_past_five_messages_is_cut_in_the_fifth_saying_so():
    parts = message_parts("汉" * 5000)  # 15,000 bytes
    assert len(parts) == MAX_MESSAGES == 5
    assert parts[-1].endswith(CUT_NOTE) and all(utf8_len(p) <= 2048 for p in parts)
    assert len(message_parts("汉" * 5000, room=2)) == 2
    assert message_parts("汉" * 5000, room=0) == []


# -- the API client -------------------------------------------------------------------------------------

@pytest.fixture
def wx():
    f = FakeWeixin().start()
    f.callback_url = "http://127.0.0.1:9/weixin/callback"
    f._opened_window(f.text("hi"))  # the user wrote: the 48-hour window is open
    yield f
    f.stop()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def api(f: FakeWeixin, **kw) -> tuple[WeixinApi, list[float]]:
    waits: list[float] = []

    def sleep(secs):
        waits.append(secs)
        return False
    return WeixinApi(f.app_id, f.secret, base_url=f.base_url, sleep=sleep, **kw), waits


def test_the_stable_token_is_cached_and_fetched_again_before_it_expires(wx):
    clock = Clock()
    client, _ = api(wx, clock=clock)
    client.send_text(USER, "one")
    client.send_text(USER, "two")
    [get] = wx.calls_to("/cgi-bin/stable_token")
    assert get.method == "POST" and get.body == {"grant_type": "client_credential", "appid": wx.app_id,
                                                 "secret": wx.secret}
    clock.now += 7200 - 301  # not yet within five minutes of the expiry
    client.token()
    assert len(wx.calls_to("/cgi-bin/stable_token")) == 1
    clock.now += 2
    client.token()
    assert len(wx.calls_to("/cgi-bin/stable_token")) == 2
    assert wx.texts() == ["one", "two"]


@pytest.mark.parametrize("stale", ["expire", "forget"])
def test_a_stale_token_is_fetched_again_at_once_and_the_send_made_once_more(wx, stale):
    client, _ = api(wx)
    client.send_text(USER, "before")
    if stale == "expire":
        wx.expire_tokens()          # 42001
    else:
        wx.tokens.clear()           # 40001: not the latest
        wx.current_token = None
    client.send_text(USER, "after")
    assert [c.errcode for c in wx.sends()] == [0, 42001 if stale == "expire" else 40001, 0]
    assert len(wx.calls_to("/cgi-bin/stable_token")) == 2
    assert wx.texts() == ["before", "after"]


def test_a_stale_token_the_platform_hands_out_again_is_force_refreshed(wx):
    client, _ = api(wx)
    client.send_text(USER, "before")
    wx.script_send(40001)   # WeChat says stale, but stable_token's normal mode gives the same token back
    client.send_text(USER, "after")
    normal, again, forced = wx.calls_to("/cgi-bin/stable_token")
    assert "force_refresh" not in again.body and forced.body["force_refresh"] is True
    assert again.answer["access_token"] == normal.answer["access_token"] != forced.answer["access_token"]
    assert wx.texts() == ["before", "after"]


def test_force_refresh_is_asked_at_most_once_in_30_s_and_a_few_times_a_day(wx):
    from plugins_app.channel.workers.weixin.api import FORCE_PER_DAY
    clock = Clock()
    client, _ = api(wx, clock=clock)
    client.send_text(USER, "before")

    def forced():
        return len([c for c in wx.calls_to("/cgi-bin/stable_token") if (c.body or {}).get("force_refresh")])
    wx.script_send(40001)
    client.send_text(USER, "forced")
    assert forced() == 1
    clock.now += 10
    wx.script_send(40001, 40001)  # stale again, 10 s later: no second force; the call fails, retryable
    with pytest.raises(WeixinError) as err:
        client.send_text(USER, "not forced")
    assert err.value.errcode == 40001 and forced() == 1
    for n in range(2, FORCE_PER_DAY + 3):
        clock.now += 31
        wx._opened_window(wx.text("hi"))  # (the fake's 5 messages a message)
        wx.script_send(40001)
        try:
            client.send_text(USER, f"again {n}")
        except WeixinError:
            pass
    assert forced() == FORCE_PER_DAY < 20  # WeChat's 20 a day are shared with every program of the AppID
    clock.now += 86400
    wx._opened_window(wx.text("hi"))
    wx.script_send(40001)
    client.send_text(USER, "a day later")
    assert forced() == FORCE_PER_DAY + 1


def test_a_token_stale_twice_is_an_error_not_a_loop(wx):
    client, _ = api(wx)
    wx.script_send(42001, 42001)
    with pytest.raises(WeixinError) as err:
        client.send_text(USER, "x")
    assert err.value.errcode == 42001 and len(wx.sends()) == 2


def test_busy_quota_and_5xx_back_off_doubling_within_the_longest_wait(wx):
    client, waits = api(wx, max_wait_secs=15)
    wx.script_send(-1, 45009, 45011, 0)  # system busy, the daily quota, the minute quota, HTTP 502
    client.send_text(USER, "eventually")
    assert waits == [1.0, 2.0, 4.0, 8.0] and wx.texts() == ["eventually"]
    del waits[:]
    wx.script_send(*[-1] * 10)
    with pytest.raises(RateLimited):
        client.send_text(USER, "never")
    assert waits == [1.0, 2.0, 4.0, 8.0]  # 1 + 2 + 4 + 8 = 15; 16 more would pass 15


def test_a_stopping_worker_cuts_a_busy_wait_short(wx):
    client = WeixinApi(wx.app_id, wx.secret, base_url=wx.base_url, sleep=lambda secs: True)
    wx.script_send(-1)
    with pytest.raises(Stopped):
        client.send_text(USER, "x")


@pytest.mark.parametrize("code", [45015, 45047, 43004, 40003])
def test_a_user_who_cannot_be_sent_to_is_unreachable(wx, code):
    client, _ = api(wx)
    wx.script_send(code)
    with pytest.raises(UserUnreachable) as err:
        client.send_text(USER, "x")
    assert err.value.errcode == code


def test_the_48_hour_window_and_the_five_message_quota_are_the_fakes_too(wx):
    client, _ = api(wx)
    for n in range(5):
        client.send_text(USER, f"part {n}")
    with pytest.raises(UserUnreachable) as err:
        client.send_text(USER, "sixth")
    assert err.value.errcode == 45047
    wx.last_message[USER] = -1e9
    with pytest.raises(UserUnreachable) as err:
        client.send_text(USER, "late")
    assert err.value.errcode == 45015


@pytest.mark.parametrize("setup,code", [("secret", 40125), ("appid", 40013), ("ip", 40164)])
def test_what_only_the_operator_can_fix_is_app_refused(wx, setup, code):
    if setup == "ip":
        wx.ip_blocked = True
    client = WeixinApi("wx1111111111111111" if setup == "appid" else wx.app_id,
                       "wrong" if setup == "secret" else wx.secret, base_url=wx.base_url)
    with pytest.raises(AppRefused) as err:
        client.token()
    assert err.value.errcode == code


def test_an_ip_removed_from_the_whitelist_while_running_is_refused_at_the_send(wx):
    client, _ = api(wx)
    client.send_text(USER, "ok")
    wx.ip_blocked = True
    with pytest.raises(AppRefused) as err:
        client.send_text(USER, "x")
    assert err.value.errcode == 40164


def test_media_come_from_media_get_and_a_json_error_is_no_file(wx):
    client, _ = api(wx)
    media_id = wx.upload(b"\x89PNG..." + b"\0" * 32, "image/png", "p.png")
    assert client.media(media_id) == (b"\x89PNG..." + b"\0" * 32, "image/png", "p.png")
    with pytest.raises(WeixinError) as err:
        client.media("gone")
    assert err.value.errcode == 40007
    video = wx.upload_video(b"\0\0\0\x18ftypmp42" + b"\0" * 16)
    data, ctype, _ = client.media(video)  # a video answers {"video_url"}: fetched from there
    assert (data, ctype) == (b"\0\0\0\x18ftypmp42" + b"\0" * 16, "video/mp4")


def test_an_image_is_uploaded_as_multipart_media_and_sent_by_its_media_id(wx):
    client, _ = api(wx)
    media_id = client.upload(b"\xff\xd8\xff" + b"1" * 40, "image/jpeg", "chart.jpg")
    assert wx.uploads[media_id] == (b"\xff\xd8\xff" + b"1" * 40, "image/jpeg", "chart.jpg")
    [up] = wx.calls_to("/cgi-bin/media/upload")
    assert up.params["type"] == "image"
    client.send_image(USER, media_id)
    assert wx.sent[-1] == {"touser": USER, "msgtype": "image", "image": {"media_id": media_id}}


# -- the worker's outbound side: images, the journal ------------------------------------------------------

@pytest.fixture
def worker(wx, tmp_path):
    w = WeixinWorker(argv=["--bind", "127.0.0.1:0"], environ=wx.env(), socket_path=str(tmp_path / "s"),
                     plugin_id="weixin-parts", token="t", state_dir=str(tmp_path), install_signal_handlers=False)
    w.connect()
    yield w
    w.disconnect()


def image_attachment() -> Attachment:
    return Attachment(kind="image", content_type="image/png", media_id="m-1", filename="chart.png")


def test_an_answer_with_an_image_sends_its_text_then_the_image_once(wx, worker):
    att = image_attachment()
    pdf = Attachment(kind="document", content_type="application/pdf", media_id="m-2", filename="a.pdf")
    delivery = Delivery(delivery_id="d-1", conversation_id=USER, text="here is the chart", attachments=[att, pdf])
    png = b"\x89PNG" + b"\0" * 64
    att.channel_ref = worker.put_media(Media(png, "image/png", "chart.png"), att, delivery)
    assert worker.put_media(Media(b"%PDF", "application/pdf", "a.pdf"), pdf, delivery) is None  # not sent
    assert worker.deliver(delivery) is None
    text, image = wx.sent
    assert text["text"]["content"] == "here is the chart"
    assert image["image"]["media_id"] == att.channel_ref and wx.uploads[att.channel_ref][0] == png
    assert worker.already_delivered(delivery)
    worker.deliver(delivery)  # a resend of the whole delivery: every message is journaled
    assert len(wx.sent) == 2 and len(wx.calls_to("/cgi-bin/media/upload")) == 1
    again = image_attachment()
    assert worker.put_media(Media(png, "image/png", "chart.png"), again,
                            Delivery(delivery_id="d-1", conversation_id=USER, text="here is the chart",
                                     attachments=[again, pdf])) == "sent"  # not uploaded a second time


def test_an_image_the_host_does_not_hold_is_its_link_not_a_silent_empty_delivery(wx, worker):
    att = Attachment(kind="image", content_type="image/png", url="https://example.com/chart.png",
                     filename="chart.png")
    delivery = Delivery(delivery_id="d-5", conversation_id=USER, text="", attachments=[att])
    worker.deliver(delivery)
    assert wx.texts() == ["[chart.png: https://example.com/chart.png]"]
    assert worker.already_delivered(delivery) and not wx.calls_to("/cgi-bin/media/upload")


def test_an_image_media_upload_refuses_is_a_note_and_the_text_still_goes_out(wx, worker):
    att = image_attachment()
    delivery = Delivery(delivery_id="d-6", conversation_id=USER, text="the chart", attachments=[att])
    wx.script_upload(40009)  # invalid image size: uploading again cannot help
    att.channel_ref = worker.put_media(Media(b"\x89PNG" + b"\0" * 60, "image/png", "chart.png"), att, delivery)
    worker.deliver(delivery)
    assert wx.texts() == ["the chart", "[chart.png (64 bytes) was not sent: not an image size WeChat takes "
                                       "(errcode 40009: invalid image size rid: 6751a1c2-0d3b5a2e-1f2e3d5b)]"]
    assert worker.already_delivered(delivery) and len(wx.calls_to("/cgi-bin/media/upload")) == 1


def test_an_image_is_uploaded_with_the_extension_of_its_content_type():
    assert upload_name(Attachment(kind="image", content_type="image/png", media_id="m"), "image/png") == "image.png"
    assert upload_name(Attachment(kind="image", content_type="image/gif", media_id="m", filename="anim"),
                       "image/gif") == "anim.gif"
    assert upload_name(Attachment(kind="image", content_type="image/jpeg", media_id="m", filename="a.JPEG"),
                       "image/jpeg") == "a.JPEG"


def test_a_png_without_a_name_is_taken_by_media_upload(wx, worker):
    att = Attachment(kind="image", content_type="image/png", media_id="m-7")
    delivery = Delivery(delivery_id="d-7", conversation_id=USER, text="", attachments=[att])
    att.channel_ref = worker.put_media(Media(b"\x89PNG" + b"\0" * 8, "image/png", None), att, delivery)
    worker.deliver(delivery)
    assert wx.uploads[att.channel_ref][1:] == ("image/png", "image.png")
    assert wx.sent[-1]["image"]["media_id"] == att.channel_ref


@pytest.mark.parametrize("code", [40004, 40005, 40006, 40009, 41005])
def test_a_media_upload_refusal_is_permanent(code):
    from plugins_app.channel.workers.weixin import CONTENT_REFUSED
    assert code in CONTENT_REFUSED


def test_an_image_over_2_mb_is_not_uploaded_and_a_note_says_so(wx, worker):
    att = image_attachment()
    delivery = Delivery(delivery_id="d-4", conversation_id=USER, text="", attachments=[att])
    att.channel_ref = worker.put_media(Media(b"\0" * (2 * 1024 * 1024 + 1), "image/png", "chart.png"), att, delivery)
    worker.deliver(delivery)
    assert wx.texts() == ["[chart.png (2097153 bytes) was not sent: over WeChat's 2 MB for an image]"]
    assert not wx.calls_to("/cgi-bin/media/upload") and worker.already_delivered(delivery)


def test_a_delivery_that_failed_resumes_and_a_closed_window_is_permanent(wx, worker):
    delivery = Delivery(delivery_id="d-2", conversation_id=USER, text="甲" * 600 + "\n\n" + "乙" * 600)
    wx.script_send(0, 0, 0, 0, 0, 0, 0, 0)  # the first part: eight 502s, past the in-place waits
    worker.api.max_wait_secs = 0
    with pytest.raises(DeliveryFailed) as err:
        worker.deliver(delivery)
    assert not err.value.permanent and not wx.sent
    wx._script.clear()
    worker.deliver(delivery)
    assert wx.texts() == ["甲" * 600, "乙" * 600]
    wx._opened_window(wx.text("again"))
    wx.script_send(45015)
    second = Delivery(delivery_id="d-3", conversation_id=USER, text="丙")
    with pytest.raises(DeliveryFailed) as err:
        worker.deliver(second)
    assert err.value.permanent and "48 hours" in err.value.reason
    assert not worker.already_delivered(second)


def part(n: int, char: str = "字") -> str:
    """The text of an answer of ``n`` messages (each just under 2,048 bytes)."""
    return "\n\n".join([char * 600] * n)


def test_the_five_messages_are_counted_per_message_of_the_user_not_per_delivery(wx, worker):
    worker.accept(wx.text("one question"))  # the user wrote: 5 messages to answer with, in all
    worker.deliver(Delivery(delivery_id="q-notice", conversation_id=USER, text=part(3, "甲")))
    second = Delivery(delivery_id="q-answer", conversation_id=USER, text=part(4, "乙"))
    worker.deliver(second)  # 2 left: cut in its second message, saying so; not refused by WeChat with 45047
    texts = wx.texts()
    assert len(texts) == 5 and texts[-1].endswith(CUT_NOTE) and {c.errcode for c in wx.sends()} == {0}
    assert worker.already_delivered(second)
    third = Delivery(delivery_id="q-more", conversation_id=USER, text="and another thing")
    with pytest.raises(DeliveryFailed) as err:
        worker.deliver(third)
    assert err.value.permanent and "quota" in err.value.reason and "write again" in err.value.reason
    assert len(wx.sends()) == 5  # nothing asked of WeChat
    wx._opened_window(wx.text("again"))
    worker.accept(wx.text("again"))  # the user wrote again: 5 more
    worker.deliver(third)
    assert wx.texts()[-1] == "and another thing"


def test_the_count_left_outlives_a_restart_and_45047_stops_a_delivery_saying_why(wx, tmp_path):
    kw = dict(argv=["--bind", "127.0.0.1:0"], environ=wx.env(), socket_path=str(tmp_path / "s"), plugin_id="weixin-q",
              token="t", state_dir=str(tmp_path), install_signal_handlers=False)
    first = WeixinWorker(**kw)
    first.connect()
    try:
        first.accept(wx.text("hi"))
        first.deliver(Delivery(delivery_id="r-1", conversation_id=USER, text=part(4)))
    finally:
        first.disconnect()
    second = WeixinWorker(**kw)
    second.connect()
    try:
        second.deliver(Delivery(delivery_id="r-2", conversation_id=USER, text=part(2)))
        assert len(wx.texts()) == 5 and wx.texts()[-1].endswith(CUT_NOTE)
        second._set_left(OTHER_USER, 5, time.time())  # (the count says 5; WeChat says spent)
        wx._opened_window(wx.text("x", user=OTHER_USER))
        wx.script_send(45047)
        with pytest.raises(DeliveryFailed) as err:
            second.deliver(Delivery(delivery_id="r-3", conversation_id=OTHER_USER, text=part(2)))
        assert err.value.permanent and "errcode 45047" in err.value.reason and "0 of this answer's 2" in err.value.reason
        assert second._left(OTHER_USER)[0] == 0
    finally:
        second.disconnect()


def owed_image(wx, worker) -> str:
    """A user's image message recorded by the worker; its outbox key."""
    media_id = wx.upload(b"\xff\xd8\xff" + b"\0" * 16, "image/jpeg", "photo.jpg")
    worker.accept(wx.message("image", PicUrl="http://mmbiz.qpic.cn/x", MediaId=media_id))
    [row] = worker._outbox().inbound_pending()
    return row.key


def test_a_file_wechat_cannot_give_for_now_keeps_its_message_owed_then_goes_on_saying_so(wx, worker):
    from plugins_app.channel.sdk.worker import _MediaWait
    key = owed_image(wx, worker)
    worker.api.max_wait_secs = 0
    wx.script_media(0, -1)  # HTTP 502, then system busy
    for _ in range(2):
        with pytest.raises(_MediaWait):  # MediaNotReady: the SDK keeps the message owed, its chat waiting
            worker._store_inbound_media(key, worker._outbox().inbound_get(key).message)
    wx.script_media(0)
    worker.media_wait_secs = 0  # the SDK's wait is over: the message goes on without the file, saying so
    message = worker._store_inbound_media(key, worker._outbox().inbound_get(key).message)
    assert message["attachments"] == [] and "could not be fetched from the channel" in message["text"]
    assert "access_token" not in json.dumps(message) and "/cgi-bin/media/get" not in json.dumps(message)
    assert worker._outbox().inbound_get(key).message["attachments"] == []  # stored so: a replay sends the same


def test_a_file_wechat_no_longer_has_is_a_note_at_once_not_a_link_the_host_cannot_fetch(wx, worker):
    key = owed_image(wx, worker)
    wx.script_media(40007)
    message = worker._store_inbound_media(key, worker._outbox().inbound_get(key).message)
    assert message["attachments"] == [] and "errcode 40007" in message["text"]
    assert "access_token" not in json.dumps(message) and "/cgi-bin/media/get" not in json.dumps(message)


def test_an_event_is_not_taken_and_its_users_openid_is_not_logged_at_info(wx, worker, caplog):
    import logging
    with caplog.at_level(logging.INFO):
        worker.accept(wx.event("subscribe"))
    assert USER not in caplog.text and worker._outbox().inbound_pending() == []


def test_the_journal_outlives_the_worker(wx, tmp_path):
    env = wx.env()
    kw = dict(argv=["--bind", "127.0.0.1:0"], environ=env, socket_path=str(tmp_path / "s"), plugin_id="weixin-j",
              token="t", state_dir=str(tmp_path), install_signal_handlers=False)
    delivery = Delivery(delivery_id="d-9", conversation_id=USER, text="一" * 600 + "\n\n" + "二" * 600)
    first = WeixinWorker(**kw)
    first.connect()
    first._journal.record("d-9", 0, "")  # part 0 went out before the crash
    first.disconnect()
    second = WeixinWorker(**kw)
    second.connect()
    try:
        second.deliver(delivery)
    finally:
        second.disconnect()
    assert wx.texts() == ["二" * 600]


# -- registration -----------------------------------------------------------------------------------

@pytest.mark.django_db
def test_channel_weixin_is_a_builtin_kind_a_plugins_toml_entry_needs_no_command_for():
    from plugins_app.channel import selectors, tomlio
    from plugins_app.channel.models import Plugin
    kind = installed_kinds()["channel-weixin"]
    assert kind.module == "plugins_app.channel.workers.weixin"
    assert kind.env_refs == ENV_REFS == ("WEIXIN_APP_ID", "WEIXIN_APP_SECRET", "WEIXIN_TOKEN",
                                         "WEIXIN_ENCODING_AES_KEY")
    tomlio.plugins_import(text='schema_version = 1\n[[plugins]]\nid = "weixin-main"\nkind = "channel-weixin"\n'
                               'args = ["--bind", "127.0.0.1:3003"]\n'
                               'env_refs = ["WEIXIN_APP_ID", "WEIXIN_APP_SECRET", "WEIXIN_TOKEN"]\n')
    assert selectors.plugin_argv(Plugin.objects.get()) == (
        sys.executable, ["-m", "plugins_app.channel.workers.weixin", "--bind", "127.0.0.1:3003"])


@pytest.mark.parametrize("answer", [0, -1])  # HTTP 502, system busy
def test_a_passing_token_failure_at_start_still_listens_and_the_token_comes_at_the_send(wx, tmp_path, answer):
    wx.script_token(answer)
    w = WeixinWorker(argv=["--bind", "127.0.0.1:0"], environ=wx.env(), socket_path=str(tmp_path / "s"),
                     plugin_id="weixin-t", token="t", state_dir=str(tmp_path), install_signal_handlers=False)
    w.connect()
    try:
        wx.callback_url = w.server.url
        assert wx.verify_url(echo="up").text == "up"  # WeChat's calls are answered meanwhile
        w.deliver(Delivery(delivery_id="t-1", conversation_id=USER, text="token later"))
        assert wx.texts() == ["token later"] and len(wx.calls_to("/cgi-bin/stable_token")) == 2
    finally:
        w.disconnect()


def test_a_missing_setting_or_a_bad_aes_key_is_refused_at_connect(wx, tmp_path):
    from plugins_app.channel.sdk import ChannelRefused
    for env, words in [({**wx.env(), "WEIXIN_TOKEN": ""}, "WEIXIN_TOKEN not set"),
                       ({**wx.env(), "WEIXIN_ENCODING_AES_KEY": "short"}, "must be 43 characters")]:
        w = WeixinWorker(argv=[], environ=env, socket_path="s", plugin_id="p", token="t",
                         state_dir=str(tmp_path), install_signal_handlers=False)
        with pytest.raises(ChannelRefused) as err:
            w.connect()
        assert words in err.value.reason
        w.api.close()
