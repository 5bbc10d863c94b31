"""The callback URL WeCom calls: the URL check (GET) and encrypted messages (POST).

* ``GET <path>?msg_signature&timestamp&nonce&echostr``: WeCom checks the URL when the operator saves
  it; the worker verifies the signature over ``echostr``, decrypts it and answers its plaintext
  (``text/plain``, 200). Anything wrong: 403, and nothing else said.
* ``POST <path>?msg_signature&timestamp&nonce``: the body is ``<xml><ToUserName/><AgentID/><Encrypt/>
  </xml>`` (or, in the JSON callback format, ``{"tousername", "agentid", "encrypt"}``); the signature is
  checked over ``Encrypt``, the message decrypted, its receive id checked to be this corp, and the
  inner message (XML, or JSON) handed to ``on_message`` as a dict. Answered 200 with an empty body
  only once ``on_message`` returned (the message is in the worker's outbox); WeCom calls again a
  callback it got no answer for within 5 s, up to three times, and the ``MsgId`` keeps those from
  running a second turn.
"""
from __future__ import annotations

import json
import logging
from typing import Callable
from urllib.parse import parse_qs

from plugins_app.channel.sdk.webhook import WebhookServer

from plugins_app.channel.sdk.wxcrypto import CryptoError, MsgCrypt, parse_xml

log = logging.getLogger("ugent.worker.wecom.callback")

MAX_BODY_BYTES = 1 << 20


def query(raw: str) -> dict[str, str]:
    params = {k: v[0] for k, v in parse_qs(raw, keep_blank_values=True).items()}
    if "echostr" in params:  # base64 never holds a space: an unencoded '+' was read as one
        params["echostr"] = params["echostr"].replace(" ", "+")
    return params


def parse_message(text: str) -> dict:
    """The decrypted message: XML, or JSON in the JSON callback format; ValueError when it is neither."""
    if text.lstrip().startswith("{"):
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        return {k: str(v) if isinstance(v, (int, float)) else v for k, v in value.items()}
    return parse_xml(text)


def envelope(body: bytes) -> dict[str, str]:
    """The outer callback body's fields (ToUserName, AgentID, Encrypt), from XML or JSON."""
    if body.lstrip().startswith(b"{"):
        value = json.loads(body)
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        return {"ToUserName": str(value.get("tousername") or ""), "AgentID": str(value.get("agentid") or ""),
                "Encrypt": str(value.get("encrypt") or "")}
    return parse_xml(body)


class CallbackServer(WebhookServer):
    """WeCom's callback URL; ``on_message(message dict)`` records one decrypted message."""

    name = "wecom-callback"
    max_body_bytes = MAX_BODY_BYTES
    log = log

    def __init__(self, bind: str, path: str, crypto: MsgCrypt, on_message: Callable[[dict], None]):
        super().__init__(bind, path)
        self.crypto = crypto
        self.on_message = on_message

    def respond(self, method: str, target: str, headers, body: bytes | None) -> tuple[int, str]:
        return self.handle(method, target, body)

    def handle(self, method: str, target: str, body: bytes | None) -> tuple[int, str]:
        """One request: (status, text answer). Nothing is recorded unless the signature and receive id hold."""
        path, _, raw_query = target.partition("?")
        if path != self.path:
            return 404, ""
        params = query(raw_query)
        sig, timestamp, nonce = params.get("msg_signature"), params.get("timestamp", ""), params.get("nonce", "")
        if method == "GET":
            try:
                return 200, self.crypto.open(sig, timestamp, nonce, params.get("echostr", ""))
            except CryptoError as exc:
                log.warning("refused a URL check: %s", exc)
                return 403, ""
        if body is None:
            return 413, ""
        try:
            encrypt = str(envelope(body).get("Encrypt") or "")
        except (ValueError, RecursionError) as exc:  # (JSON nested past the interpreter's depth: RecursionError)
            log.warning("refused a callback whose body is not WeCom's envelope: %s", exc)
            return 400, ""
        try:
            plaintext = self.crypto.open(sig, timestamp, nonce, encrypt)
        except CryptoError as exc:
            log.warning("refused a callback: %s", exc)
            return 403, ""
        try:
            message = parse_message(plaintext)
        except (ValueError, RecursionError) as exc:
            log.warning("a signed callback's message does not parse (%s); answered so WeCom does not resend it",
                        exc)
            return 200, ""
        try:
            self.on_message(message)
        except Exception:  # noqa: BLE001 - not recorded: no 200, so WeCom calls again
            log.exception("could not record message %s", message.get("MsgId"))
            return 500, ""
        return 200, ""
