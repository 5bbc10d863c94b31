"""The server URL WeChat calls for an official account (服务器地址(URL)): the URL check (GET) and messages (POST).

* ``GET <path>?signature&timestamp&nonce&echostr``: WeChat checks the URL when the operator saves the
  server configuration; ``signature`` is hex SHA1 of the Token, timestamp and nonce sorted and joined
  (compared in constant time), and the worker answers ``echostr`` as it came (``text/plain``, 200).
  Anything wrong: 403, and nothing else said. The check is the same in every message mode.
* ``POST <path>?signature&timestamp&nonce&openid``, **plaintext mode** (明文模式): the body is the
  message's XML; ``signature`` is checked as above. It signs only the timestamp and nonce, not the body,
  so a signature seen once is never taken again with another body, and never by a POST when a GET (the
  URL check, whose query every access log along the way keeps) used it first. What was seen is kept, for
  twice ``max_age_secs``, in a file of the worker's own (``SeenLog``), so a restart forgets none of it.
  Plaintext mode still trusts whoever can read a request's query in time: safe mode is the one that signs
  the body.
* ``POST <path>?...&encrypt_type=aes&msg_signature``, **safe mode** (安全模式, and the encrypted half of
  compatible mode): the body is ``<xml><ToUserName/><Encrypt/></xml>``; ``msg_signature`` is checked over
  ``Encrypt`` and the message decrypted with the EncodingAESKey, its receive id checked to be this AppID
  (``sdk/wxcrypto.py``). With an EncodingAESKey configured, a plaintext POST is refused (403): the
  operator chose safe mode, and a plaintext body is signed by nothing.
* Either way a request whose ``timestamp`` is more than ``max_age_secs`` from this server's clock is
  refused (403): WeChat signs a fresh timestamp and calls again within seconds, so only a replay is old.

The message is handed to ``on_message`` as a dict, and answered ``success`` (text/plain, 200) only once
``on_message`` returned (the message is in the worker's outbox): WeChat calls again a POST it got no
answer for within 5 s, up to three times, and the ``MsgId`` keeps those from running a second turn.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import time
from typing import Callable
from urllib.parse import parse_qs

from plugins_app.channel.sdk.seen import SeenLog
from plugins_app.channel.sdk.webhook import WebhookServer
from plugins_app.channel.sdk.wxcrypto import CryptoError, MsgCrypt, parse_xml

log = logging.getLogger("ugent.worker.weixin.callback")

MAX_BODY_BYTES = 1 << 20
#: What a signature a GET used is recorded with: no POST body's digest (SHA-256) is ever this.
GET_SENTINEL = b"GET"
#: What WeChat expects from a server that took a message and sends no passive reply.
SUCCESS = "success"


def signature(token: str, timestamp: str, nonce: str) -> str:
    """The URL check's and plaintext mode's ``signature``: hex SHA1 of the three strings sorted and joined."""
    return hashlib.sha1("".join(sorted([token, timestamp, nonce])).encode()).hexdigest()


def signature_valid(token: str, sig: str | None, timestamp: str, nonce: str) -> bool:
    if not sig or not token:
        return False
    return hmac.compare_digest(signature(token, timestamp, nonce).encode(), sig.lower().encode())


def query(raw: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(raw, keep_blank_values=True).items()}


class CallbackServer(WebhookServer):
    """The official account's server URL; ``on_message(message dict)`` records one verified message."""

    name = "weixin-callback"
    max_body_bytes = MAX_BODY_BYTES
    log = log

    def __init__(self, bind: str, path: str, token: str, crypto: MsgCrypt | None,
                 on_message: Callable[[dict], None], *, max_age_secs: float = 300.0,
                 clock: Callable[[], float] = time.time, seen_path: str | None = None):
        super().__init__(bind, path)
        self.token = token
        self.crypto = crypto
        self.on_message = on_message
        self.max_age_secs = max_age_secs
        self._clock = clock
        # plaintext mode: signature -> (when, the body's digest, or GET_SENTINEL), on disk at ``seen_path``
        self._seen = SeenLog(seen_path if crypto is None else None, max(max_age_secs, 60.0) * 2, clock)

    def respond(self, method: str, target: str, headers, body: bytes | None) -> tuple[int, str]:
        return self.handle(method, target, body)

    def handle(self, method: str, target: str, body: bytes | None) -> tuple[int, str]:
        """One request: (status, text answer). Nothing is recorded unless the signature holds."""
        path, _, raw_query = target.partition("?")
        if path != self.path:
            return 404, ""
        params = query(raw_query)
        timestamp, nonce = params.get("timestamp", ""), params.get("nonce", "")
        if not signature_valid(self.token, params.get("signature"), timestamp, nonce):
            # safe mode sends both signatures: this one is checked in every mode
            log.warning("refused a %s: signature does not verify", method)
            return 403, ""
        if not self._fresh(timestamp):
            log.warning("refused a %s: timestamp %r is more than %.0f s from this server's clock", method,
                        timestamp, self.max_age_secs)
            return 403, ""
        if method == "GET":
            if self.crypto is None:  # its query is in every access log: no POST may use its signature
                self._first_use(params["signature"], b"", get=True)
            return 200, params.get("echostr", "")
        if body is None:
            return 413, ""
        if params.get("encrypt_type", "raw") == "aes":
            return self._encrypted(params, timestamp, nonce, body)
        if self.crypto is not None:
            log.warning("refused a plaintext message: an EncodingAESKey is set (safe mode); choose safe mode "
                        "(安全模式) in the account's server configuration")
            return 403, ""
        if not self._first_use(params["signature"], body):
            log.warning("refused a plaintext message: its signature was used before with another body")
            return 403, ""
        try:
            message = parse_xml(body)
        except ValueError as exc:
            log.warning("a signed message does not parse (%s); answered so WeChat does not send it again", exc)
            return 200, SUCCESS
        return self._take(message)

    def _encrypted(self, params: dict, timestamp: str, nonce: str, body: bytes) -> tuple[int, str]:
        if self.crypto is None:
            log.warning("refused an encrypted message: WEIXIN_ENCODING_AES_KEY is not set")
            return 403, ""
        try:
            encrypt = str(parse_xml(body).get("Encrypt") or "")
        except ValueError as exc:
            log.warning("refused a message whose body is not WeChat's envelope: %s", exc)
            return 400, ""
        try:
            plaintext = self.crypto.open(params.get("msg_signature"), timestamp, nonce, encrypt)
        except CryptoError as exc:
            log.warning("refused an encrypted message: %s", exc)
            return 403, ""
        try:
            message = parse_xml(plaintext)
        except ValueError as exc:
            log.warning("a signed message does not parse (%s); answered so WeChat does not send it again", exc)
            return 200, SUCCESS
        return self._take(message)

    def _take(self, message: dict) -> tuple[int, str]:
        try:
            self.on_message(message)
        except Exception:  # noqa: BLE001 - not recorded: no success, so WeChat calls again
            log.exception("could not record message %s", message.get("MsgId"))
            return 500, ""
        return 200, SUCCESS

    def _fresh(self, timestamp: str) -> bool:
        if not self.max_age_secs:
            return True
        try:
            return abs(self._clock() - int(timestamp)) <= self.max_age_secs
        except ValueError:
            return False

    def _first_use(self, sig: str, body: bytes, *, get: bool = False) -> bool:
        """Whether this plaintext signature is new, or was seen with this very body (WeChat calling again). A
        GET records ``GET_SENTINEL``, which no POST's digest matches."""
        return self._seen.first_use(sig.lower(), GET_SENTINEL if get else hashlib.sha256(body).digest())

    def stop(self) -> None:
        super().stop()
        self._seen.close()
