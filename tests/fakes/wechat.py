"""A fake OneBot 12 bridge for a WeChat account on loopback: the forward WebSocket, speaking OneBot 12's wire format.

The shapes follow https://12.onebot.dev (OneBot Connect: forward WebSocket, events, action requests and answers;
the interface's message events, meta events, segments, ``send_message``, ``get_file``, ``upload_file``,
``get_self_info``, ``get_version``) and what ComWeChatBotClient sends (platform ``wechat``, ``meta.connect`` then
``meta.status_update`` on each connection, a fresh event ``id`` per event, group ids ending ``@chatroom``). Like
a bridge, it pushes each event to the connections open now and keeps none for later.

    fake = FakeBridge().start()
    fake.url                                   # ws://127.0.0.1:PORT, for WECHAT_ONEBOT_URL
    fake.push_private("wxid_alice", "hi")      # a private message event
    fake.push_group("123@chatroom", "wxid_bob", [fake.mention(fake.self_id), fake.text(" hi")])
    fake.sent()                                # what send_message sent, in order
    fake.fail_next("send_message", 36000)      # the next send_message answers failed with that retcode
    fake.drop()                                # cut every socket without a close frame
    fake.drop_after_next("send_message")       # carry the next send out, then cut the socket before answering
    fake.stop()

``get_file`` answers ``type: url`` with a URL of its own HTTP server on the same port (``/get_file/<id>``, as
ComWeChatBotClient serves files; ``url_host`` is the host it writes in it, ``0.0.0.0`` for a bridge listening on
every address) unless ``serve_urls=False`` (then 10004, and ``type: data`` answers base64). With ``impl
"ComWechat"`` it behaves as ComWeChatBotClient does where that differs from the standard: ``get_file`` with
``type: data`` closes the connection (its JSON encoder cannot write a binary file), and ``send_message`` answers
``data: null``.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import itertools
import json
import threading
import time
import uuid
from http import HTTPStatus
from typing import Any

import websockets
from websockets.asyncio.server import serve

_ids = itertools.count(7000000000000000001)


def message_id() -> str:
    return str(next(_ids))


class FakeBridge:
    def __init__(self, *, access_token: str = "bridge-token", self_id: str = "wxid_ugentbot",
                 impl: str = "FakeOneBot", refuse_status: int = 401, platform: str = "wechat",
                 serve_urls: bool = True, url_host: str = "127.0.0.1"):
        self.access_token = access_token
        self.self_id = self_id
        self.impl = impl
        self.refuse_status = refuse_status  # the standard's 401; ComWeChatBotClient's server answers 403
        self.platform = platform
        self.serve_urls, self.url_host = serve_urls, url_host
        self.downloads: list[str] = []  # the file URLs fetched over HTTP
        self._drop_after: set[str] = set()
        self._hold: tuple[str | None, int] = (None, 0)
        self.held = threading.Event()
        self.lock = threading.Lock()
        self.connections: list[dict] = []   # every handshake: path, authorization, accepted
        self.actions: list[dict] = []       # every action request as it came
        self.messages: list[dict] = []      # what send_message sent: detail_type, user_id/group_id, message
        self.files: dict[str, tuple[str, bytes]] = {}   # file_id -> (name, bytes): get_file serves these
        self.uploads: dict[str, tuple[str, bytes]] = {}  # file_id -> (name, bytes): what upload_file took
        self._failures: dict[str, list[tuple[int, str]]] = {}
        self._open: set = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> "FakeBridge":
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the fake bridge did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(5)

    # ---------------------------------------------------------------- what a test drives

    @staticmethod
    def text(text: str) -> dict:
        return {"type": "text", "data": {"text": text}}

    @staticmethod
    def mention(user_id: str) -> dict:
        return {"type": "mention", "data": {"user_id": user_id}}

    @staticmethod
    def reply(message_id: str, user_id: str) -> dict:
        return {"type": "reply", "data": {"message_id": message_id, "user_id": user_id}}

    def file(self, kind: str, name: str, data: bytes) -> dict:
        """A segment of ``kind`` (image, voice, video, file) whose ``file_id`` ``get_file`` serves."""
        file_id = str(uuid.uuid4())
        self.files[file_id] = (name, data)
        return {"type": kind, "data": {"file_id": file_id}}

    def push_private(self, user_id: str, content: str | list[dict], *, msg_id: str | None = None) -> dict:
        segments = [self.text(content)] if isinstance(content, str) else content
        return self.push(self.message_event("private", segments, user_id=user_id, msg_id=msg_id))

    def push_group(self, group_id: str, user_id: str, segments: list[dict], *, msg_id: str | None = None) -> dict:
        return self.push(self.message_event("group", segments, user_id=user_id, group_id=group_id, msg_id=msg_id))

    def message_event(self, detail_type: str, segments: list[dict], *, user_id: str, group_id: str | None = None,
                      msg_id: str | None = None) -> dict:
        event = {"id": str(uuid.uuid4()), "time": time.time(), "type": "message", "detail_type": detail_type,
                 "sub_type": "", "self": {"platform": self.platform, "user_id": self.self_id},
                 "message_id": msg_id or message_id(), "message": segments,
                 "alt_message": "".join(s["data"].get("text", f"[{s['type']}]") for s in segments),
                 "user_id": user_id}
        if group_id is not None:
            event["group_id"] = group_id
        return event

    def push(self, event: dict) -> dict:
        """Send ``event`` on every open connection now (a fresh event ``id`` each time, as a bridge makes one)."""
        self._call(self._broadcast(dict(event, id=str(uuid.uuid4()))))
        return event

    def fail_next(self, action: str, retcode: int, message: str = "", times: int = 1) -> None:
        with self.lock:
            self._failures.setdefault(action, []).extend([(retcode, message or f"failed with {retcode}")] * times)

    def sent(self) -> list[dict]:
        with self.lock:
            return list(self.messages)

    def texts(self) -> list[str]:
        return ["".join(s["data"]["text"] for s in m["message"] if s["type"] == "text") for m in self.sent()]

    def calls(self, action: str) -> list[dict]:
        with self.lock:
            return [a for a in self.actions if a.get("action") == action]

    def connected(self) -> int:
        return len(self._open)

    def hold(self, action: str | None, *, after: int = 0) -> None:
        """From now, requests of ``action`` (the first ``after`` of them aside) are neither carried out nor answered,
        as if still in the air; ``hold(None)`` ends it. ``held`` is set once one was held."""
        with self.lock:
            self._hold = (action, after)
            self.held.clear()

    def drop_after_next(self, action: str) -> None:
        """Carry out the next ``action``, then cut its connection without answering (the answer lost on the way)."""
        with self.lock:
            self._drop_after.add(action)

    def drop(self) -> None:
        """Cut every socket without a close frame (the bridge's host went away)."""
        self._call(self._drop())

    # ---------------------------------------------------------------- the server

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        loop.run_until_complete(self._serve())
        loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with serve(self._conn, "127.0.0.1", 0, process_request=self._check, ping_interval=None,
                         max_size=2 ** 26) as server:
            self.port = server.sockets[0].getsockname()[1]
            self.url = f"ws://127.0.0.1:{self.port}"
            self._ready.set()
            await self._stop.wait()

    def _call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def _check(self, connection, request):
        if request.path.startswith("/get_file/"):  # the bridge's file server (plain HTTP), no token asked
            entry = self.files.get(request.path.removeprefix("/get_file/"))
            with self.lock:
                self.downloads.append(request.path)
            if entry is None:
                return connection.respond(HTTPStatus.NOT_FOUND, "File not found")
            response = connection.respond(HTTPStatus.OK, "")
            for name, value in (("Content-Length", str(len(entry[1]))), ("Content-Type", "application/octet-stream")):
                del response.headers[name]
                response.headers[name] = value
            return dataclasses.replace(response, body=entry[1])
        authorization = request.headers.get("Authorization")
        record = {"path": request.path, "authorization": authorization, "accepted": False}
        with self.lock:
            self.connections.append(record)
        if self.access_token and authorization != f"Bearer {self.access_token}":
            return connection.respond(HTTPStatus(self.refuse_status),
                                      "Authorization Header is invalid" if authorization
                                      else "Missing Authorization Header")
        if request.path != "/":
            return connection.respond(HTTPStatus.NOT_FOUND, "Not Found")
        record["accepted"] = True
        return None

    async def _conn(self, ws) -> None:
        self._open.add(ws)
        try:
            await ws.send(json.dumps(self._meta("connect", version={
                "impl": self.impl, "version": "1.0", "onebot_version": "12"})))
            await ws.send(json.dumps(self._meta("status_update", status={"good": True, "bots": [
                {"self": {"platform": self.platform, "user_id": self.self_id}, "online": True}]})))
            async for raw in ws:
                try:
                    request = json.loads(raw)
                except ValueError:
                    await ws.send(json.dumps({"status": "failed", "retcode": 10001, "data": None,
                                              "message": "not JSON", "echo": None}))
                    continue
                with self.lock:
                    self.actions.append(request)
                    held, after = self._hold
                    if held is not None and request.get("action") == held:
                        if after:
                            self._hold = (held, after - 1)
                        else:
                            self.held.set()
                            continue  # in the air: never carried out, never answered
                action = request.get("action")
                params = request.get("params") or {}
                if self.impl == "ComWechat" and action == "get_file" and params.get("type") == "data":
                    ws.transport.abort()  # its encoder raises on the bytes, and its handler closes the socket
                    return
                answer = self._action(action, params)
                answer["echo"] = request.get("echo")
                with self.lock:
                    lost = action in self._drop_after
                    self._drop_after.discard(action)
                if lost:
                    ws.transport.abort()
                    return
                await ws.send(json.dumps(answer))
        except websockets.exceptions.ConnectionClosed:
            pass
        finally:
            self._open.discard(ws)

    def _meta(self, detail_type: str, **fields) -> dict:
        return {"id": str(uuid.uuid4()), "time": time.time(), "type": "meta", "detail_type": detail_type,
                "sub_type": "", **fields}

    @staticmethod
    def _ok(data) -> dict:
        return {"status": "ok", "retcode": 0, "data": data, "message": ""}

    @staticmethod
    def _failed(retcode: int, message: str) -> dict:
        return {"status": "failed", "retcode": retcode, "data": None, "message": message}

    def _action(self, action: str, params: dict) -> dict:
        with self.lock:
            queued = self._failures.get(action)
            failure = queued.pop(0) if queued else None
        if failure is not None:
            return self._failed(*failure)
        if action == "get_self_info":
            return self._ok({"user_id": self.self_id, "user_name": "UGENT", "user_displayname": ""})
        if action == "get_version":
            return self._ok({"impl": self.impl, "version": "1.0", "onebot_version": "12"})
        if action == "send_message":
            return self._send_message(params)
        if action == "get_file":
            entry = self.files.get(params.get("file_id"))
            if entry is None:
                return self._failed(32000, "未找到该文件")
            if params.get("type") == "url" and self.serve_urls:
                return self._ok({"name": entry[0],
                                 "url": f"http://{self.url_host}:{self.port}/get_file/{params['file_id']}"})
            if params.get("type") != "data":
                return self._failed(10004, f"type {params.get('type')} is not served by the fake")
            return self._ok({"name": entry[0], "data": base64.b64encode(entry[1]).decode()})
        if action == "upload_file":
            if params.get("type") != "data" or not isinstance(params.get("data"), str) or not params.get("name"):
                return self._failed(10003, "type data with name and data")
            file_id = str(uuid.uuid4())
            self.uploads[file_id] = (params["name"], base64.b64decode(params["data"]))
            return self._ok({"file_id": file_id})
        return self._failed(10002, f"unsupported action {action}")

    def _send_message(self, params: dict) -> dict:
        detail_type, segments = params.get("detail_type"), params.get("message")
        target = {"private": "user_id", "group": "group_id"}.get(detail_type)
        if target is None or not params.get(target) or not isinstance(segments, list) or not segments:
            return self._failed(10003, "detail_type, its user_id or group_id, and message are required")
        for seg in segments:
            if seg.get("type") not in ("text", "image", "file", "reply", "mention"):
                return self._failed(10005, f"unsupported segment {seg.get('type')}")
            if seg["type"] in ("image", "file") and seg["data"].get("file_id") not in self.uploads:
                return self._failed(10006, "no such file_id")
        sent = {"detail_type": detail_type, target: params[target], "message": segments, "message_id": message_id()}
        with self.lock:
            self.messages.append(sent)
        if self.impl == "ComWechat":
            return self._ok(None)  # ComWeChatBotClient names no message id
        return self._ok({"message_id": sent["message_id"], "time": time.time()})

    async def _broadcast(self, event: dict) -> None:
        for ws in list(self._open):
            try:
                await ws.send(json.dumps(event, ensure_ascii=False))
            except websockets.exceptions.ConnectionClosed:
                pass

    async def _drop(self) -> None:
        for ws in list(self._open):
            ws.transport.abort()
        self._open.clear()
