"""A fake Salesforce org on loopback, speaking Salesforce's wire formats, for the channel-salesforce tests.

* **OAuth** ``POST /services/oauth2/token`` (form, ``grant_type=client_credentials``): ``{"access_token",
  "signature", "instance_url", "id", "token_type": "Bearer", "issued_at", "scope"}``; a wrong client is
  ``400 {"error": "invalid_client", "error_description": "invalid client credentials"}`` (``revoke_client``).
  ``token_fails`` scripts the endpoint's other failures. ``expire_tokens`` makes every token issued so far
  stale: REST answers ``401 [{"message": "Session expired or invalid", "errorCode": "INVALID_SESSION_ID"}]``,
  CometD ``401::Authentication invalid`` (a handshake:
  ``403::Handshake denied`` with ``ext.sfdc.failureReason: 401::Authentication invalid``).
* **Streaming API** ``POST /cometd/{version}`` (Bayeux 1.0, long polling, JSON arrays): ``/meta/handshake``
  (``clientId``, ``ext.replay``; sets the ``BAYEUX_BROWSER`` cookie a connect must carry), ``/meta/subscribe``
  with ``ext.replay`` (-1 new only, -2 all kept, or a replay id; one no longer kept is ``400::The replayId
  {N} you provided was invalid...``), ``/meta/connect`` held ``connect_hold_secs`` (Salesforce: 110 s) until
  an event comes, answered with the events (``data.event.replayId``, ``data.event.EventUuid``,
  ``data.payload``) and the connect's reply with ``advice``; ``forget_clients`` answers the next connect
  ``403::Unknown client`` with ``advice.reconnect: handshake``; ``deny_handshakes`` denies each handshake
  (``403::Handshake denied``) with that ``ext.sfdc.failureReason``; ``connect_advice`` replaces a
  successful connect's advice; ``flush_on_subscribe`` puts the backlog in
  the subscribe's answer (a server may flush its queue with any reply). Replay ids grow but are not contiguous.
* **REST** ``POST /services/data/v{version}/sobjects/{Event__e}/``: the fields checked against the event's
  definition (``INVALID_FIELD``, ``STRING_TOO_LONG``), answered ``201 {"id", "success": true, "errors":
  [{"statusCode": "OPERATION_ENQUEUED", "message": <EventUuid>, "fields": []}]}`` (the event's EventUuid);
  scripted ``REQUEST_LIMIT_EXCEEDED`` (403) and 503 ``SERVER_UNAVAILABLE``. Errors are Salesforce's list,
  ``[{"message", "errorCode", "fields"?}]``.

Shapes follow Salesforce's Streaming API Developer Guide ("How the Client Connects", "Message Durability",
"Streaming API Error Codes", "Handling Streaming API Errors"), the REST API Developer Guide ("Create a
Record", "Status Codes and Error Responses") and "OAuth 2.0 Client Credentials Flow for Server-to-Server
Integration"::

    with FakeSalesforce() as sf:
        env = sf.env()                      # SALESFORCE_* variables for the worker
        sf.say("hello")                     # a user's message, published as an inbound platform event
        sf.texts()                          # what the worker published as outbound events
    sf.published                        # ... each with its fields, "id", "event" and "EventUuid"
"""
from __future__ import annotations

import base64
import itertools
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from urllib.parse import parse_qs

from tests.fakes import FakeHandler, FakeHTTPServer

API_VERSION = "62.0"
INBOUND = "UGENT_Inbound__e"
OUTBOUND = "UGENT_Outbound__e"
ORG_ID = "00D5g00000LmNoPEAV"
INTEGRATION_USER = "0055g00000AbCdEAAZ"
USER = "0055g00000XyZ12AAB"
CONVERSATION = "5005g00000CaSe1AAA"
SESSION_EXPIRED = [{"message": "Session expired or invalid", "errorCode": "INVALID_SESSION_ID"}]
LIMIT_EXCEEDED = [{"message": "TotalRequests Limit exceeded.", "errorCode": "REQUEST_LIMIT_EXCEEDED"}]
UNAVAILABLE = [{"message": "Server temporarily unavailable.", "errorCode": "SERVER_UNAVAILABLE"}]
INVALID_REPLAY = ("400::The replayId {%s} you provided was invalid.  Please provide a valid ID, -2 to replay all "
                  "events, or -1 to replay only new events.")

#: Each platform event's custom fields: (type, length). Text 255; a Long Text Area up to 131,072.
EVENTS = {
    INBOUND: {"ConversationId__c": ("Text", 255), "UserId__c": ("Text", 255), "Text__c": ("LongTextArea", 131072),
              "MessageId__c": ("Text", 255)},
    OUTBOUND: {"ConversationId__c": ("Text", 255), "Text__c": ("LongTextArea", 131072),
               "DeliveryId__c": ("Text", 255), "Part__c": ("Number", 18), "Parts__c": ("Number", 18),
               "InReplyTo__c": ("Text", 255)},
}


def sf_time(at: float | None = None) -> str:
    at = time.time() if at is None else at
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at * 1000) % 1000:03d}Z"


@dataclass
class Call:
    method: str
    path: str
    headers: dict
    body: object
    at: float
    status: int = 200
    answer: object = field(default_factory=dict)


class FakeSalesforce:
    def __init__(self, *, client_id: str = "3MVG9fakeConsumerKey", client_secret: str = "fakeConsumerSecret",
                 text_length: int = 131072):
        self.client_id, self.client_secret = client_id, client_secret
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.calls: list[Call] = []
        self.events = {name: dict(fields) for name, fields in EVENTS.items()}
        self.events[OUTBOUND]["Text__c"] = ("LongTextArea", text_length)
        self.bus: dict[str, list[dict]] = {f"/event/{name}": [] for name in self.events}  # kept event messages
        self.published: list[dict] = []         # each outbound event Salesforce took: its fields and "id"
        self.tokens: set[str] = set()
        self.clients: dict[str, dict] = {}      # clientId -> {"subs": {channel: position}, "cookie": ...}
        self.connect_hold_secs = 1.0
        self.hold_publish_secs = 0.0            # answer a publish only this long after taking it
        self.hold_publish_number: int | None = None  # ... only the n-th publish taken (from 1); None: every one
        self.delivered = threading.Event()      # set when a connect answer carried an event
        self.flush_on_subscribe = False         # a subscribe's answer carries the backlog, as a connect's would
        self.connect_advice: dict | None = None  # the advice of a successful connect (retry, interval 0 if None)
        self.deny_handshakes: str | None = None  # a handshake is denied with this ext.sfdc.failureReason
        self.missing_channel_error = "400::The channel you requested to subscribe to does not exist {%s}"
        self.client_revoked = False
        self._busy: list[tuple[int, list]] = []
        self._token_errors: list[tuple[int, dict]] = []
        self._replay_ids = itertools.count(4711, 3)
        self.last_replay_id = 4708
        self.purged_below = 0
        self._http = FakeHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def start(self) -> "FakeSalesforce":
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True, name="fake-salesforce")
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.lock:
            self.connect_hold_secs = 0.0
            self.changed.notify_all()
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self) -> "FakeSalesforce":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def env(self) -> dict[str, str]:
        return {"SALESFORCE_CLIENT_ID": self.client_id, "SALESFORCE_CLIENT_SECRET": self.client_secret,
                "SALESFORCE_LOGIN_URL": self.base_url}

    # ------------------------------------------------------------------ the org's side

    def say(self, text: str, *, conversation: str = CONVERSATION, user: str = USER, message_id: str | None = None,
            event: str = INBOUND, created: float | None = None, **fields) -> dict:
        """A Salesforce-side publisher publishes an inbound event (``created``: its CreatedDate as a Unix time,
        now by default); returns the event message as subscribers get it."""
        payload = {"ConversationId__c": conversation, "UserId__c": user, "Text__c": text, **fields}
        if message_id is not None:
            payload["MessageId__c"] = message_id
        return self._put_on_bus(event, payload, created)

    def _put_on_bus(self, event: str, payload: dict, created: float | None = None,
                    event_uuid: str | None = None) -> dict:
        with self.lock:
            message = {"data": {"schema": "dffQ2QLzDNHqwB8_sHMxdA",
                                "payload": {**payload, "CreatedDate": sf_time(created),
                                            "CreatedById": INTEGRATION_USER},
                                "event": {"EventUuid": event_uuid or str(uuid.uuid4()),
                                          "replayId": next(self._replay_ids)}},
                       "channel": f"/event/{event}"}
            self.bus[f"/event/{event}"].append(message)
            self.last_replay_id = message["data"]["event"]["replayId"]
            self.changed.notify_all()
        return message

    def expire_before(self, replay_id: int) -> None:
        """Events with a smaller replay id are past the retention window (purged from the bus)."""
        with self.lock:
            for channel, kept in self.bus.items():
                self.bus[channel] = [m for m in kept if m["data"]["event"]["replayId"] >= replay_id]
            self.purged_below = replay_id

    def forget_clients(self) -> None:
        """The server drops every CometD client (a client that did not reconnect in time, a server restart)."""
        with self.lock:
            self.clients.clear()
            self.changed.notify_all()

    def expire_tokens(self) -> None:
        with self.lock:
            self.tokens.clear()
            self.changed.notify_all()

    def revoke_client(self) -> None:
        """The connected app's secret is changed (or the app removed): no token is issued, none is valid."""
        with self.lock:
            self.client_revoked = True
            self.tokens.clear()
            self.changed.notify_all()

    def busy(self, *, times: int = 1, status: int = 403, errors: list | None = None) -> None:
        """The next ``times`` publishes are refused: 403 REQUEST_LIMIT_EXCEEDED, 503 SERVER_UNAVAILABLE, or
        ``status`` with Salesforce's ``errors`` list; a 2xx ``status`` answers ``{"id": null, "success": false,
        "errors": [{"statusCode", "message", "fields"}]}`` (the sObject result's shape)."""
        errors = errors or (LIMIT_EXCEEDED if status == 403 else UNAVAILABLE)
        with self.lock:
            self._busy += [(status, errors)] * times

    def token_fails(self, *, times: int = 1, status: int = 400, error: str = "unknown_error",
                    description: str = "retry your request") -> None:
        """The next ``times`` token requests fail with ``status`` and ``{"error", "error_description"}`` (the
        token endpoint's transient failures: ``unknown_error``, a login rate limit, a 503)."""
        with self.lock:
            self._token_errors += [(status, {"error": error, "error_description": description})] * times

    # ------------------------------------------------------------------ what the worker did

    def texts(self) -> list[str]:
        with self.lock:
            return [p["Text__c"] for p in self.published]

    def publishes(self) -> list[Call]:
        """Every publish request, refused or not."""
        with self.lock:
            return [c for c in self.calls if c.path.startswith(f"/services/data/v{API_VERSION}/sobjects/")]

    def bayeux(self, channel: str) -> list[dict]:
        """Every Bayeux message the worker sent on a meta channel (``/meta/subscribe``, ...)."""
        with self.lock:
            return [m for c in self.calls if c.path.startswith("/cometd/") and isinstance(c.body, list)
                    for m in c.body if isinstance(m, dict) and m.get("channel") == channel]

    def calls_to(self, path: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.path == path]

    def subscribed(self) -> bool:
        with self.lock:
            return any(f"/event/{INBOUND}" in c["subs"] for c in self.clients.values())

    # ------------------------------------------------------------------ the server

    def _handler(self):
        fake = self

        class Handler(FakeHandler):
            def route(self, method, raw):
                status, answer, headers = fake._serve(method, self.path.split("?", 1)[0], self.headers, raw)
                self.send(status, json.dumps(answer).encode(), "application/json;charset=UTF-8", headers)

        return Handler

    def _serve(self, method: str, path: str, headers, raw: bytes):
        if path == "/services/oauth2/token":
            body: object = {k: v[0] for k, v in parse_qs(raw.decode()).items()}
        else:
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
        call = Call(method, path, {k.lower(): v for k, v in headers.items()}, body, time.monotonic())
        with self.lock:
            self.calls.append(call)
        status, answer, extra = self._answer(method, path, headers, body)
        call.status, call.answer = status, answer
        return status, answer, extra

    def _answer(self, method: str, path: str, headers, body):
        if method == "POST" and path == "/services/oauth2/token":
            return self._token(body)
        token = (headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if method == "POST" and path == f"/cometd/{API_VERSION}":
            if not token:
                return 401, [{"channel": m.get("channel"), "successful": False,
                              "error": "401::Request requires authentication"} for m in body or [{}]], {}
            if token not in self.tokens:
                return 200, [self._auth_invalid(m) for m in body or [{}]], {}
            return self._bayeux(headers, body or [])
        if path.startswith("/cometd/"):
            return 400, [{"successful": False, "error": "400::Unsupported API version. Only API versions '23.0' "
                                                        "and above are supported."}], {}
        if token not in self.tokens:
            return 401, SESSION_EXPIRED, {}
        prefix = f"/services/data/v{API_VERSION}/sobjects/"
        if method == "POST" and path.startswith(prefix) and path.endswith("/"):
            return self._publish(path[len(prefix):-1], body)
        return 404, [{"errorCode": "NOT_FOUND", "message": "The requested resource does not exist"}], {}

    def _token(self, form):
        form = form if isinstance(form, dict) else {}
        with self.lock:
            if self._token_errors:
                status, answer = self._token_errors.pop(0)
                return status, answer, {}
        if form.get("grant_type") != "client_credentials":
            return 400, {"error": "unsupported_grant_type", "error_description": "grant type not supported"}, {}
        if self.client_revoked or form.get("client_id") != self.client_id or \
                form.get("client_secret") != self.client_secret:
            return 400, {"error": "invalid_client", "error_description": "invalid client credentials"}, {}
        token = f"{ORG_ID}!AQ" + base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        with self.lock:
            self.tokens.add(token)
        return 200, {"access_token": token, "signature": base64.b64encode(uuid.uuid4().bytes).decode(),
                     "scope": "api", "instance_url": self.base_url,
                     "id": f"{self.base_url}/id/{ORG_ID}/{INTEGRATION_USER}", "token_type": "Bearer",
                     "issued_at": str(int(time.time() * 1000))}, {}

    # -- Bayeux

    @staticmethod
    def _auth_invalid(m: dict) -> dict:
        """A stale or revoked token: a handshake is denied with the reason nested, any other message refused."""
        if m.get("channel") == "/meta/handshake":
            return {"ext": {"sfdc": {"failureReason": "401::Authentication invalid"}}, "advice": {"reconnect": "none"},
                    "channel": "/meta/handshake", "id": m.get("id"), "error": "403::Handshake denied",
                    "successful": False}
        return {"clientId": m.get("clientId"), "advice": {"reconnect": "none", "interval": 0},
                "channel": m.get("channel"), "id": m.get("id"), "error": "401::Authentication invalid",
                "successful": False}

    def _bayeux(self, headers, messages):
        answers, extra = [], {}
        for m in messages if isinstance(messages, list) else []:
            channel = m.get("channel")
            base = {"channel": channel, "id": m.get("id")}
            if channel == "/meta/handshake" and self.deny_handshakes:
                answers.append({**base, "ext": {"sfdc": {"failureReason": self.deny_handshakes}},
                                "advice": {"reconnect": "none"}, "error": "403::Handshake denied",
                                "successful": False})
                continue
            if channel == "/meta/handshake":
                client_id = uuid.uuid4().hex[:26]
                cookie = uuid.uuid4().hex
                with self.lock:
                    self.clients[client_id] = {"subs": {}, "cookie": cookie}
                extra["Set-Cookie"] = f"BAYEUX_BROWSER={cookie}; Path=/; HttpOnly"
                answers.append({**base, "clientId": client_id, "successful": True, "version": "1.0",
                                "minimumVersion": "1.0", "supportedConnectionTypes": ["long-polling"],
                                "ext": {"replay": True, "payload.format": True},
                                "advice": {"interval": 0, "timeout": 110000, "reconnect": "retry"}})
                continue
            client_id = m.get("clientId")
            with self.lock:
                client = self.clients.get(client_id)
            if client is None:
                answers.append({**base, "clientId": client_id, "successful": False, "error": "403::Unknown client",
                                "advice": {"reconnect": "handshake", "interval": 0}})
                continue
            cookies = SimpleCookie(headers.get("Cookie") or "")
            if "BAYEUX_BROWSER" not in cookies or cookies["BAYEUX_BROWSER"].value != client["cookie"]:
                answers.append({**base, "clientId": client_id, "successful": False,
                                "error": f"400::Client {client_id} has established a session, but no "
                                         "BAYEUX_BROWSER cookie present"})
                continue
            if channel == "/meta/subscribe":
                reply = self._subscribe(client, m, base)
                if self.flush_on_subscribe and reply["successful"]:
                    answers.extend(self._flush(client_id, client))
                answers.append(reply)
            elif channel == "/meta/connect":
                answers.extend(self._connect(client_id, client))
                answers[-1].update(id=m.get("id"))
            elif channel == "/meta/disconnect":
                with self.lock:
                    self.clients.pop(client_id, None)
                answers.append({**base, "clientId": client_id, "successful": True})
            else:
                answers.append({**base, "successful": False, "error": f"400::Unknown channel {channel}"})
        return 200, answers, extra

    def _subscribe(self, client: dict, m: dict, base: dict) -> dict:
        channel = m.get("subscription")
        base = {**base, "clientId": m.get("clientId"), "subscription": channel}
        if channel not in self.bus:
            return {**base, "successful": False, "error": self.missing_channel_error % channel}
        replay = ((m.get("ext") or {}).get("replay") or {}).get(channel, -1)
        with self.lock:
            if replay == -1:
                position = self.last_replay_id
            elif replay == -2:
                position = min((e["data"]["event"]["replayId"] for e in self.bus[channel]), default=0) - 1
            elif isinstance(replay, int) and replay >= self.purged_below:
                position = replay
            else:
                return {**base, "successful": False, "error": INVALID_REPLAY % replay}
            client["subs"][channel] = position
        return {**base, "successful": True, "ext": {"replay": {channel: replay}}}

    def _connect(self, client_id: str, client: dict) -> list[dict]:
        deadline = time.monotonic() + self.connect_hold_secs
        with self.lock:
            while True:
                if self.clients.get(client_id) is not client:
                    return [{"channel": "/meta/connect", "clientId": client_id, "successful": False,
                             "error": "403::Unknown client", "advice": {"reconnect": "handshake", "interval": 0}}]
                if not self.tokens:
                    return [{"channel": "/meta/connect", "clientId": client_id, "successful": False,
                             "error": "401::Authentication invalid", "advice": {"reconnect": "none", "interval": 0}}]
                events = [e for channel, position in client["subs"].items() for e in self.bus[channel]
                          if e["data"]["event"]["replayId"] > position]
                left = deadline - time.monotonic()
                if events or left <= 0:
                    break
                self.changed.wait(left)
        return self._flush(client_id, client) + [
            {"channel": "/meta/connect", "clientId": client_id, "successful": True,
             "advice": self.connect_advice or {"interval": 0, "timeout": 110000, "reconnect": "retry"}}]

    def _flush(self, client_id: str, client: dict) -> list[dict]:
        """The events queued for a client (past its position on each channel), taken off its queue."""
        with self.lock:
            events = [e for channel, position in client["subs"].items() for e in self.bus[channel]
                      if e["data"]["event"]["replayId"] > position]
            for e in events:
                client["subs"][e["channel"]] = max(client["subs"][e["channel"]], e["data"]["event"]["replayId"])
            if events:
                self.delivered.set()
        return [dict(e, clientId=client_id) for e in events]

    # -- REST

    def _publish(self, event: str, body):
        definition = self.events.get(event)
        if definition is None:
            return 404, [{"errorCode": "NOT_FOUND", "message": "The requested resource does not exist"}], {}
        with self.lock:
            if self._busy:
                status, errors = self._busy.pop(0)
                if status < 300:
                    return status, {"id": None, "success": False, "errors": errors}, {}
                return status, errors, {}
        if not isinstance(body, dict):
            return 400, [{"errorCode": "JSON_PARSER_ERROR", "message": "Unexpected parameter encountered during "
                                                                       "deserialization"}], {}
        for name, value in body.items():
            if name not in definition:
                return 400, [{"errorCode": "INVALID_FIELD", "message": f"No such column '{name}' on sobject of "
                                                                       f"type {event}"}], {}
            kind, length = definition[name]
            if kind != "Number" and (not isinstance(value, str) or len(value.encode("utf-16-le")) // 2 > length):
                return 400, [{"errorCode": "STRING_TOO_LONG", "fields": [name],
                              "message": f"{name.removesuffix('__c').replace('_', ' ')}: data value too large: "
                                         f"{str(value)[:40]}... (max length={length})"}], {}
        event_id, event_uuid = "e00" + uuid.uuid4().hex[:15], str(uuid.uuid4())
        with self.lock:
            self.published.append({**body, "id": event_id, "event": event, "EventUuid": event_uuid})
            self._put_on_bus(event, body, event_uuid=event_uuid)
            held = self.hold_publish_number in (None, len(self.published))
        if self.hold_publish_secs and held:
            time.sleep(self.hold_publish_secs)  # taken, but the answer is late: a window to kill the publisher in
        # a platform event's create answer: success, with the event's EventUuid in an OPERATION_ENQUEUED "error"
        return 201, {"id": event_id, "success": True,
                     "errors": [{"statusCode": "OPERATION_ENQUEUED", "message": event_uuid, "fields": []}]}, {}
