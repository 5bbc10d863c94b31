"""What the fakes of Tencent's two server APIs share (tests/fakes/weixin.py, tests/fakes/wecom.py): the HTTP server
on loopback, the record of every call, the access tokens it issued, scripted errcodes for the next sends, the
user's messages as XML. Each platform's fake answers its own endpoints in ``_answer``.

Both platforms answer HTTP 200 and put their errors in ``{"errcode": N, "errmsg": "..."}``; an ``_answer`` of
None is answered HTTP 502 (a proxy's error page), a ``(bytes, content type)`` as that file.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from tests.fakes import FakeHandler, FakeHTTPServer

OK = {"errcode": 0, "errmsg": "ok"}


@dataclass
class Call:
    method: str
    path: str
    params: dict
    body: dict | None
    at: float
    answer: dict = field(default_factory=dict)

    @property
    def errcode(self) -> int:
        return int(self.answer.get("errcode", 0))


class TencentFake:
    #: The thread's name; the path a send goes to (``sends``); the errmsg of each errcode.
    name = "fake-tencent"
    send_path = ""
    errors: dict[int, str] = {}
    #: The errcode of an access token the fake never issued.
    unknown_token_errcode = 40014
    #: The Content-Type of a JSON answer (each platform's own spelling).
    json_content_type = "application/json; charset=UTF-8"

    def __init__(self):
        self.lock = threading.RLock()
        self.calls: list[Call] = []
        self.sent: list[dict] = []                        # each message delivered
        self.tokens: dict[str, float] = {}                # access token -> when it expires (monotonic)
        self.expires_in = 7200
        self.media_files: dict[str, tuple[bytes, str, str]] = {}
        self.callback_url: str | None = None
        self.hold_send_secs = 0.0                         # answer a send only this long after delivering it
        self._script: list[int] = []
        self._secret_reset = False
        self._http = FakeHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True

    def error(self, code: int) -> dict:
        return {"errcode": code, "errmsg": self.errors.get(code, "error")}

    # ------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def start(self):
        threading.Thread(target=self._http.serve_forever, daemon=True, name=self.name).start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ scripting

    def script_send(self, *errcodes: int) -> None:
        """The next sends are answered with these errcodes, one each, before any is delivered."""
        with self.lock:
            self._script.extend(errcodes)

    def expire_tokens(self) -> None:
        """Every access token issued so far has expired (42001 at its next use)."""
        with self.lock:
            for token in self.tokens:
                self.tokens[token] = 0.0

    def reset_secret(self) -> None:
        """The app's secret was reset on the platform: the token endpoint refuses the old one."""
        with self.lock:
            self._secret_reset = True

    # ------------------------------------------------------------------ what the app did

    def sends(self) -> list[Call]:
        """Every send request, refused or not."""
        return self.calls_to(self.send_path)

    def calls_to(self, path: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.path == path]

    # ------------------------------------------------------------------ the callback's messages

    @staticmethod
    def to_xml(message: dict) -> str:
        def value(v: str) -> str:
            return v if v.lstrip("-").replace(".", "").isdigit() else f"<![CDATA[{v}]]>"
        return "<xml>" + "".join(f"<{k}>{value(str(v))}</{k}>" for k, v in message.items()) + "</xml>"

    # ------------------------------------------------------------------ the API

    def _handler(self):
        fake = self

        class Handler(FakeHandler):
            def route(self, method, raw):
                url = urlsplit(self.path)
                params = {k: v[0] for k, v in parse_qs(url.query).items()}
                answer, headers = fake._serve(method, url.path, params, raw, self.headers.get("Content-Type") or "")
                if answer is None:
                    self.send(502, b"<html>502 Bad Gateway</html>", "text/html")
                    return
                if isinstance(answer, tuple):
                    body, ctype = answer
                else:
                    body, ctype = json.dumps(answer, ensure_ascii=False).encode(), fake.json_content_type
                self.send(200, body, ctype, headers)  # the platform answers 200 and puts its errors in errcode

        return Handler

    def _parse(self, raw: bytes, ctype: str):
        """A request's body as recorded in its ``Call``: JSON, or None."""
        if ctype.startswith("multipart/"):
            return None
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return None

    def _serve(self, method: str, path: str, params: dict, raw: bytes, ctype: str):
        body = self._parse(raw, ctype)
        call = Call(method, path, params, body, time.monotonic())
        with self.lock:
            self.calls.append(call)
        answer, headers = self._answer(method, path, params, body, raw, ctype)
        call.answer = answer if isinstance(answer, dict) else ({"errcode": 502} if answer is None else dict(OK))
        return answer, headers

    def _answer(self, method: str, path: str, params: dict, body, raw: bytes, ctype: str):
        """``(answer, headers)`` of one request: a dict (JSON), ``(bytes, content type)``, or None (HTTP 502)."""
        raise NotImplementedError

    def _check_token(self, token: str | None) -> dict | None:
        """The error of a call whose access token is missing, unknown or expired; None when it is valid."""
        if not token:
            return self.error(41001)
        with self.lock:
            expires = self.tokens.get(token)
        if expires is None:
            return self.error(self.unknown_token_errcode)
        if time.monotonic() >= expires:
            return self.error(42001)
        return None
