"""Gmail push for channel-email (``--gmail-push``): users.watch + history.list in, messages.send out.

Gmail tells a Pub/Sub topic that the mailbox changed; Pub/Sub POSTs that notification to this
worker's push endpoint with a Google-signed OIDC token (``Authorization: Bearer <JWT>``). The
worker verifies the token (signature against Google's JWKS, ``aud`` = ``--push-audience``, issuer
``accounts.google.com``, and the ``email`` claim when ``--push-service-account`` is set), answers
204 at once, and reads ``users.history.list`` from its stored ``historyId``; the notification
carries no mail, so acking it early loses nothing: the cursor moves only once the outbox holds each
mail. A push that never comes is covered by a fallback read every ``--gmail-poll-secs``.

Variables: GMAIL_CLIENT_ID, GMAIL_CLIENT_SECRET, GMAIL_REFRESH_TOKEN (an OAuth client with the
``gmail.modify`` scope), and, to point at a regional endpoint or a fake, GMAIL_API_BASE_URL
(default ``https://gmail.googleapis.com/gmail/v1/``), GMAIL_TOKEN_URL (default
``https://oauth2.googleapis.com/token``), GMAIL_PUSH_JWKS_URL (default
``https://www.googleapis.com/oauth2/v3/certs``).
"""
from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler

from plugins_app.channel.sdk import ChannelRefused, DeliveryFailed
from plugins_app.channel.sdk.webhook import BodyRefused, BoundedHTTPServer, body_length, read_body

DEFAULT_API = "https://gmail.googleapis.com/gmail/v1/"
DEFAULT_TOKEN_URL = "https://oauth2.googleapis.com/token"
DEFAULT_JWKS = "https://www.googleapis.com/oauth2/v3/certs"
GOOGLE_ISSUERS = ["https://accounts.google.com", "accounts.google.com"]
CURSOR = "gmail:history"
#: The largest push body read: a Pub/Sub push of Gmail's notification is a few hundred bytes.
MAX_PUSH_BYTES = 64 * 1024
WATCH_RENEW_SECS = 24 * 3600  # Google asks for a watch renewal at least every 7 days; daily is its advice

log = logging.getLogger("ugent.worker.gmail")


class Transient(Exception):
    """Gmail answered 429/5xx or was unreachable: worth trying again."""


class GmailPush:
    def __init__(self, worker, args):
        env = os.environ
        self.worker = worker
        self.args = args
        self.api = (env.get("GMAIL_API_BASE_URL") or DEFAULT_API).rstrip("/") + "/"
        self.token_url = env.get("GMAIL_TOKEN_URL") or DEFAULT_TOKEN_URL
        self.jwks_url = env.get("GMAIL_PUSH_JWKS_URL") or DEFAULT_JWKS
        self.client_id = env.get("GMAIL_CLIENT_ID", "")
        self.client_secret = env.get("GMAIL_CLIENT_SECRET", "")
        self.refresh_token = env.get("GMAIL_REFRESH_TOKEN", "")
        self._access: str | None = None
        self._access_until = 0.0
        self.wake = threading.Event()
        self.server: BoundedHTTPServer | None = None
        self._jwks = None
        import httpx
        self.http = httpx.Client(timeout=args.timeout_secs)

    # -- OAuth and the API --------------------------------------------------------

    def check(self) -> None:
        missing = [n for n, v in (("GMAIL_CLIENT_ID", self.client_id), ("GMAIL_CLIENT_SECRET", self.client_secret),
                                  ("GMAIL_REFRESH_TOKEN", self.refresh_token)) if not v]
        if missing:
            raise ChannelRefused(f"email: {', '.join(missing)} not set (--gmail-push)")
        if not self.args.gmail_topic or not self.args.push_audience:
            raise ChannelRefused("email: --gmail-push needs --gmail-topic and --push-audience")
        self._refresh()

    def _refresh(self) -> str:
        try:
            resp = self.http.post(self.token_url, data={
                "grant_type": "refresh_token", "refresh_token": self.refresh_token,
                "client_id": self.client_id, "client_secret": self.client_secret})
        except Exception as exc:  # noqa: BLE001 - httpx's transport errors
            raise Transient(f"the token endpoint is unreachable: {type(exc).__name__}: {exc}") from exc
        if resp.status_code in (400, 401):
            body = _json(resp)
            raise ChannelRefused(f"Gmail refused the refresh token: {body.get('error', resp.status_code)}"
                                 f"{': ' + body['error_description'] if body.get('error_description') else ''}")
        if resp.status_code != 200:
            raise Transient(f"token endpoint answered {resp.status_code}")
        body = resp.json()
        self._access = body["access_token"]
        self._access_until = time.monotonic() + float(body.get("expires_in", 3600)) - 60
        return self._access

    def call(self, method: str, path: str, *, json_body=None, params=None, retries: int = 4,
             timeout: float | None = None):
        """One API call: a 401 refreshes the token once (whatever ``retries``: an expired token is no reason to
        give up); 429/5xx wait Retry-After (or back off) and try again, ``retries`` times (0: ``Transient`` at
        the first). ``timeout``: this call's, not the client's."""
        refreshed, waits = False, 0
        while True:
            if self._access is None or time.monotonic() > self._access_until:
                self._refresh()
            try:
                resp = self.http.request(method, self.api + path, json=json_body, params=params,
                                         headers={"Authorization": f"Bearer {self._access}"},
                                         **({"timeout": timeout} if timeout is not None else {}))
            except Exception as exc:  # noqa: BLE001 - httpx's transport errors
                raise Transient(f"Gmail unreachable: {type(exc).__name__}: {exc}") from exc
            if resp.status_code == 401 and not refreshed:
                refreshed = True
                self._refresh()
                continue
            if resp.status_code == 401:
                raise ChannelRefused(f"Gmail refused the access token: {_error(resp)}")
            if resp.status_code == 403 and "insufficient" in _error(resp).lower():
                raise ChannelRefused(f"Gmail refused the call (missing scope): {_error(resp)}")
            if resp.status_code == 429 or resp.status_code >= 500:
                if waits >= retries or self.worker.stopping.is_set():
                    raise Transient(f"Gmail answered {resp.status_code}: {_error(resp)}")
                delay = _retry_after(resp) or min(2.0 ** waits, 60.0)
                waits += 1
                log.warning("Gmail answered %s; waiting %.1f s and trying again", resp.status_code, delay)
                self.worker.stopping.wait(delay)
                continue
            return resp

    # -- inbound ------------------------------------------------------------------

    def watch(self) -> int:
        resp = self.call("POST", "users/me/watch", json_body={
            "topicName": self.args.gmail_topic, "labelIds": [self.args.mailbox.upper()],
            "labelFilterBehavior": "INCLUDE"})
        if resp.status_code != 200:
            raise ChannelRefused(f"Gmail refused users.watch on {self.args.gmail_topic}: {_error(resp)}")
        return int(resp.json()["historyId"])

    def start_push_server(self) -> str:
        push = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                # the length is checked, then the token, and only then is a byte of the body read: an
                # unauthenticated or oversized POST costs a header's parse, never its body's memory
                try:
                    status = self._take()
                except Exception:  # noqa: BLE001 - an answer, never a connection dropped unanswered
                    log.exception("push endpoint: answering a POST failed")
                    self.close_connection, status = True, 500
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _take(self) -> int:
                try:
                    body_length(self.headers, MAX_PUSH_BYTES)
                except BodyRefused as exc:
                    self.close_connection = True  # its body is never read: it must not be taken for a request
                    log.warning("push refused (%d): %s", exc.status, exc.reason)
                    return exc.status
                status = push.authorize(self.headers.get("Authorization", ""))
                if status is not None:
                    self.close_connection = True
                    return status
                try:
                    body = read_body(self, MAX_PUSH_BYTES)  # (a body cut short: 400, never handed on)
                except BodyRefused as exc:
                    log.warning("push refused (%d): %s", exc.status, exc.reason)
                    return exc.status
                return push.notified(body)

            def log_message(self, fmt, *a):
                log.debug("push endpoint: " + fmt, *a)

        self.server = BoundedHTTPServer((self.args.push_bind, self.args.push_port), Handler)  # 64 at once, 30 s each
        threading.Thread(target=self.server.serve_forever, name="gmail-push", daemon=True).start()
        host, port = self.server.server_address[:2]
        url = f"http://{host}:{port}/"
        log.info("Gmail push endpoint listening on %s", url)
        return url

    def authorize(self, authorization: str) -> int | None:
        """None when ``authorization`` is Google's OIDC token for this push endpoint; else 401 (no bearer
        token) or 403 (a token that does not verify, or another service account's: the sender is not Google).
        Checked before a byte of the push's body is read."""
        import jwt
        if not authorization.startswith("Bearer "):
            log.warning("push refused: no bearer token")
            return 401
        token = authorization[len("Bearer "):]
        try:
            if self._jwks is None:
                self._jwks = jwt.PyJWKClient(self.jwks_url, cache_keys=True)
            key = self._jwks.get_signing_key_from_jwt(token)
            claims = jwt.decode(token, key.key, algorithms=["RS256"], audience=self.args.push_audience,
                                issuer=GOOGLE_ISSUERS, options={"require": ["exp", "iat", "aud", "iss"]})
        except Exception as exc:  # noqa: BLE001 - any bad token is refused
            log.warning("push refused: %s", exc)
            return 403
        if self.args.push_service_account and (claims.get("email") != self.args.push_service_account
                                               or not claims.get("email_verified")):
            log.warning("push refused: token of %r, not %r", claims.get("email"), self.args.push_service_account)
            return 403
        return None

    def notified(self, body: bytes) -> int:
        """An authorized push's body: 204 (the reader woken) when it is Pub/Sub's message, else 400."""
        try:
            data = json.loads(base64.b64decode(json.loads(body)["message"]["data"]))
            log.info("push %s: %s changed (historyId %s)", json.loads(body)["message"].get("messageId"),
                     data.get("emailAddress"), data.get("historyId"))
        except (ValueError, KeyError, TypeError):
            return 400
        self.wake.set()
        return 204

    def run(self, handle_raw) -> None:
        """Watch, then read history whenever a push (or the fallback timer) says so, until the worker stops."""
        state = self.worker.state
        history_id = self.watch()
        watched_at = time.monotonic()
        _, cursor = state.cursor(CURSOR)
        if cursor is None:
            state.set_cursor(CURSOR, 0, history_id)  # the first start reads what arrives from now on
        self._sync_logged(handle_raw)  # what came while the worker was down, before any push is taken
        self.start_push_server()
        self.worker.connected_once.set()
        while not self.worker.stopping.is_set():
            deadline = time.monotonic() + self.args.gmail_poll_secs
            while not self.wake.is_set() and not self.worker.stopping.is_set() and time.monotonic() < deadline:
                self.wake.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            self.wake.clear()
            if self.worker.stopping.is_set():
                break
            if time.monotonic() - watched_at > WATCH_RENEW_SECS:
                self.watch()
                watched_at = time.monotonic()
            self._sync_logged(handle_raw)

    def _sync_logged(self, handle_raw) -> None:
        try:
            self.sync(handle_raw)
        except Transient as exc:
            log.warning("history read failed, will retry: %s", exc)

    def sync(self, handle_raw) -> None:
        state = self.worker.state
        _, start = state.cursor(CURSOR)
        page = None
        while True:
            params = {"startHistoryId": str(start), "historyTypes": "messageAdded",
                      "labelId": self.args.mailbox.upper()}
            if page:
                params["pageToken"] = page
            resp = self.call("GET", "users/me/history", params=params)
            if resp.status_code == 404:
                # The stored historyId is older than Gmail keeps (about a week): start again from now.
                log.error("Gmail no longer has history %s; reading on from the mailbox's current history", start)
                profile = self.call("GET", "users/me/profile").json()
                state.set_cursor(CURSOR, 0, int(profile["historyId"]))
                return
            body = resp.json()
            for record in body.get("history", []):
                for added in record.get("messagesAdded", []):
                    gid = added["message"]["id"]
                    raw = self.fetch_raw(gid)
                    if raw is not None:
                        handle_raw(gid, raw)
                state.set_cursor(CURSOR, 0, max(start, int(record["id"])))
            page = body.get("nextPageToken")
            if not page:
                if body.get("historyId"):
                    state.set_cursor(CURSOR, 0, max(state.cursor(CURSOR)[1], int(body["historyId"])))
                return

    def fetch_raw(self, gid: str, *, retries: int = 4, timeout: float | None = None) -> bytes | None:
        """The mail's raw bytes; None if Gmail has it no more (a 404)."""
        resp = self.call("GET", f"users/me/messages/{gid}", params={"format": "raw"}, retries=retries,
                         timeout=timeout)
        if resp.status_code == 404:
            return None  # deleted meanwhile
        return base64.urlsafe_b64decode(resp.json()["raw"] + "==")

    # -- outbound -----------------------------------------------------------------

    def send(self, raw: bytes) -> str:
        try:
            resp = self.call("POST", "users/me/messages/send",
                             json_body={"raw": base64.urlsafe_b64encode(raw).decode().rstrip("=")})
        except Transient as exc:
            raise DeliveryFailed(f"email: {exc}") from exc
        except ChannelRefused as exc:
            self.worker._refusal = exc.reason
            raise DeliveryFailed(exc.reason) from exc
        if resp.status_code >= 400:
            raise DeliveryFailed(f"email: Gmail refused the message: {resp.status_code} {_error(resp)}",
                                 permanent=resp.status_code in (400, 403, 413))
        return resp.json().get("id", "")

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        self.http.close()


def _json(resp) -> dict:
    try:
        body = resp.json()
        return body if isinstance(body, dict) else {}
    except ValueError:
        return {}


def _error(resp) -> str:
    err = _json(resp).get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err.get("status") or resp.status_code)
    return str(err or resp.status_code)


def _retry_after(resp) -> float | None:
    value = resp.headers.get("Retry-After")
    try:
        return max(0.0, min(float(value), 300.0)) if value else None
    except ValueError:
        return None
