"""The Discord channel: the Gateway websocket in, REST "create message" out, on the worker SDK.

    python -m plugins_app.channel.workers.discord

A thin client of its own (``websockets`` for the Gateway, ``httpx`` for REST), not hikari:
docs/channels/discord.md says why. Environment: ``DISCORD_BOT_TOKEN`` and
``DISCORD_API_BASE_URL`` (default ``https://discord.com/api/v10``; the Gateway URL is read
from ``GET /gateway/bot`` there, as Discord asks).

* Gateway: HELLO, IDENTIFY with the MESSAGE_CONTENT intent, heartbeats with ACK tracking (a
  heartbeat whose ACK has not come when the next is due closes the socket and resumes), RESUME
  with ``seq`` on ``resume_gateway_url``, RECONNECT (op 7) and INVALID_SESSION (op 9) handled.
  The session (id, resume URL, the last ``seq`` whose message is in the outbox) is kept in the
  state directory, so a worker killed and restarted resumes and Discord replays what came after.
  The Gateway runs in a thread of its own, which records each message in the outbox (then its
  ``seq`` is committed); the listener submits each channel's messages on a lane of that channel's
  (``InboxLanes``), so one user's file downloading for minutes holds back that channel only.
  Close codes only the operator can fix (4004 bad token, 4014 disallowed intent, ...) end the
  worker with ``ChannelRefused``; the rest reconnect with a growing backoff, never a hot loop.
* Inbound: MESSAGE_CREATE → ``InboundMessage`` (conversation = channel id, a thread being its own
  channel; message id = Discord's snowflake, the hub's dedupe key; ``source_type`` user for a DM,
  room for a guild channel); attachments downloaded and stored on the host (a 5xx, a 429 or no answer
  from the CDN raises ``MediaNotReady``: the message waits, its chat only, and the SDK fetches again);
  replies as ``reply_to``.
  The bot's own messages, and other bots', are not submitted.
* Outbound: ``POST /channels/{id}/messages``, JSON or multipart (``payload_json`` + ``files[n]``),
  split at 2000 characters, each part with a ``nonce`` and ``enforce_nonce`` so a resend after a
  crash returns the message Discord already made instead of a second one; 429 ``retry_after``
  (global and per route) waited out and the same request sent again; ``X-RateLimit-Remaining: 0``
  waits ``X-RateLimit-Reset-After`` before the next request on that route.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import threading
import time
from pathlib import Path

import httpx

from plugins_app.channel.sdk import (Attachment, ChannelRefused, ChannelWorker, DeliveryFailed, InboundMessage,
                                     MessageValidationError)
from plugins_app.channel.sdk.download import download
from plugins_app.channel.sdk.messages import ReplyContext
from plugins_app.channel.sdk.outbox import default_state_dir
from plugins_app.channel.sdk.text import split_text
from plugins_app.channel.sdk.webhook import InboxLanes, WebhookInbox

KIND = "channel-discord"
DESCRIPTION = "Discord: the Gateway websocket in, REST create message out (DISCORD_BOT_TOKEN)."
ENV_REFS = ("DISCORD_BOT_TOKEN", "DISCORD_API_BASE_URL")
DEFAULT_API_BASE_URL = "https://discord.com/api/v10"
MESSAGE_LIMIT = 2000
GATEWAY_VERSION = "10"

# Gateway intents: GUILDS, GUILD_MESSAGES, DIRECT_MESSAGES, MESSAGE_CONTENT (privileged).
INTENTS = (1 << 0) | (1 << 9) | (1 << 12) | (1 << 15)

# Gateway opcodes.
OP_DISPATCH, OP_HEARTBEAT, OP_IDENTIFY, OP_RESUME, OP_RECONNECT = 0, 1, 2, 6, 7
OP_INVALID_SESSION, OP_HELLO, OP_HEARTBEAT_ACK = 9, 10, 11

# Close codes after which reconnecting cannot help: the operator must act.
REFUSING_CLOSE_CODES = {
    4004: "4004 Authentication failed: the bot token is wrong or was reset",
    4010: "4010 Invalid shard",
    4011: "4011 Sharding required: the bot is in too many guilds for one connection",
    4012: "4012 Invalid API version",
    4013: "4013 Invalid intent(s)",
    4014: "4014 Disallowed intent(s): turn on the Message Content intent for the bot in the Developer Portal",
}
# Close codes after which the session cannot be resumed: identify afresh.
FRESH_SESSION_CLOSE_CODES = {4007, 4009}
ZOMBIE_CLOSE_CODE = 4000  # not 1000/1001, which would end the session on Discord's side

MAX_RATE_LIMIT_WAIT_SECS = 60.0
BACKOFF_INITIAL_SECS = 1.0
BACKOFF_MAX_SECS = 60.0
RESUME_ATTEMPTS = 3  # a resume URL that keeps failing (a stale session after a long stop): identify instead


class GatewayClosed(Exception):
    def __init__(self, code: int | None, reason: str = ""):
        super().__init__(f"gateway closed ({code}) {reason}".strip())
        self.code = code
        self.reason = reason


class Reconnect(Exception):
    """Leave this socket and connect again; ``resume`` says whether the session survives."""

    def __init__(self, why: str, *, resume: bool = True):
        super().__init__(why)
        self.resume = resume


class RecordFailed(Reconnect):
    """A message could not be written in the outbox (a disk full, an I/O error): its ``seq`` is not committed.
    The session is resumed from the last ``seq`` recorded, so Discord sends the message again; but after a pause
    that grows while it keeps failing (backoff), never at once, and never by identifying afresh (which would
    lose what was not recorded)."""


# ---------------------------------------------------------------- Markdown → Discord markup

_HEADING = re.compile(r"^(#{4,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)
_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")
_RULE = re.compile(r"^\s*([-*_])(\s*\1){2,}\s*$", re.MULTILINE)
_TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")


def markdown_to_discord(text: str) -> str:
    """Markdown as Discord renders it: what Discord lacks is rewritten, the rest passes as it is.

    Discord renders bold, italics, strike, code, fences, quotes, lists, masked links and ``#``
    to ``###`` headings. Deeper headings become bold lines, images become links, horizontal
    rules a blank line, and tables a code block (aligned text is all Discord can show).
    Fenced code is left untouched.
    """
    out: list[str] = []
    for i, chunk in enumerate(re.split(r"(^```.*?^```[ \t]*$)", text, flags=re.MULTILINE | re.DOTALL)):
        if i % 2:
            out.append(chunk)
            continue
        chunk = _HEADING.sub(lambda m: f"**{m.group(2)}**", chunk)
        chunk = _IMAGE.sub(lambda m: f"[{m.group(1) or 'image'}]({m.group(2)})", chunk)
        chunk = _RULE.sub("", chunk)
        out.append(_tables_to_code(chunk))
    return "".join(out)


def _tables_to_code(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        if (_TABLE_ROW.match(lines[i]) and i + 1 < len(lines)
                and re.match(r"^\s*\|?\s*:?-{3,}", lines[i + 1])):
            block = []
            while i < len(lines) and _TABLE_ROW.match(lines[i]):
                block.append(lines[i].strip())
                i += 1
            out.extend(["```", *block, "```"])
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


# ---------------------------------------------------------------- inbound normalisation

def normalise_message(d: dict, *, own_user_id: str | None = None) -> InboundMessage | None:
    """A MESSAGE_CREATE payload as the host's ``InboundMessage``; None for what is not submitted."""
    author = d.get("author") or {}
    if author.get("bot") or (own_user_id and author.get("id") == own_user_id) or d.get("webhook_id"):
        return None  # the bot's own messages (and other bots') would loop
    if d.get("type", 0) not in (0, 19):  # DEFAULT and REPLY; joins, pins, boosts are not messages
        return None
    attachments = [Attachment(kind=_kind(a.get("content_type") or ""),
                              content_type=a.get("content_type") or "application/octet-stream",
                              url=a.get("url"), filename=a.get("filename"), size=a.get("size"),
                              channel_ref=a.get("id"))
                   for a in d.get("attachments") or [] if a.get("url")]
    reply_to = None
    ref = d.get("message_reference") or {}
    if ref.get("message_id") and d.get("type", 0) == 19:
        replied = d.get("referenced_message") or {}
        reply_to = ReplyContext(message_id=str(ref["message_id"]), text=replied.get("content") or None,
                                sender_id=(replied.get("author") or {}).get("id"))
    member = d.get("member") or {}
    name = member.get("nick") or author.get("global_name") or author.get("username")
    metadata = {"guild_id": d["guild_id"]} if d.get("guild_id") else {}
    return InboundMessage(
        channel="discord", conversation_id=str(d["channel_id"]), message_id=str(d["id"]),
        sender_id=str(author.get("id", "")), sender_name=name,
        source_type="room" if d.get("guild_id") else "user",
        text=d.get("content") or "", attachments=attachments, reply_to=reply_to,
        timestamp=_timestamp(d.get("timestamp")), metadata=metadata)


def _kind(content_type: str) -> str:
    major = content_type.split("/", 1)[0]
    return major if major in ("image", "audio", "video") else "document" if content_type else "other"


def _timestamp(value) -> str:
    from plugins_app.channel.sdk.messages import utc_now
    if isinstance(value, str) and value:
        return value.replace("+00:00", "Z")
    return utc_now()


def nonce_for(delivery_id: str, part: int) -> str:
    """Discord's ``nonce`` (25 characters at most) for one part of one delivery."""
    return hashlib.sha256(delivery_id.encode()).hexdigest()[:21] + f"{part:04d}"


# ---------------------------------------------------------------- REST with Discord's rate limits

class Rest:
    """Discord's REST API: the bot token, 429s waited out, per-route and global buckets honoured."""

    def __init__(self, base_url: str, token: str):
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(timeout=httpx.Timeout(30.0, connect=10.0), headers={
            "Authorization": f"Bot {token}", "User-Agent": "DiscordBot (https://github.com/ugent, 1.0)"})
        self._lock = threading.Lock()
        self._route_free_at: dict[str, float] = {}   # route key → monotonic time it may be used again
        self._global_free_at = 0.0

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, *, route: str | None = None, **kwargs) -> httpx.Response:
        route = route or f"{method} {path}"
        waited = 0.0
        while True:
            with self._lock:
                delay = max(self._route_free_at.get(route, 0.0), self._global_free_at) - time.monotonic()
            if delay > 0:
                if waited + delay > MAX_RATE_LIMIT_WAIT_SECS:
                    raise DeliveryFailed(f"discord: rate limited for {delay:.1f} s more")
                waited += delay
                time.sleep(delay)  # the same request, once the limit has passed
            resp = self.http.request(method, self.base_url + path, **kwargs)
            self._note_bucket(route, resp)
            if resp.status_code != 429:
                return resp
            retry_after = _retry_after(resp)
            with self._lock:
                until = time.monotonic() + retry_after
                if resp.headers.get("X-RateLimit-Global", "").lower() == "true" or _json(resp).get("global"):
                    self._global_free_at = max(self._global_free_at, until)
                else:
                    self._route_free_at[route] = max(self._route_free_at.get(route, 0.0), until)

    def _note_bucket(self, route: str, resp: httpx.Response) -> None:
        if resp.headers.get("X-RateLimit-Remaining") == "0":
            try:
                reset_after = float(resp.headers.get("X-RateLimit-Reset-After", "0"))
            except ValueError:
                return
            with self._lock:
                self._route_free_at[route] = time.monotonic() + reset_after


def _json(resp: httpx.Response) -> dict:
    try:
        value = resp.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _retry_after(resp: httpx.Response) -> float:
    for value in (_json(resp).get("retry_after"), resp.headers.get("Retry-After")):
        try:
            return max(0.0, float(value))
        except (TypeError, ValueError):
            continue
    return 1.0


def _error(resp: httpx.Response) -> str:
    body = _json(resp)
    detail = body.get("message") or resp.reason_phrase
    code = f" (code {body['code']})" if "code" in body else ""
    return f"{resp.status_code} {detail}{code}"


# ---------------------------------------------------------------- the worker

class DiscordWorker(WebhookInbox, ChannelWorker):
    kind = KIND
    version = "1.0.0"
    capabilities = ("media",)

    def __init__(self, *, api_base_url: str | None = None, bot_token: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.api_base_url = (api_base_url or os.environ.get("DISCORD_API_BASE_URL") or DEFAULT_API_BASE_URL)
        self.bot_token = bot_token if bot_token is not None else os.environ.get("DISCORD_BOT_TOKEN", "")
        self.rest: Rest | None = None
        self.gateway_url: str | None = None
        self.own_user_id: str | None = None
        self.session_path = Path(self.state_dir or default_state_dir()) / f"{self.plugin_id}.discord-session.json"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ws = None
        # _refusal: a revoked token noticed on the REST side; _inbox: recorded messages, for the listener's lanes;
        # _inbox_error: what ended the gateway thread
        self.inbox_init()

    # -- connect / disconnect ----------------------------------------------------------

    def connect(self) -> None:
        if not self.bot_token:
            raise ChannelRefused("DISCORD_BOT_TOKEN is not set")
        self.rest = Rest(self.api_base_url, self.bot_token)
        try:
            resp = self.rest.request("GET", "/gateway/bot")
        except httpx.HTTPError as exc:
            raise RuntimeError(f"discord: GET /gateway/bot failed: {exc}") from exc
        if resp.status_code == 401:
            raise ChannelRefused(f"discord refused the bot token: {_error(resp)}")
        if resp.status_code == 403:
            raise ChannelRefused(f"discord refused the bot: {_error(resp)}")
        if resp.status_code != 200:
            raise RuntimeError(f"discord: GET /gateway/bot answered {_error(resp)}")
        self.gateway_url = _json(resp).get("url")
        if not self.gateway_url:
            raise RuntimeError("discord: GET /gateway/bot named no url")

    def disconnect(self) -> None:
        if self.rest is not None:
            self.rest.close()

    # -- inbound: the Gateway ----------------------------------------------------------------

    def listen(self, submit) -> None:
        """The Gateway in a thread of its own records each message (``_gateway_main``); here each channel's are
        submitted on a lane of that channel's, so one channel's file downloading holds back no other."""
        gateway = threading.Thread(target=self._gateway_main, name="discord-gateway", daemon=True)
        gateway.start()
        try:
            InboxLanes(self, submit, name="discord-inbox").run(self._inbox, lambda: self._inbox_error,
                                                               what="the gateway failed: ")
        finally:
            if self.stopping.is_set() or self._refusal:
                gateway.join(5)  # (else the worker is stopped next, which ends it: ChannelWorker._listen_main)

    def _gateway_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._gateway())
            if not (self.stopping.is_set() or self._refusal):
                raise RuntimeError("the gateway loop ended")
        except Exception as exc:  # noqa: BLE001 - the listener raises it: the worker is restarted
            self._inbox_error = exc
        finally:
            loop.close()

    async def _gateway(self) -> None:
        import websockets
        session = self._session_load()
        backoff = BACKOFF_INITIAL_SECS
        failures = 0
        stop_task = asyncio.ensure_future(self._stopped_event())
        try:
            while not self.stopping.is_set() and not self._refusal:
                resuming = bool(session.get("session_id") and session.get("resume_gateway_url"))
                url = session["resume_gateway_url"] if resuming else self.gateway_url
                healthy = record_failed = False
                try:
                    async with websockets.connect(_gateway_query(url), max_size=None, open_timeout=15,
                                                  close_timeout=2, ping_interval=None) as ws:
                        self._ws = ws
                        run = asyncio.ensure_future(self._session(ws, session, resuming))
                        done, _ = await asyncio.wait({run, stop_task}, return_when=asyncio.FIRST_COMPLETED)
                        if run not in done:
                            run.cancel()
                            await ws.close(ZOMBIE_CLOSE_CODE, "worker stopping")  # keeps the session resumable
                            await asyncio.gather(run, return_exceptions=True)
                            return
                        healthy = run.result()
                except RecordFailed as exc:
                    self.log.warning("gateway: %s; resuming in a while", exc)
                    record_failed = True
                except Reconnect as exc:
                    self.log.info("gateway: %s; %s", exc, "resuming" if exc.resume else "identifying afresh")
                    healthy = True
                    if not exc.resume:
                        session.clear()
                        self._session_save(session)
                        await asyncio.sleep(random.uniform(1.0, 5.0))  # as Discord asks after op 9 false
                except GatewayClosed as exc:
                    if exc.code in REFUSING_CLOSE_CODES:
                        self._refusal = REFUSING_CLOSE_CODES[exc.code]
                        self.log.error("gateway closed with %s: not reconnecting", exc.code)
                        return
                    if exc.code in FRESH_SESSION_CLOSE_CODES:
                        session.clear()
                        self._session_save(session)
                    healthy = session.pop("_healthy", False)
                    self.log.warning("gateway closed (%s %s); reconnecting", exc.code, exc.reason)
                except (OSError, asyncio.TimeoutError, websockets.exceptions.WebSocketException) as exc:
                    healthy = session.pop("_healthy", False)
                    self.log.warning("gateway connection failed: %s", exc)
                finally:
                    self._ws = None
                # (a connection that could not record a message resumed: it is no failed resume, and identifying
                # afresh would lose the message; but it backs off as a failure does)
                failures = 0 if healthy or record_failed else failures + 1
                if resuming and failures >= RESUME_ATTEMPTS:
                    self.log.warning("gateway: %d attempts to resume failed; identifying afresh", failures)
                    session.clear()
                    self._session_save(session)
                backoff = BACKOFF_INITIAL_SECS if healthy else min(backoff * 2, BACKOFF_MAX_SECS)
                delay = 0.0 if healthy else backoff * random.uniform(0.5, 1.0)
                if delay:
                    await asyncio.wait({stop_task}, timeout=delay)
        finally:
            stop_task.cancel()

    async def _stopped_event(self) -> None:
        while not self.stopping.is_set() and not self._refusal:
            await asyncio.sleep(0.1)

    async def _session(self, ws, session: dict, resuming: bool) -> bool:
        """One websocket connection: HELLO, IDENTIFY or RESUME, then events until it ends."""
        import websockets
        hello = await self._recv(ws, timeout=30)
        if hello.get("op") != OP_HELLO:
            raise Reconnect(f"expected HELLO, got op {hello.get('op')}")
        interval = float(hello["d"]["heartbeat_interval"]) / 1000.0
        beat = {"acked": True, "seq": session.get("seq")}
        if resuming:
            await ws.send(json.dumps({"op": OP_RESUME, "d": {"token": self.bot_token,
                                      "session_id": session["session_id"], "seq": session.get("seq")}}))
        else:
            await ws.send(json.dumps({"op": OP_IDENTIFY, "d": {
                "token": self.bot_token, "intents": INTENTS,
                "properties": {"os": "linux", "browser": "ugent", "device": "ugent"}}}))
        heart = asyncio.ensure_future(self._gw_heartbeat(ws, interval, beat))
        queue: asyncio.Queue = asyncio.Queue()
        consumer = asyncio.ensure_future(self._consume(ws, queue, session))
        reader = None
        try:
            while True:
                reader = asyncio.ensure_future(self._recv(ws))
                done, _ = await asyncio.wait({reader, heart, consumer}, return_when=asyncio.FIRST_COMPLETED)
                if reader not in done:
                    reader.cancel()
                    for task in (heart, consumer):
                        if task in done:
                            task.result()  # raises Reconnect (zombied) or the consumer's failure
                payload = reader.result()
                op = payload.get("op")
                if payload.get("s") is not None:
                    beat["seq"] = payload["s"]
                if op == OP_HEARTBEAT_ACK:
                    beat["acked"] = True
                elif op == OP_HEARTBEAT:
                    await ws.send(json.dumps({"op": OP_HEARTBEAT, "d": beat["seq"]}))
                elif op == OP_RECONNECT:
                    await _recorded(queue, consumer)
                    await ws.close(ZOMBIE_CLOSE_CODE, "reconnect requested")
                    raise Reconnect("RECONNECT requested")
                elif op == OP_INVALID_SESSION:
                    await _recorded(queue, consumer)
                    await ws.close(ZOMBIE_CLOSE_CODE, "invalid session")
                    raise Reconnect("INVALID_SESSION", resume=bool(payload.get("d")))
                elif op == OP_DISPATCH:
                    await self._dispatch(payload, session, queue)
        except websockets.exceptions.ConnectionClosed as exc:
            rcvd = exc.rcvd
            await _recorded(queue, consumer)  # (raises RecordFailed if a message not recorded closed it: a backoff)
            session["_healthy"] = bool(session.get("_ready"))
            raise GatewayClosed(rcvd.code if rcvd else None, rcvd.reason if rcvd else "") from None
        finally:
            for task in (heart, consumer, reader):  # (the reader too: cancelled by a stop, it would see the close)
                if task is None:
                    continue
                task.cancel()
                if task.done() and not task.cancelled():
                    task.exception()  # (retrieved: asyncio would log "Task exception was never retrieved")
            session.pop("_ready", None)

    async def _dispatch(self, payload: dict, session: dict, queue: asyncio.Queue) -> None:
        kind, d, seq = payload.get("t"), payload.get("d") or {}, payload.get("s")
        if kind == "READY":
            self.own_user_id = (d.get("user") or {}).get("id")
            session.update(session_id=d.get("session_id"), resume_gateway_url=d.get("resume_gateway_url"),
                           seq=seq, user_id=self.own_user_id, _ready=True)
            self._session_save(session)
            self.log.info("gateway READY as %s (session %s)", self.own_user_id, d.get("session_id"))
        elif kind == "RESUMED":
            self.own_user_id = self.own_user_id or session.get("user_id")
            session["_ready"] = True
            self.log.info("gateway RESUMED session %s", session.get("session_id"))
        await queue.put((kind, d, seq))

    async def _consume(self, ws, queue: asyncio.Queue, session: dict) -> None:
        """Record messages in the order they came and hand each to the listener's lanes; a ``seq`` is committed
        once its message is in the outbox. A message that cannot be recorded ends the connection, its ``seq``
        not committed: the session is resumed from the last one recorded and Discord sends it again."""
        while True:
            kind, d, seq = await queue.get()
            try:
                msg = None
                if kind == "MESSAGE_CREATE":
                    try:
                        msg = normalise_message(d, own_user_id=self.own_user_id or session.get("user_id"))
                        if msg is not None:
                            msg.validate()
                    except MessageValidationError as exc:
                        self.log.error("message %s skipped: %s", d.get("id"), exc)
                        msg = None
                    except Exception:  # noqa: BLE001 - one malformed event must not stop the channel
                        self.log.exception("could not read %s (seq %s); skipped", kind, seq)
                        msg = None
                if msg is not None:
                    try:
                        await asyncio.to_thread(self._record, msg)
                    except Exception as exc:  # noqa: BLE001 - its seq stays: resumed, Discord sends it again
                        self.log.error("could not record message %s (seq %s): %s: %s", msg.message_id, seq,
                                       type(exc).__name__, exc)
                        await ws.close(ZOMBIE_CLOSE_CODE, "resuming")  # (not 1000: the session must survive)
                        raise RecordFailed(f"message {msg.message_id} could not be recorded") from exc
                if seq is not None and session.get("session_id"):
                    session["seq"] = seq
                    self._session_save(session)
            finally:
                queue.task_done()

    def _record(self, message: InboundMessage) -> None:
        """Write a message in the outbox and queue it for the listener's lanes (not one the hub already took)."""
        if not self.inbox_record(message):
            self.log.info("message %s: duplicate (the hub had it already)", message.message_id)

    async def _gw_heartbeat(self, ws, interval: float, beat: dict) -> None:
        await asyncio.sleep(interval * random.random())  # the first beat is jittered, as Discord asks
        while True:
            if not beat["acked"]:
                self.log.warning("gateway: no HEARTBEAT_ACK since the last heartbeat (zombied connection); "
                                 "reconnecting")
                await ws.close(ZOMBIE_CLOSE_CODE, "heartbeat not acknowledged")
                raise Reconnect("no HEARTBEAT_ACK since the last heartbeat (zombied connection)")
            beat["acked"] = False
            await ws.send(json.dumps({"op": OP_HEARTBEAT, "d": beat["seq"]}))
            await asyncio.sleep(interval)

    @staticmethod
    async def _recv(ws, timeout: float | None = None) -> dict:
        raw = await asyncio.wait_for(ws.recv(), timeout) if timeout else await ws.recv()
        try:
            payload = json.loads(raw)
        except ValueError:
            return {}
        return payload if isinstance(payload, dict) else {}

    def _session_load(self) -> dict:
        try:
            value = json.loads(self.session_path.read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    def _session_save(self, session: dict) -> None:
        keep = {k: v for k, v in session.items() if not k.startswith("_")}
        tmp = self.session_path.with_suffix(".tmp")
        try:
            self.session_path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(keep))
            os.chmod(tmp, 0o600)
            tmp.replace(self.session_path)
        except OSError:
            self.log.exception("could not save the gateway session")

    # -- media --------------------------------------------------------------------------------

    def fetch_media(self, attachment: Attachment) -> bytes | None:
        if not attachment.url:
            return None
        # Discord's CDN URLs are signed; they need no token (and must not get it). A 5xx, a 429 or no answer:
        # MediaNotReady. Any other status is final (a 403/404 is a link expired or a file deleted).
        resp = download(attachment.url)
        if resp.status_code != 200:
            raise RuntimeError(f"discord: attachment download answered {resp.status_code}")
        return resp.content

    # -- outbound -----------------------------------------------------------------------------

    def deliver(self, delivery) -> str | None:
        assert self.rest is not None
        text = markdown_to_discord(delivery.text or "")
        parts = split_text(text, MESSAGE_LIMIT) if text.strip() else []
        files = []
        for att in delivery.attachments:
            if att.media_id:
                media = self.media_get(att.media_id)
                files.append((att.filename or media.filename or "file", media.data, media.content_type))
        if not parts and not files:
            raise DeliveryFailed("discord: nothing to send (no text, no files)", permanent=True)
        ids = []
        count = max(len(parts), 1)
        for i in range(count):
            body = {"content": parts[i] if i < len(parts) else "", "nonce": nonce_for(delivery.delivery_id, i),
                    "enforce_nonce": True, "allowed_mentions": {"parse": []}}
            if i == 0 and delivery.reply_to_message_id:
                body["message_reference"] = {"message_id": delivery.reply_to_message_id,
                                             "fail_if_not_exists": False}
            last = i == count - 1
            ids.append(self._create_message(delivery.conversation_id, body, files if last else []))
        return ids[0]

    def _create_message(self, channel_id: str, body: dict, files: list) -> str:
        route = f"POST /channels/{channel_id}/messages"
        path = f"/channels/{channel_id}/messages"
        if files:
            body = dict(body, attachments=[{"id": n, "filename": f[0]} for n, f in enumerate(files)])
            kwargs = {"data": {"payload_json": json.dumps(body)},
                      "files": [(f"files[{n}]", (f[0], f[1], f[2])) for n, f in enumerate(files)]}
        else:
            kwargs = {"json": body}
        try:
            resp = self.rest.request("POST", path, route=route, **kwargs)  # type: ignore[union-attr]
        except httpx.HTTPError as exc:
            raise DeliveryFailed(f"discord: {type(exc).__name__}: {exc}") from exc
        if resp.status_code in (200, 201):
            return str(_json(resp).get("id", ""))
        reason = f"discord: {_error(resp)}"
        if resp.status_code == 401:
            self._refusal = f"discord refused the bot token: {_error(resp)}"
            self._wake_listener()
            raise DeliveryFailed(reason)
        if resp.status_code in (400, 403, 404, 413):
            raise DeliveryFailed(reason, permanent=True)  # missing access, unknown channel, too large
        raise DeliveryFailed(reason)

    def _wake_listener(self) -> None:
        """End the gateway loop so listen() raises ChannelRefused with the refusal."""
        loop, ws = self._loop, self._ws
        if loop is not None and ws is not None and not loop.is_closed():
            asyncio.run_coroutine_threadsafe(ws.close(ZOMBIE_CLOSE_CODE, "token refused"), loop)


async def _recorded(queue: asyncio.Queue, consumer: asyncio.Future) -> None:
    """Wait until every event queued has been handled (its message recorded), or the consumer has ended; then
    raise what ended it (``RecordFailed``: the connection is left for that reason, whatever else came)."""
    if not consumer.done():
        joined = asyncio.ensure_future(queue.join())
        await asyncio.wait({joined, consumer}, return_when=asyncio.FIRST_COMPLETED)
        joined.cancel()
    if consumer.done() and not consumer.cancelled() and consumer.exception() is not None:
        raise consumer.exception()


def _gateway_query(url: str) -> str:
    base = url.rstrip("/")
    return f"{base}/?v={GATEWAY_VERSION}&encoding=json"


def main() -> None:
    parser = argparse.ArgumentParser(prog="channel-discord", description=DESCRIPTION)
    parser.add_argument("--api-base-url", default=None, help="default: $DISCORD_API_BASE_URL or " + DEFAULT_API_BASE_URL)
    args, _ = parser.parse_known_args()
    DiscordWorker.main(api_base_url=args.api_base_url)


if __name__ == "__main__":
    main()
