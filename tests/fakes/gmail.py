"""Gmail's API, Google's OAuth token endpoint and JWKS, and Pub/Sub push, faked on 127.0.0.1 (stdlib HTTP).

Shapes as Google documents them: ``POST /token`` (refresh_token grant → ``access_token``,
``expires_in``; a revoked grant → 400 ``{"error": "invalid_grant"}``), ``POST
/gmail/v1/users/me/watch`` → ``{"historyId", "expiration"}``, ``GET .../history?startHistoryId=``
→ ``{"history": [{"id", "messagesAdded": [{"message": {"id", "threadId", "labelIds"}}]}],
"historyId"}`` (404 for a startHistoryId it no longer has), ``GET .../messages/{id}?format=raw`` →
``{"id", "threadId", "raw": base64url}``, ``POST .../messages/send`` ``{"raw"}`` → ``{"id",
"threadId", "labelIds": ["SENT"]}``, ``GET .../profile``, ``GET /certs`` (JWKS). ``push(url)``
POSTs a Pub/Sub push (``{"message": {"data", "messageId", "publishTime"}, "subscription"}``) with a
Google-style OIDC token signed by this fake's key.

    with FakeGmail(address="bot@example.org") as g:
        g.add_mail(raw)          # a message arrives: a new history record
        g.push(endpoint)         # Pub/Sub tells the worker
        g.sent()                 # what messages.send took, as EmailMessages
        g.revoke()               # the refresh token is revoked
        g.throttle_send(2)       # the next send answers 429 with Retry-After: 2
"""
from __future__ import annotations

import base64
import email
import email.policy
import json
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlparse

from tests.fakes import FakeHTTPServer

AUDIENCE = "https://ugent.example.org/push"
SERVICE_ACCOUNT = "gmail-push@example-project.iam.gserviceaccount.com"


class FakeGmail:
    def __init__(self, *, address: str = "bot@example.org"):
        import jwt
        from cryptography.hazmat.primitives.asymmetric import rsa
        self.address = address
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.kid = "fake-" + uuid.uuid4().hex[:8]
        self._jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self._key.public_key()))
        self._jwk.update(kid=self.kid, alg="RS256", use="sig")
        self.lock = threading.Lock()
        self.history_id = 1000
        self.history: list[dict] = []
        self.messages: dict[str, dict] = {}
        self._sent: list[bytes] = []
        self.revoked = False
        self.throttles: list[float] = []
        self.throttled = 0
        self._read_failures: list[int] = []     # statuses the next messages.get calls answer (fail_reads)
        self.watches: list[dict] = []
        self.requests: list[tuple[str, str]] = []
        self.access_token = "ya29." + uuid.uuid4().hex
        self.server: FakeHTTPServer | None = None

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> "FakeGmail":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                fake._route(self, "GET")

            def do_POST(self):  # noqa: N802
                fake._route(self, "POST")

            def log_message(self, *a):
                pass

        self.server = FakeHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def api_url(self) -> str:
        return self.base + "/gmail/v1/"

    @property
    def token_url(self) -> str:
        return self.base + "/token"

    @property
    def jwks_url(self) -> str:
        return self.base + "/certs"

    # -- the test's side ----------------------------------------------------------------

    def add_mail(self, raw) -> str:
        data = raw.as_bytes() if hasattr(raw, "as_bytes") else raw
        with self.lock:
            gid = uuid.uuid4().hex[:16]
            self.messages[gid] = {"id": gid, "threadId": gid, "raw": data}
            self.history_id += 1
            self.history.append({"id": str(self.history_id),
                                 "messages": [{"id": gid, "threadId": gid}],
                                 "messagesAdded": [{"message": {"id": gid, "threadId": gid,
                                                                "labelIds": ["INBOX", "UNREAD"]}}]})
            return gid

    def oidc_token(self, *, audience: str = AUDIENCE, email_claim: str = SERVICE_ACCOUNT, key=None) -> str:
        import jwt
        now = int(time.time())
        claims = {"iss": "https://accounts.google.com", "aud": audience, "azp": "1234567890",
                  "email": email_claim, "email_verified": True, "sub": "1234567890", "iat": now, "exp": now + 3600}
        return jwt.encode(claims, key or self._key, algorithm="RS256", headers={"kid": self.kid})

    def push(self, endpoint: str, *, token: str | None = None, message_id: str | None = None) -> int:
        """Pub/Sub delivers one push for the mailbox's current historyId; returns the endpoint's status."""
        data = base64.b64encode(json.dumps({"emailAddress": self.address,
                                            "historyId": self.history_id}).encode()).decode()
        body = json.dumps({"message": {"data": data, "messageId": message_id or uuid.uuid4().hex[:12],
                                       "publishTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                           "subscription": "projects/example-project/subscriptions/ugent-push"}).encode()
        req = urllib.request.Request(endpoint, data=body, method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {token or self.oidc_token()}"})
        try:
            with urllib.request.urlopen(req, timeout=20) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError):
            return 0  # nobody listens at the endpoint (Pub/Sub would retry later)

    def sent(self):
        with self.lock:
            raws = list(self._sent)
        return [email.message_from_bytes(r, policy=email.policy.default) for r in raws]

    def revoke(self) -> None:
        self.revoked = True
        self.access_token = "ya29.revoked-" + uuid.uuid4().hex  # the old access token stops working too

    def fail_reads(self, status: int = 503, times: int = 1) -> None:
        """The next ``times`` messages.get calls answer ``status`` (Gmail's backend busy), with a short Retry-After."""
        with self.lock:
            self._read_failures += [status] * times

    def throttle_send(self, retry_after: float) -> None:
        self.throttles.append(retry_after)

    # -- the server's side ----------------------------------------------------------------

    def _reply(self, h, status: int, body=None, headers=None):
        data = b"" if body is None else json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json; charset=UTF-8")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)

    def _route(self, h, method: str):
        url = urlparse(h.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        length = int(h.headers.get("Content-Length") or 0)
        raw_body = h.rfile.read(length) if length else b""
        self.requests.append((method, url.path))
        if url.path == "/certs":
            return self._reply(h, 200, {"keys": [self._jwk]})
        if url.path == "/token" and method == "POST":
            form = {k: v[0] for k, v in parse_qs(raw_body.decode()).items()}
            if self.revoked or form.get("grant_type") != "refresh_token":
                return self._reply(h, 400, {"error": "invalid_grant",
                                            "error_description": "Token has been expired or revoked."})
            return self._reply(h, 200, {"access_token": self.access_token, "expires_in": 3599,
                                        "scope": "https://www.googleapis.com/auth/gmail.modify",
                                        "token_type": "Bearer"})
        if not url.path.startswith("/gmail/v1/users/me/"):
            return self._reply(h, 404, {"error": {"code": 404, "message": "Not Found", "status": "NOT_FOUND"}})
        if h.headers.get("Authorization") != f"Bearer {self.access_token}":
            return self._reply(h, 401, {"error": {"code": 401, "message": "Request had invalid authentication "
                                                  "credentials.", "status": "UNAUTHENTICATED"}})
        path = url.path[len("/gmail/v1/users/me/"):]
        body = json.loads(raw_body) if raw_body else {}
        with self.lock:
            if path == "watch" and method == "POST":
                self.watches.append(body)
                return self._reply(h, 200, {"historyId": str(self.history_id),
                                            "expiration": str(int((time.time() + 7 * 86400) * 1000))})
            if path == "profile":
                return self._reply(h, 200, {"emailAddress": self.address, "messagesTotal": len(self.messages),
                                            "threadsTotal": len(self.messages), "historyId": str(self.history_id)})
            if path == "history":
                start = int(query.get("startHistoryId", "0"))
                records = [r for r in self.history if int(r["id"]) > start]
                out = {"historyId": str(self.history_id)}
                if records:
                    out["history"] = records
                return self._reply(h, 200, out)
            if path == "messages/send" and method == "POST":
                if self.throttles:
                    self.throttled += 1
                    return self._reply(h, 429, {"error": {"code": 429, "message": "User-rate limit exceeded.",
                                                          "status": "RESOURCE_EXHAUSTED"}},
                                       {"Retry-After": str(self.throttles.pop(0))})
                data = base64.urlsafe_b64decode(body["raw"] + "==")
                self._sent.append(data)
                gid = uuid.uuid4().hex[:16]
                return self._reply(h, 200, {"id": gid, "threadId": body.get("threadId", gid), "labelIds": ["SENT"]})
            if path.startswith("messages/"):
                if self._read_failures:
                    status = self._read_failures.pop(0)
                    return self._reply(h, status, {"error": {"code": status, "message": "The service is currently "
                                                             "unavailable.", "status": "UNAVAILABLE"}},
                                       {"Retry-After": "0.01"})
                msg = self.messages.get(path.split("/", 1)[1])
                if msg is None:
                    return self._reply(h, 404, {"error": {"code": 404, "message": "Requested entity was not found.",
                                                          "status": "NOT_FOUND"}})
                return self._reply(h, 200, {"id": msg["id"], "threadId": msg["threadId"], "labelIds": ["INBOX"],
                                            "raw": base64.urlsafe_b64encode(msg["raw"]).decode().rstrip("=")})
        return self._reply(h, 404, {"error": {"code": 404, "message": "Not Found", "status": "NOT_FOUND"}})
