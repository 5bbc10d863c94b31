"""channel-wecom's parts on their own: the WXBizMsgCrypt scheme against every wecom vector, the callback's
handshake and messages, normalisation, splitting by bytes, the access token's cache and refresh, and the
API client's answers to WeCom's errcodes."""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from urllib.parse import urlencode

import pytest

from plugins_app.channel.sdk import Attachment
from plugins_app.channel.workers import installed_kinds
from plugins_app.channel.workers.wecom import ENV_REFS, message_parts, normalise, utf8_len
from plugins_app.channel.workers.wecom.api import (TEXT_LIMIT_BYTES, AppRefused, RateLimited, Stopped,
                                                   UserUnreachable, WeComApi, WeComError)
from plugins_app.channel.workers.wecom.callback import CallbackServer, parse_message
from plugins_app.channel.sdk.wxcrypto import CryptoError, MsgCrypt, parse_xml, signature
from tests.fakes.wecom import AGENT_ID, CORP_ID, USER, FakeWeCom

DATA = Path(__file__).resolve().parents[1] / "data"
VECTORS = json.loads((DATA / "webhook-signature-vectors.json").read_text())["vectors"]
WECOM = [v for v in VECTORS if v["id"].startswith("wecom-") or v["id"].startswith("weixin-mp-aes-encrypt-fixed-random")]
ECHO = [v["id"] for v in WECOM if "echostr" in v["inputs"]]
DECRYPT = [v["id"] for v in WECOM if "encrypt" in v["inputs"]]
ENCRYPT = [v["id"] for v in WECOM if "random16" in v["inputs"]]


def vector(vector_id: str) -> tuple[dict, dict, MsgCrypt]:
    v = next(v for v in VECTORS if v["id"] == vector_id)
    i = v["inputs"]
    return i, v["expected"], MsgCrypt(i["token"], i["encoding_aes_key"], i["receiveid"])


def test_every_wecom_vector_is_taken_by_one_of_the_tests():
    assert len(WECOM) == 11
    assert sorted(set(ECHO) | set(DECRYPT) | set(ENCRYPT)) == sorted(v["id"] for v in WECOM)


# -- the crypto: every vector ------------------------------------------------------------------------

@pytest.mark.parametrize("vector_id", ECHO)
def test_a_url_check_verifies_and_its_echostr_decrypts_to_the_vectors_plaintext(vector_id):
    i, e, crypto = vector(vector_id)
    assert signature(i["token"], i["timestamp"], i["nonce"], i["echostr"]) == i["msg_signature"]
    assert crypto.open(i["msg_signature"], i["timestamp"], i["nonce"], i["echostr"]) == e["echostr_plaintext"]
    for case in e.get("negative_cases", []):
        assert case["valid"] is False
        assert not crypto.signature_valid(i["msg_signature"], i["timestamp"], case["nonce"], i["echostr"])
        with pytest.raises(CryptoError):
            crypto.open(i["msg_signature"], i["timestamp"], case["nonce"], i["echostr"])


@pytest.mark.parametrize("vector_id", ECHO)
def test_the_callback_server_answers_a_vectors_url_check_with_the_plaintext_and_a_forged_one_403(vector_id):
    i, e, crypto = vector(vector_id)
    s = server([], crypto)
    query = {"msg_signature": i["msg_signature"], "timestamp": i["timestamp"], "nonce": i["nonce"],
             "echostr": i["echostr"]}
    assert s.handle("GET", "/wecom/callback?" + urlencode(query), b"") == (200, e["echostr_plaintext"])
    if "echostr_url_encoded" in i:  # the URL exactly as WeCom's docs show it
        raw = (f"msg_signature={i['msg_signature']}&timestamp={i['timestamp']}&nonce={i['nonce']}"
               f"&echostr={i['echostr_url_encoded']}")
        assert s.handle("GET", "/wecom/callback?" + raw, b"") == (200, e["echostr_plaintext"])
    unencoded = "&".join(f"{k}={v}" for k, v in query.items())  # a '+' not percent-encoded still works
    assert s.handle("GET", "/wecom/callback?" + unencoded, b"") == (200, e["echostr_plaintext"])
    assert s.handle("GET", "/wecom/callback?" + urlencode({**query, "nonce": i["nonce"] + "1"}), b"") == (403, "")
    assert s.handle("GET", "/wecom/callback?" + urlencode({**query, "msg_signature": ""}), b"") == (403, "")
    assert s.handle("GET", "/wecom/callback", b"") == (403, "")
    assert s.handle("GET", "/elsewhere?" + urlencode(query), b"")[0] == 404


@pytest.mark.parametrize("vector_id", DECRYPT)
def test_a_vectors_encrypted_message_verifies_and_decrypts(vector_id):
    i, e, crypto = vector(vector_id)
    assert crypto.signature_valid(i["msg_signature"], i["timestamp"], i["nonce"], i["encrypt"])
    assert crypto.open(i["msg_signature"], i["timestamp"], i["nonce"], i["encrypt"]) == e["plaintext"]
    # a wrong signature, a tampered ciphertext, another corp's receive id: all refused
    with pytest.raises(CryptoError, match="msg_signature"):
        crypto.open("0" * 40, i["timestamp"], i["nonce"], i["encrypt"])
    with pytest.raises(CryptoError, match="msg_signature"):
        crypto.open(i["msg_signature"], str(int(i["timestamp"]) + 1), i["nonce"], i["encrypt"])
    other = MsgCrypt(i["token"], i["encoding_aes_key"], "ww0000000000000000")
    with pytest.raises(CryptoError, match="receive id"):
        other.open(i["msg_signature"], i["timestamp"], i["nonce"], i["encrypt"])
    with pytest.raises(CryptoError):
        crypto.decrypt(i["encrypt"][:-8])


@pytest.mark.parametrize("vector_id", [v for v in DECRYPT if "post_body" in vector(v)[0]])
def test_the_callback_server_takes_a_vectors_post_body_xml_or_json(vector_id):
    i, e, crypto = vector(vector_id)
    records: list = []
    s = server(records, crypto)
    target = "/wecom/callback?" + urlencode({"msg_signature": i["msg_signature"], "timestamp": i["timestamp"],
                                             "nonce": i["nonce"]})
    assert s.handle("POST", target, i["post_body"].encode()) == (200, "")
    assert records == [parse_message(e["plaintext"])]
    assert records[0]["MsgType"] == "text" and records[0]["MsgId"]
    forged = target.replace(i["msg_signature"], "f" * 40)
    assert s.handle("POST", forged, i["post_body"].encode()) == (403, "")
    other = server(records, MsgCrypt(i["token"], i["encoding_aes_key"], "ww0000000000000000"))
    assert other.handle("POST", target, i["post_body"].encode()) == (403, "")
    assert len(records) == 1


def test_the_json_samples_payload_decrypts_but_is_not_json_and_is_not_taken():
    i, e, crypto = vector("wecom-official-python-json-sample-post")
    text = crypto.open(i["msg_signature"], i["timestamp"], i["nonce"], i["encrypt"])
    assert text == e["plaintext"]
    with pytest.raises(ValueError):
        parse_message(text)


@pytest.mark.parametrize("vector_id", ENCRYPT)
def test_encryption_with_the_vectors_fixed_random_bytes_gives_their_ciphertext(vector_id):
    i, e, crypto = vector(vector_id)
    timestamp, nonce = i.get("timestamp", ""), i.get("nonce", "")
    encrypt, sig = crypto.seal(i["plaintext"], timestamp, nonce, random16=i["random16"].encode())
    assert encrypt == e["encrypt"]
    if "msg_signature" in e:
        assert sig == e["msg_signature"]
    if "reply_xml" in e:
        assert crypto.reply_xml(i["plaintext"], i["timestamp"], i["nonce"],
                                random16=i["random16"].encode()) == e["reply_xml"]
    assert crypto.decrypt(encrypt) == i["plaintext"]  # and back


def test_a_random_encryption_round_trips_and_pads_to_32_byte_blocks():
    crypto = MsgCrypt("t", "6qkdMrq68nTKduznJYO1A37W2oEgpkMUvkttRToqhUt", CORP_ID)
    for text in ["", "x", "你好" * 100, "y" * 31, "z" * (32 - 20 - len(CORP_ID))]:
        import base64
        encrypt = crypto.encrypt(text)
        assert len(base64.b64decode(encrypt)) % 32 == 0
        assert crypto.decrypt(encrypt) == text
    with pytest.raises(CryptoError):
        MsgCrypt("t", "too-short", CORP_ID)


# -- the callback server -----------------------------------------------------------------------------

def server(records: list, crypto: MsgCrypt | None = None) -> CallbackServer:
    s = CallbackServer("127.0.0.1:0", "/wecom/callback", crypto or FakeWeCom().crypto, records.append)
    s.httpd.server_close()
    return s


fake = FakeWeCom()  # not started: its builders and crypto only


def post_target(message: dict, **over) -> tuple[str, bytes]:
    params, encrypt = fake.signed(fake.to_xml(message))
    params.update(over)
    body = f"<xml><ToUserName><![CDATA[{CORP_ID}]]></ToUserName><Encrypt><![CDATA[{encrypt}]]></Encrypt></xml>"
    return "/wecom/callback?" + urlencode(params), body.encode()


def test_a_post_is_recorded_only_when_signed_for_this_corp_and_then_answered_with_an_empty_200():
    records: list = []
    s = server(records)
    message = fake.text("hello")
    target, body = post_target(message)
    assert s.handle("POST", target, body) == (200, "")
    assert records == [message]
    forged_target, _ = post_target(message, msg_signature="0" * 40)
    assert s.handle("POST", forged_target, body) == (403, "")
    assert s.handle("POST", target, b"<xml><Encrypt>junk</Encrypt></xml>") == (403, "")
    assert s.handle("POST", target, b"not xml") == (400, "")
    assert s.handle("POST", target, None)[0] == 413
    entity = b'<!DOCTYPE x [<!ENTITY a "b">]><xml><Encrypt>&a;</Encrypt></xml>'
    assert s.handle("POST", target, entity) == (400, "")
    assert len(records) == 1


def test_a_json_envelope_nested_past_the_interpreters_depth_is_answered_400_over_http():
    """(json.loads raised RecursionError, not ValueError, before any check: the connection closed unanswered.)"""
    import httpx
    records: list = []
    s = CallbackServer("127.0.0.1:0", "/wecom/callback", fake.crypto, records.append)
    s.start()
    try:
        target, _ = post_target(fake.text("hello"))
        deep = b'{"encrypt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
        answer = httpx.post(s.url.rsplit("/wecom/callback", 1)[0] + target, content=deep)
        assert answer.status_code == 400
    finally:
        s.stop()
    assert records == []


def test_a_message_that_cannot_be_recorded_is_answered_500_so_wecom_calls_again():
    def boom(message):
        raise OSError("disk full")
    s = CallbackServer("127.0.0.1:0", "/wecom/callback", fake.crypto, boom)
    s.httpd.server_close()
    target, body = post_target(fake.text("hello"))
    assert s.handle("POST", target, body) == (500, "")


# -- normalisation ----------------------------------------------------------------------------------

def test_a_text_is_a_one_to_one_message_of_its_sender_keyed_by_msg_id():
    message = fake.text("你好", user=USER)
    msg = normalise(message, agent_id=AGENT_ID)
    assert (msg.channel, msg.conversation_id, msg.sender_id, msg.source_type) == ("wecom", USER, USER, "user")
    assert (msg.message_id, msg.text) == (message["MsgId"], "你好")
    assert msg.metadata["agent_id"] == AGENT_ID
    assert msg.timestamp.endswith("Z")
    msg.validate()
    assert normalise(dict(message)).key == msg.key  # WeCom calling again: the same key


def test_media_become_attachments_downloaded_from_media_get():
    image = normalise(fake.message("image", PicUrl="https://wework.qpic.cn/x", MediaId="MID1"),
                      base_url="https://qyapi.weixin.qq.com")
    [att] = image.attachments
    assert (att.kind, att.content_type, att.channel_ref) == ("image", "image/jpeg", "MID1")
    assert att.url == "https://qyapi.weixin.qq.com/cgi-bin/media/get?media_id=MID1"
    assert image.metadata["pic_url"] == "https://wework.qpic.cn/x"
    voice = normalise(fake.message("voice", MediaId="MID2", Format="amr"))
    assert (voice.attachments[0].kind, voice.attachments[0].content_type) == ("audio", "audio/amr")
    doc = normalise(fake.message("file", MediaId="MID3", FileName="report.pdf"))
    assert (doc.attachments[0].kind, doc.attachments[0].content_type, doc.attachments[0].filename) == (
        "document", "application/pdf", "report.pdf")
    image.validate(), voice.validate(), doc.validate()


@pytest.mark.parametrize("message", [
    fake.event("enter_agent"), fake.event("click"),
    fake.message("event", Event="subscribe"),                 # an event, even with an id
    fake.message("location", Location_X="23.1", Location_Y="113.3"),
    fake.text("   "), fake.message("image"),                  # no text, no media id
    {**fake.text("no id"), "MsgId": ""}, {**fake.text("no sender"), "FromUserName": ""},
    fake.text("another app's", AgentID="1000099"),
])
def test_what_is_not_a_persons_message_to_this_app_is_not_taken(message):
    assert normalise(message, agent_id=AGENT_ID) is None


# -- splitting by bytes ------------------------------------------------------------------------------

def test_an_answer_is_split_at_2048_bytes_of_utf8_not_characters():
    chinese = "企业微信的消息" * 300   # 2,100 characters, 6,300 bytes
    parts = message_parts(chinese)
    assert len(parts) == 4 and all(utf8_len(p) <= TEXT_LIMIT_BYTES for p in parts) and "".join(parts) == chinese
    assert len(chinese) < 2 * TEXT_LIMIT_BYTES  # by characters it would have been one or two
    words = "\n\n".join(f"paragraph {i} " + "word " * 150 for i in range(10))
    parts = message_parts(words)
    assert all(utf8_len(p) <= TEXT_LIMIT_BYTES for p in parts) and " ".join(parts).split() == words.split()
    assert message_parts("short") == ["short"] and message_parts("  ") == []
    assert message_parts("é" * 1024) == ["é" * 1024]  # exactly 2,048 bytes: one message


# -- the API client ----------------------------------------------------------------------------------

@pytest.fixture
def wecom():
    with FakeWeCom() as f:
        yield f


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def api(f: FakeWeCom, **kw) -> tuple[WeComApi, list[float]]:
    waits: list[float] = []

    def sleep(secs):
        waits.append(secs)
        return False
    return WeComApi(f.corp_id, f.secret, f.agent_id, base_url=f.base_url, sleep=sleep, **kw), waits


def test_the_token_is_cached_and_fetched_again_before_it_expires(wecom):
    clock = Clock()
    client, _ = api(wecom, clock=clock)
    client.send_text(USER, "one")
    client.send_text(USER, "two")
    assert len(wecom.calls_to("/cgi-bin/gettoken")) == 1
    [get] = wecom.calls_to("/cgi-bin/gettoken")
    assert get.params == {"corpid": wecom.corp_id, "corpsecret": wecom.secret}
    first = client.token()
    clock.now += 7200 - 301  # not yet within five minutes of the expiry
    assert client.token() == first and len(wecom.calls_to("/cgi-bin/gettoken")) == 1
    clock.now += 2
    assert client.token() != first and len(wecom.calls_to("/cgi-bin/gettoken")) == 2


@pytest.mark.parametrize("stale", ["expire", "forget"])
def test_a_stale_token_is_fetched_again_at_once_and_the_send_made_once_more(wecom, stale):
    client, _ = api(wecom)
    client.send_text(USER, "before")
    if stale == "expire":
        wecom.expire_tokens()          # 42001
    else:
        wecom.tokens.clear()           # 40014
    client.send_text(USER, "after")
    assert [c.errcode for c in wecom.sends()] == [0, 42001 if stale == "expire" else 40014, 0]
    assert len(wecom.calls_to("/cgi-bin/gettoken")) == 2
    assert wecom.texts() == ["before", "after"]


def test_a_token_stale_twice_is_an_error_not_a_loop(wecom):
    client, _ = api(wecom)
    wecom.script_send(42001, 42001)
    with pytest.raises(WeComError) as err:
        client.send_text(USER, "x")
    assert err.value.errcode == 42001 and len(wecom.sends()) == 2


def test_the_send_carries_wecoms_duplicate_check_and_a_repeat_is_not_delivered_twice(wecom):
    client, _ = api(wecom)
    first = client.send_text(USER, "same words")
    again = client.send_text(USER, "same words")
    [call, _] = wecom.sends()
    assert call.body == {"touser": USER, "msgtype": "text", "agentid": int(AGENT_ID),
                         "text": {"content": "same words"}, "enable_duplicate_check": 1,
                         "duplicate_check_interval": 1800}
    assert call.params["access_token"] in wecom.tokens
    assert wecom.texts() == ["same words"] and first["msgid"] == again["msgid"]


def test_45009_and_45033_back_off_doubling_within_the_longest_wait(wecom):
    client, waits = api(wecom, backoff_initial=1.0, backoff_max=4.0)
    wecom.script_send(45009, 45033, 45009, 45009)
    client.send_text(USER, "hi")
    assert waits == [1.0, 2.0, 4.0, 4.0] and wecom.texts() == ["hi"]
    client, waits = api(wecom, backoff_initial=1.0, max_wait_secs=2.5)
    wecom.script_send(45009, 45009, 45009)
    with pytest.raises(RateLimited):
        client.send_text(USER, "later")
    assert waits == [1.0] and wecom.texts() == ["hi"]


def test_a_stopping_worker_cuts_a_45009_wait_short(wecom):
    stopping = threading.Event()
    stopping.set()
    client = WeComApi(wecom.corp_id, wecom.secret, wecom.agent_id, base_url=wecom.base_url, stopping=stopping)
    wecom.script_send(45009)
    with pytest.raises(Stopped):
        client.send_text(USER, "hi")


def test_a_user_not_in_the_app_is_unreachable(wecom):
    client, _ = api(wecom)
    with pytest.raises(UserUnreachable) as err:
        client.send_text("nobody", "hi")
    assert err.value.errcode == 81013 and "user & party & tag all invalid" in str(err.value)
    wecom.script_send(60111)
    with pytest.raises(UserUnreachable):
        client.send_text(USER, "hi")


@pytest.mark.parametrize("setup,code", [("secret", 40001), ("corp", 40013), ("ip", 60020)])
def test_what_only_the_operator_can_fix_is_app_refused(wecom, setup, code):
    if setup == "secret":
        client = WeComApi(wecom.corp_id, "wrong", wecom.agent_id, base_url=wecom.base_url)
    elif setup == "corp":
        client = WeComApi("wwwrong", wecom.secret, wecom.agent_id, base_url=wecom.base_url)
    else:
        client, _ = api(wecom)
        wecom.script_send(60020)
    with pytest.raises(AppRefused) as err:
        client.send_text(USER, "hi")
    assert err.value.errcode == code


def test_a_secret_reset_while_running_is_refused_at_the_refresh(wecom):
    client, _ = api(wecom)
    client.send_text(USER, "before")
    wecom.reset_secret()
    wecom.expire_tokens()
    with pytest.raises(AppRefused) as err:
        client.send_text(USER, "after")
    assert (err.value.where, err.value.errcode) == ("gettoken", 40001)


def test_media_come_from_media_get_with_the_token_and_a_stale_token_is_refreshed(wecom):
    client, _ = api(wecom)
    media_id = wecom.upload(b"\xff\xd8jpeg", "image/jpeg", "photo.jpg")
    assert client.media(media_id) == (b"\xff\xd8jpeg", "image/jpeg", "photo.jpg")
    wecom.expire_tokens()
    assert client.media(media_id)[0] == b"\xff\xd8jpeg"
    with pytest.raises(WeComError) as err:
        client.media("no-such-media")
    assert err.value.errcode == 40007


def test_a_download_refused_for_the_app_makes_the_worker_refuse(wecom):
    from plugins_app.channel.workers.wecom import WeComWorker
    worker = WeComWorker(argv=[], environ=wecom.env(), socket_path="/nowhere", plugin_id="wecom-test", token="t",
                         install_signal_handlers=False)
    media_id = wecom.upload(b"jpeg")
    [att] = normalise(wecom.message("image", MediaId=media_id), base_url=wecom.base_url).attachments
    assert worker.fetch_media(att) == b"jpeg"
    odd = "3a+b/c=="
    wecom.media_files[odd] = (b"odd", "image/png", "odd.png")
    [att_odd] = normalise(wecom.message("image", MediaId=odd), base_url=wecom.base_url).attachments
    assert att_odd.url.endswith("media_id=3a%2Bb%2Fc%3D%3D") and worker.fetch_media(att_odd) == b"odd"
    assert worker.fetch_media(Attachment(kind="image", content_type="image/jpeg",
                                         url="https://wework.qpic.cn/elsewhere")) is None  # never sent the token
    wecom.reset_secret()
    wecom.expire_tokens()
    with pytest.raises(AppRefused):
        worker.fetch_media(att)
    assert worker._refusal.startswith("gettoken: errcode 40001") and "WECOM_SECRET" in worker._refusal
    worker.api.close()


# -- registration -----------------------------------------------------------------------------------

@pytest.mark.django_db
def test_channel_wecom_is_a_builtin_kind_a_plugins_toml_entry_needs_no_command_for():
    from plugins_app.channel import selectors, tomlio
    from plugins_app.channel.models import Plugin
    kind = installed_kinds()["channel-wecom"]
    assert kind.module == "plugins_app.channel.workers.wecom"
    assert kind.env_refs == ENV_REFS == ("WECOM_CORP_ID", "WECOM_AGENT_ID", "WECOM_SECRET", "WECOM_TOKEN",
                                         "WECOM_ENCODING_AES_KEY")
    tomlio.plugins_import(text='schema_version = 1\n[[plugins]]\nid = "wecom-main"\nkind = "channel-wecom"\n'
                               'args = ["--bind", "127.0.0.1:3002"]\n'
                               'env_refs = ["WECOM_CORP_ID", "WECOM_AGENT_ID", "WECOM_SECRET", "WECOM_TOKEN", '
                               '"WECOM_ENCODING_AES_KEY"]\n')
    assert selectors.plugin_argv(Plugin.objects.get()) == (
        sys.executable, ["-m", "plugins_app.channel.workers.wecom", "--bind", "127.0.0.1:3002"])


# -- the review's findings (2026-12-06) ----------------------------------------------------------------------

def test_a_signed_message_that_mentions_a_doctype_is_taken_as_text():
    """A user asking about `<!DOCTYPE html>` wrote text: it was refused by a byte filter, answered 200 (so WeCom
    never called again) and lost."""
    fake, records = FakeWeCom(), []
    server = CallbackServer("127.0.0.1:0", "/wecom/callback", fake.crypto, records.append)
    server.httpd.server_close()
    said = "How do I write <!DOCTYPE html> at the top of a page?\n    indented code stays\n"
    params, encrypt = fake.signed(fake.to_xml(fake.text(said)))
    body = f"<xml><ToUserName><![CDATA[{fake.corp_id}]]></ToUserName><Encrypt><![CDATA[{encrypt}]]></Encrypt></xml>"
    assert server.handle("POST", f"/wecom/callback?{urlencode(params)}", body.encode()) == (200, "")
    assert [r["Content"] for r in records] == [said]  # and its text as written, indentation and newline too


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16"])
def test_a_document_type_declaration_is_refused_by_the_parser_in_any_encoding(encoding):
    """The envelope is parsed before its signature is checked: a declared entity could expand a megabyte into
    gigabytes. A byte filter let UTF-16 through."""
    doc = (f'<?xml version="1.0" encoding="{encoding.upper()}"?>'
           '<!DOCTYPE x [<!ENTITY a "AAAAAAAAAA"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">]>'
           '<xml><Encrypt>&b;</Encrypt></xml>').encode(encoding)
    with pytest.raises(ValueError, match="document type declaration"):
        parse_xml(doc)


@pytest.mark.parametrize("data, ctype, name", [(b"meeting notes\nline 2\n", "text/plain", "notes.txt"),
                                               (b"[1, 2, 3]", "application/json", "data.json")])
def test_a_text_or_json_file_downloads_as_the_file_not_as_an_error(data, ctype, name):
    """WeCom serves a file with its own type: a .txt or a .json was read as WeCom's error JSON and lost."""
    from plugins_app.channel.workers.wecom.api import WeComApi
    with FakeWeCom() as wecom:
        media_id = wecom.upload(data, ctype, name)
        api = WeComApi(wecom.corp_id, wecom.secret, wecom.agent_id, base_url=wecom.base_url)
        try:
            assert api.media(media_id)[0] == data
        finally:
            api.close()


def test_dingtalks_callback_crypto_vector_opens_with_the_same_construction():
    """sdk/wxcrypto.py says DingTalk's callback encryption is this construction with JSON around it (the owner
    key as the receive id): the official vector verifies and decrypts; a changed signature or an owner key not
    its own is refused."""
    v = next(v for v in VECTORS if v["id"] == "dingtalk-callback-crypto-official")
    i = v["inputs"]
    crypt = MsgCrypt(i["token"], i["aes_key"], i["owner_key"])
    assert crypt.signature_valid(i["msg_signature"], i["timestamp"], i["nonce"], i["encrypt"]) is True
    assert crypt.open(i["msg_signature"], i["timestamp"], i["nonce"], i["encrypt"]) == v["expected"]["plaintext"]
    with pytest.raises(CryptoError):
        crypt.open("0" * 40, i["timestamp"], i["nonce"], i["encrypt"])
    with pytest.raises(CryptoError):
        MsgCrypt(i["token"], i["aes_key"], "ding-someone-else").open(i["msg_signature"], i["timestamp"], i["nonce"],
                                                                    i["encrypt"])
